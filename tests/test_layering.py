"""The Spark side never imports Airflow: a pipeline's driver runs on cluster nodes without it.

Each module of the model, the store, the runtime and the example pipelines is imported in a fresh
interpreter in which any ``import airflow`` fails, so an Airflow import added anywhere on that side
(directly or through a module it imports) fails this test with the module that pulled it in. The same
interpreter reports the distributions it loaded: all must come with the ``[spark]`` extra, the list a driver
image without Airflow installs (docs/airflow.md).
"""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys
import textwrap

import pytest

import airflow_arroyo
import airflow_arroyo.examples
import airflow_arroyo.runtime
import airflow_arroyo.store

_AIRFLOW_FREE_TOP = ["airflow_arroyo.epochs", "airflow_arroyo.supervision", "airflow_arroyo.exceptions",
                     "airflow_arroyo.fs", "airflow_arroyo.jvm", "airflow_arroyo.connections",
                     "airflow_arroyo.retention", "airflow_arroyo.scrub", "airflow_arroyo.cli", "airflow_arroyo.summary",
                     "airflow_arroyo.restores", "airflow_arroyo.units", "airflow_arroyo.stopping",
                     "airflow_arroyo.testing"]
# The Airflow side (docs/architecture.md): one subpackage per extension point, and the modules that talk to Airflow.
_AIRFLOW_SIDE_TOP = ["airflow_arroyo.hooks", "airflow_arroyo.operators", "airflow_arroyo.sensors",
                     "airflow_arroyo.triggers", "airflow_arroyo.links", "airflow_arroyo.ui", "airflow_arroyo.assets",
                     "airflow_arroyo.metrics", "airflow_arroyo.config", "airflow_arroyo.provider"]
# Neither: development tools (a throwaway PostgreSQL, airflow standalone, a Spark cluster for tests).
_TOOLS = ["airflow_arroyo.devtools"]
# Modules inside a package above that its package does not import, Airflow-free all the same: the JVM artifacts
# (read where Spark starts), and the Kafka broker the tests and the demo run beside Spark.
_AIRFLOW_FREE_INNER = ["airflow_arroyo.jvm.artifacts", "airflow_arroyo.devtools.kafka"]


def _spark_side_modules() -> list[str]:
    mods = [*_AIRFLOW_FREE_TOP, *_AIRFLOW_FREE_INNER]
    for package in (airflow_arroyo.store, airflow_arroyo.runtime, airflow_arroyo.examples):
        mods.append(package.__name__)
        mods += [f"{package.__name__}.{m.name}" for m in pkgutil.iter_modules(package.__path__)]
    return mods


_BLOCKER_SETUP = textwrap.dedent(
    """
    import importlib.abc, sys

    class _NoAirflow(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "airflow" or name.startswith("airflow."):
                raise ImportError(f"Airflow is not installed here (imported {name!r})")
            return None

    sys.meta_path.insert(0, _NoAirflow())
    """
)

# Imports the modules named on the command line with Airflow blocked, then prints (last line) every top-level
# package they loaded with the distributions that install it.
_IMPORT = _BLOCKER_SETUP + textwrap.dedent(
    """
    import importlib, importlib.metadata as md, json
    for mod in sys.argv[1:]:
        try:
            importlib.import_module(mod)
        except ImportError as exc:
            print(f"{mod}: {exc}")
            sys.exit(1)
    owners = md.packages_distributions()
    tops = {m.split(".")[0] for m in list(sys.modules)} - set(sys.stdlib_module_names) - {"airflow_arroyo", "tests"}
    print(json.dumps(sorted({top: sorted(set(owners.get(top, []))) for top in tops}.items())))
    """
)


@pytest.fixture(scope="module")
def spark_side_import() -> subprocess.CompletedProcess[str]:
    """One interpreter importing every Airflow-free module (a few seconds: it imports PySpark)."""
    modules = _spark_side_modules()
    assert "airflow_arroyo.runtime.driver" in modules and "airflow_arroyo.store._sync" in modules
    return subprocess.run([sys.executable, "-c", _IMPORT, *modules], capture_output=True, text=True, timeout=300)


def test_the_blocker_blocks_airflow() -> None:
    """The check itself can fail: importing an Airflow-side module is refused."""
    proc = subprocess.run([sys.executable, "-c", _IMPORT, "airflow_arroyo.hooks.arroyo"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Airflow is not installed here" in proc.stdout


def test_every_top_level_module_has_a_side() -> None:
    """A new module is placed on a side on purpose (and the Airflow-free side is then checked below)."""
    top = {f"airflow_arroyo.{m.name}" for m in pkgutil.iter_modules(airflow_arroyo.__path__)}
    sides = {"airflow_arroyo.store", "airflow_arroyo.runtime", "airflow_arroyo.examples",
             *_AIRFLOW_FREE_TOP, *_AIRFLOW_SIDE_TOP, *_TOOLS}
    assert top == sides, f"unplaced: {sorted(top - sides)}; gone: {sorted(sides - top)}"


def test_spark_side_modules_import_without_airflow(spark_side_import: subprocess.CompletedProcess[str]) -> None:
    """The driver, the store, the CLI, retention, scrub, testing and the examples import without Airflow."""
    assert spark_side_import.returncode == 0, spark_side_import.stdout + spark_side_import.stderr


def _requirement_closure(roots: list[str]) -> set[str]:
    """The distributions ``roots`` (requirement strings) install, with every dependency they pull in (here)."""
    import importlib.metadata as md

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    seen: set[str] = set()
    todo = list(roots)
    while todo:
        req = Requirement(todo.pop())
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        name = canonicalize_name(req.name)
        if name in seen:
            continue
        seen.add(name)
        try:
            todo += md.requires(req.name) or []
        except md.PackageNotFoundError:
            continue
    return seen


def test_the_spark_extra_is_all_the_driver_imports(spark_side_import: subprocess.CompletedProcess[str]) -> None:
    """docs/airflow.md: a driver image without Airflow installs ``--no-deps airflow-arroyo`` plus the ``[spark]``
    list. Every distribution the Airflow-free modules import must then be installed: it is in that list or
    something in it depends on it."""
    import tomllib
    from pathlib import Path

    from packaging.utils import canonicalize_name

    pyproject = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    spark_extra = pyproject["project"]["optional-dependencies"]["spark"]
    installed_by_recipe = _requirement_closure(spark_extra)
    assert spark_side_import.returncode == 0, spark_side_import.stdout + spark_side_import.stderr
    imported = dict(json.loads(spark_side_import.stdout.strip().splitlines()[-1]))
    assert "pyspark" in imported and "psycopg2" in imported  # the check sees what the driver really imports
    missing = {top: dists for top, dists in imported.items()
               if dists and not {canonicalize_name(d) for d in dists} & installed_by_recipe}
    assert not missing, f"imported by the driver side but not installed by the [spark] list: {missing}"
