"""The built wheel installs into another supported Airflow, without constraints.txt, and works there.

What a user does: ``pip install airflow-arroyo`` into the Airflow they already run. Here: the wheel
built from this checkout, installed with uv into a fresh venv on another Python, with the previous
Airflow 3 minor, the previous apache-spark provider minor and the previous pyspark-client minor
(on Python 3.12 or 3.13 when the machine has one),
resolved from the package ranges alone (no constraints file). Then what a user checks:
``airflow providers list`` shows it, its connection type and hook, its config section, the UI
plugin, and a DAG using its operators parses. The full pyspark (400 MB) is not installed: none of
these checks needs it (it is the ``[pyspark]`` extra, for hosts that run spark-submit).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
# The previous minors of what constraints.txt pins (apache-airflow 3.3.2, provider 6.3.4, pyspark 4.2.0).
COMBINATION = ["apache-airflow==3.2.*", "apache-airflow-providers-apache-spark==6.2.*", "pyspark-client==4.1.*"]
OTHER_PYTHONS = ("3.12", "3.13")


def _uv() -> list[str]:
    uv = shutil.which("uv")
    if uv:
        return [uv]
    probe = subprocess.run([sys.executable, "-m", "uv", "--version"], capture_output=True)
    if probe.returncode == 0:
        return [sys.executable, "-m", "uv"]
    pytest.skip("uv is not installed (scripts/dev.sh installs it)")


def _runs(python: str) -> bool:
    return subprocess.run([python, "-c", "import sys, venv"], capture_output=True).returncode == 0


def _other_python() -> str:
    """Another supported Python if this machine has one (pyenv's shims hide it from uv), else this one."""
    for version in OTHER_PYTHONS:
        candidates = [shutil.which(f"python{version}") or "", f"/usr/bin/python{version}",
                      *sorted(str(p) for p in Path.home().glob(f".pyenv/versions/{version}*/bin/python{version}"))]
        for candidate in candidates:
            if candidate and Path(candidate).exists() and _runs(candidate):
                return candidate
    return sys.executable


def _run(cmd: list[str], env: dict[str, str] | None = None, cwd: Path | None = None) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd, timeout=600)
    assert done.returncode == 0, (f"{' '.join(cmd)} failed ({done.returncode}):\n"
                                  f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return done.stdout


def _json_rows(text: str) -> list[dict[str, str]]:
    start = text.index("[")  # the CLI may print warnings before the JSON
    rows: list[dict[str, str]] = json.loads(text[start:])
    return rows


def test_wheel_installs_into_the_previous_airflow_minor_without_constraints(tmp_path: Path) -> None:
    uv = _uv()
    python = _other_python()
    dist = tmp_path / "dist"
    # Built from a copy: setuptools writes airflow_arroyo.egg-info into the folder it builds, which on
    # the repository's sys.path would be a second installed distribution (and a second plugin entry point).
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source)
    shutil.copytree(REPO / "airflow_arroyo", source / "airflow_arroyo",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
    # sdist first, then the wheel from it (uv build's default): also proves the sdist is complete
    _run([*uv, "build", "-q", "--out-dir", str(dist), str(source)])
    wheel = next(dist.glob("airflow_arroyo-*.whl"))
    with zipfile.ZipFile(wheel) as whl:  # the provider's jar (airflow_arroyo.jvm) and its sources ship
        assert {"airflow_arroyo/jvm/airflow-arroyo-hadoop.jar",
                "airflow_arroyo/jvm/src/airflow/arroyo/hadoop/NioRawLocalFileSystem.java"} <= set(whl.namelist())

    venv = tmp_path / "venv"
    _run([*uv, "venv", "-q", "--python", python, str(venv)])
    vpy = str(venv / "bin" / "python")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("AIRFLOW", "UV_CONSTRAINT", "PIP_CONSTRAINT", "PYTHONPATH", "VIRTUAL_ENV"))}
    _run([*uv, "pip", "install", "-q", "--python", vpy, str(wheel), *COMBINATION], env=env)

    home = tmp_path / "airflow-home"
    dags = home / "dags"
    dags.mkdir(parents=True)
    # a user's DAG using the provider (the example DAG of this repository, as shipped)
    shutil.copy(REPO / "dags" / "example_streaming_pipeline.py", dags)
    env.update({
        "AIRFLOW_HOME": str(home), "AIRFLOW__CORE__LOAD_EXAMPLES": "False", "AIRFLOW__CORE__DAGS_FOLDER": str(dags),
        "AIRFLOW__ARROYO__STORAGE_URI": "s3://bucket/arroyo", "PATH": f"{venv / 'bin'}{os.pathsep}{env['PATH']}",
    })
    airflow = str(venv / "bin" / "airflow")

    versions = _run([vpy, "-c", "import importlib.metadata as m, sys; print(sys.version_info[:2], "
                     "*(m.version(p) for p in ('apache-airflow', 'apache-airflow-providers-apache-spark', "
                     "'pyspark-client', 'airflow-arroyo')))"], env=env)
    assert " 3.2." in versions and " 6.2." in versions and " 4.1." in versions, versions  # another combination

    providers = _json_rows(_run([airflow, "providers", "list", "-o", "json"], env=env))
    ours = [p for p in providers if p["package_name"] == "airflow-arroyo"]
    assert ours and ours[0]["version"] == versions.split()[-1], providers

    # the provider's [arroyo] section with its defaults (the value set above is checked in the DAG below)
    section = _run([airflow, "config", "list", "--section", "arroyo", "--defaults", "--show-values"], env=env)
    assert "[arroyo]" in section and "conn_id = arroyo_default" in section, section

    plugins = _json_rows(_run([airflow, "plugins", "-o", "json"], env=env))
    assert [p for p in plugins if p["name"] == "airflow_arroyo"], plugins

    check = textwrap.dedent(f"""
        import importlib, json
        from airflow.providers_manager import ProvidersManager
        try:
            from airflow.dag_processing.dagbag import DagBag
        except ImportError:
            from airflow.models.dagbag import DagBag
        pm = ProvidersManager()
        hook = pm.hooks["arroyo"]
        widgets = [k for k in pm.connection_form_widgets if k.startswith("extra__arroyo__")]
        modules = ["airflow_arroyo.operators.pipeline", "airflow_arroyo.operators.checkpoint",
                   "airflow_arroyo.operators.retention", "airflow_arroyo.sensors.pipeline",
                   "airflow_arroyo.triggers.checkpoint", "airflow_arroyo.triggers.pipeline",
                   "airflow_arroyo.ui.plugin"]
        for m in modules:
            importlib.import_module(m)
        from airflow_arroyo.ui.app import create_app
        create_app()
        bag = DagBag(dag_folder={str(dags)!r})
        dag = bag.dags.get("example_streaming_pipeline")
        print(json.dumps({{"hook": hook.hook_name if hook else None,
                          "hook_class": hook.hook_class_name if hook else None, "widgets": sorted(widgets),
                          "behaviour": pm.field_behaviours.get("arroyo"),
                          "errors": {{k: str(v) for k, v in bag.import_errors.items()}},
                          "tasks": sorted(dag.task_ids) if dag else None,
                          "storage_uri": dag.get_task("submit").storage_uri if dag else None}}))
    """)
    result = json.loads(_run([vpy, "-c", check], env=env).strip().splitlines()[-1])
    # the connection type and its hook, as `airflow providers hooks` lists them
    assert result["hook"] == "Arroyo epoch store", result
    assert result["hook_class"] == "airflow_arroyo.hooks.arroyo.ArroyoHook", result
    assert "extra__arroyo__sslmode" in result["widgets"], result
    assert result["behaviour"]["relabeling"] == {"schema": "Database"}, result
    assert result["errors"] == {}, result
    assert result["tasks"] == ["checkpoints", "run_for", "stop", "submit"], result
    assert result["storage_uri"] == "s3://bucket/arroyo", result  # the [arroyo] option reached the operator
