"""docker-compose.yml and docker/: accepted by docker-compose, wired the way the docs say.

No Docker engine runs here, so the image is not built; what can be checked without one is: the
compose file (``docker-compose config``), the services and their wiring, the connections it sets
(parsed by Airflow and the Spark provider exactly as the containers will), and the files the
Dockerfile copies.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "docker" / "Dockerfile"
AIRFLOW_SERVICES = {"airflow-init", "airflow-api-server", "airflow-scheduler", "airflow-dag-processor",
                    "airflow-triggerer"}

needs_compose = pytest.mark.skipif(shutil.which("docker-compose") is None,
                                   reason="docker-compose is not installed (apt-get install docker-compose)")


@pytest.fixture(scope="module")
def resolved() -> dict[str, Any]:
    """The compose file as docker-compose resolves it (anchors, merges, defaults)."""
    if shutil.which("docker-compose") is None:
        pytest.skip("docker-compose is not installed (apt-get install docker-compose)")
    out = subprocess.run(["docker-compose", "-f", str(COMPOSE), "config"], cwd=ROOT, check=True,
                         capture_output=True, text=True, timeout=60).stdout
    config: dict[str, Any] = yaml.safe_load(out)
    return config


@needs_compose
def test_docker_compose_accepts_the_file() -> None:
    proc = subprocess.run(["docker-compose", "-f", str(COMPOSE), "config", "-q"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_services_and_their_wiring(resolved: dict[str, Any]) -> None:
    services = resolved["services"]
    assert set(services) == AIRFLOW_SERVICES | {"postgres"}
    commands = {name: services[name].get("command") for name in AIRFLOW_SERVICES - {"airflow-init"}}
    assert {name: (c if isinstance(c, str) else " ".join(c)) for name, c in commands.items()} == {
        "airflow-api-server": "api-server", "airflow-scheduler": "scheduler",
        "airflow-dag-processor": "dag-processor", "airflow-triggerer": "triggerer",
    }
    for name in AIRFLOW_SERVICES:
        service = services[name]
        assert service["image"] == "airflow-arroyo:local"
        assert service["build"]["dockerfile"] == "docker/Dockerfile"
        env = service["environment"]
        assert env["AIRFLOW__CORE__EXECUTION_API_SERVER_URL"].startswith("http://airflow-api-server:8080/")
        assert "@postgres:5432/airflow" in env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"]
        assert env["AIRFLOW__CORE__EXECUTOR"] == "LocalExecutor"
        assert services[name]["depends_on"]["postgres"]["condition"] == "service_healthy"
        if name != "airflow-init":
            assert service["depends_on"]["airflow-init"]["condition"] == "service_completed_successfully"
    # one JWT secret for every service, or the tasks' tokens are refused by the api-server
    assert len({services[n]["environment"]["AIRFLOW__API_AUTH__JWT_SECRET"] for n in AIRFLOW_SERVICES}) == 1
    mounts = [v if isinstance(v, str) else f"{v['source']}:{v['target']}" for v in services["postgres"]["volumes"]]
    assert any(m.endswith(":/docker-entrypoint-initdb.d:ro") or "/docker-entrypoint-initdb.d" in m for m in mounts)


def test_connections_parse_as_the_containers_will(resolved: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """The Spark connection must give master local[2] (a malformed one silently means yarn) and the
    epoch store connection must give the `arroyo` database the postgres init script creates."""
    from airflow.providers.apache.spark.hooks.spark_submit import SparkSubmitHook

    from airflow_arroyo.hooks.arroyo import ArroyoHook

    env = resolved["services"]["airflow-scheduler"]["environment"]
    monkeypatch.setenv("AIRFLOW_CONN_SPARK_COMPOSE", env["AIRFLOW_CONN_SPARK_DEFAULT"])
    monkeypatch.setenv("AIRFLOW_CONN_ARROYO_COMPOSE", env["AIRFLOW_CONN_ARROYO_DEFAULT"])
    assert SparkSubmitHook(conn_id="spark_compose")._connection["master"] == "local[2]"
    dsn = ArroyoHook("arroyo_compose").get_dsn()
    assert dsn == "postgresql://arroyo:arroyo@postgres:5432/arroyo"
    init_sql = (ROOT / "docker" / "postgres" / "10-arroyo.sql").read_text()
    assert "CREATE ROLE arroyo LOGIN PASSWORD 'arroyo'" in init_sql
    assert "CREATE DATABASE arroyo OWNER arroyo" in init_sql


def test_dockerfile_copies_only_what_exists() -> None:
    text = DOCKERFILE.read_text()
    sources = []
    for line in text.splitlines():
        match = re.match(r"^COPY\s+(?:--\S+\s+)*(.+)\s+\S+$", line.strip())
        if match:
            sources += match.group(1).split()
    assert sources, "no COPY in the Dockerfile"
    missing = [s for s in sources if not (ROOT / s).exists()]
    assert not missing, f"the Dockerfile copies files the build context lacks: {missing}"
    assert "openjdk-17-jre-headless" in text and "-c constraints.txt" in text


def test_init_script_is_valid_bash_and_executable() -> None:
    script = ROOT / "docker" / "init.sh"
    assert script.stat().st_mode & 0o111
    subprocess.run(["bash", "-n", str(script)], check=True)
