"""The Spark side never imports Airflow: a pipeline's driver runs on cluster nodes without it.

Each module of the model, the store, the runtime and the example pipelines is imported in a fresh
interpreter in which any ``import airflow`` fails, so an Airflow import added anywhere on that side
(directly or through a module it imports) fails this test with the module that pulled it in. The same
interpreter reports the distributions it loaded: all must come with the ``[spark]`` extra, the list a driver
image without Airflow installs (docs/airflow.md).
"""

from __future__ import annotations

import ast
import dataclasses
import json
import pkgutil
import subprocess
import sys
import textwrap
from collections.abc import Iterable
from pathlib import Path

import pytest

import airflow_arroyo
import airflow_arroyo.core
import airflow_arroyo.examples
import airflow_arroyo.runtime
import airflow_arroyo.store

# The Airflow-free core is a package of its own (docs/architecture.md); beside it the JVM artifacts, the ops
# CLI and the test helpers users import.
_AIRFLOW_FREE_TOP = ["airflow_arroyo.core", "airflow_arroyo.jvm", "airflow_arroyo.cli", "airflow_arroyo.testing"]
# The Airflow side (docs/architecture.md): one subpackage per extension point, and the modules that talk to Airflow.
_AIRFLOW_SIDE_TOP = ["airflow_arroyo.hooks", "airflow_arroyo.submit", "airflow_arroyo.operators",
                     "airflow_arroyo.sensors", "airflow_arroyo.triggers", "airflow_arroyo.links", "airflow_arroyo.ui",
                     "airflow_arroyo.assets", "airflow_arroyo.metrics", "airflow_arroyo.config",
                     "airflow_arroyo.provider",
                     # OpenLineage events: its client comes with Airflow's OpenLineage provider, not the [spark] list
                     "airflow_arroyo.lineage"]
# Neither: development tools (a throwaway PostgreSQL, airflow standalone, a Spark cluster for tests).
_TOOLS = ["airflow_arroyo.devtools"]
# Modules inside a package above that its package does not import, Airflow-free all the same: the JVM artifacts
# (read where Spark starts), and the Kafka broker the tests and the demo run beside Spark.
_AIRFLOW_FREE_INNER = ["airflow_arroyo.jvm.artifacts", "airflow_arroyo.devtools.kafka"]


def _spark_side_modules() -> list[str]:
    mods = [*_AIRFLOW_FREE_TOP, *_AIRFLOW_FREE_INNER]
    for package in (airflow_arroyo.core, airflow_arroyo.store, airflow_arroyo.runtime, airflow_arroyo.examples):
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


# --------------------------------------------------------------------------- imports read from the syntax tree
#
# The interpreter check above sees only what runs at import time. These read every ``import`` in the source,
# at module level, in functions and under ``TYPE_CHECKING`` alike, so an Airflow import moved into a function
# (which would fail only when that function runs on a node without Airflow) is caught too.

_PACKAGE = Path(airflow_arroyo.__file__).resolve().parent
# Inside Airflow-free packages, modules that are on the Airflow side all the same (their docstrings say so):
# the example DAGs' helpers.
_AIRFLOW_SIDE_INNER = ["airflow_arroyo.examples.report"]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(_PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(_PACKAGE.rglob("*.py"))}


@dataclasses.dataclass(frozen=True)
class _Import:
    module: str  # the module imported (for ``from pkg import sub``, the submodule)
    line: int
    optional: bool  # inside ``try:`` with an ``except ImportError`` (or a parent of it): the module works without


def _imports(source: str, name: str, is_package: bool, known: Iterable[str]) -> list[_Import]:
    """Every import in ``source`` (module ``name``), wherever it is written."""
    known = set(known)
    package = name if is_package else name.rpartition(".")[0]
    tree = ast.parse(source)
    optional_lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try) and any(_catches_import_error(h) for h in node.handlers):
            for stmt in node.body:
                optional_lines.update(range(stmt.lineno, (stmt.end_lineno or stmt.lineno) + 1))
    out: list[_Import] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [_Import(a.name, node.lineno, node.lineno in optional_lines) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in known]
            if len(subs) < len(node.names):
                out.append(_Import(target, node.lineno, node.lineno in optional_lines))
            out += [_Import(s, node.lineno, node.lineno in optional_lines) for s in subs]
    return out


def _catches_import_error(handler: ast.ExceptHandler) -> bool:
    names = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any(isinstance(n, ast.Name) and n.id in ("ImportError", "ModuleNotFoundError")
               for n in names)


def _under(module: str, roots: Iterable[str]) -> bool:
    return any(module == r or module.startswith(f"{r}.") for r in roots)


_FREE_ROOTS = ["airflow_arroyo.store", "airflow_arroyo.runtime", "airflow_arroyo.examples", *_AIRFLOW_FREE_TOP,
               *_AIRFLOW_FREE_INNER]
_SIDE_ROOTS = [*_AIRFLOW_SIDE_TOP, *_AIRFLOW_SIDE_INNER]


def _airflow_free(module: str) -> bool:
    return _under(module, _FREE_ROOTS) and not _under(module, _SIDE_ROOTS)


def _airflow_imports(name: str, source: str, is_package: bool, known: Iterable[str]) -> list[str]:
    """The imports of Airflow, or of a module on the Airflow side, that ``name`` makes without a fallback."""
    return [f"{name}:{i.line} imports {i.module}" for i in _imports(source, name, is_package, known)
            if not i.optional and (_under(i.module, ["airflow"]) or _under(i.module, _SIDE_ROOTS))]


def test_no_airflow_free_module_imports_airflow_anywhere_in_its_source() -> None:
    """Function-level and type-only imports count; an import under ``try: ... except ImportError`` is an
    optional feature (``--conn-id`` resolving a connection through Airflow when Airflow is installed)."""
    modules = _modules()
    found = [hit for name, path in modules.items() if _airflow_free(name)
             for hit in _airflow_imports(name, path.read_text(), path.name == "__init__.py", modules)]
    assert not found, "\n".join(found)


def test_the_syntax_check_finds_a_function_level_airflow_import() -> None:
    """The check can fail: the CLI's source with an Airflow import added inside a function, on purpose."""
    modules = _modules()
    source = modules["airflow_arroyo.cli"].read_text()
    assert not _airflow_imports("airflow_arroyo.cli", source, False, modules)
    planted = source + "\n\ndef _planted() -> None:\n    from airflow_arroyo.hooks.arroyo import ArroyoHook\n"
    assert _airflow_imports("airflow_arroyo.cli", planted, False, modules) == [
        f"airflow_arroyo.cli:{len(planted.splitlines())} imports airflow_arroyo.hooks.arroyo"]
    typed = source + "\nif TYPE_CHECKING:\n    from airflow.sdk import Context\n"
    assert _airflow_imports("airflow_arroyo.cli", typed, False, modules) == [
        f"airflow_arroyo.cli:{len(typed.splitlines())} imports airflow.sdk"]


def test_no_module_of_the_package_imports_itself_round_a_circle() -> None:
    """No import cycle among the package's modules, counting function-level and type-only imports (which hide a
    circle from the interpreter but not from a reader). ``from pkg import submodule`` counts as the submodule."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps: set[str] = set()
        for i in _imports(path.read_text(), name, path.name == "__init__.py", modules):
            target = i.module
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                deps.add(target)
        graph[name] = deps
    cycles = [c for c in _strongly_connected(graph) if len(c) > 1]
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(sorted(c)) for c in cycles)


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iteratively (the package is deeper than nothing but shallower than the stack)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        comp.append(member)
                        if member == node:
                            break
                    out.append(comp)
    return out
