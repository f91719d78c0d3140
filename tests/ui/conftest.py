"""Fixtures of the UI tests: one realistic epoch store per module, and the real Airflow api-server app
(``airflow.api_fastapi.app.create_app()``) with our plugin mounted the way Airflow mounts it."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from airflow_arroyo.store import EpochStore
from tests.ui.data import Dataset, populate


@pytest.fixture(scope="session")
def dataset(migrated_db: Callable[[str], str]) -> Iterator[Dataset]:
    """Five pipelines, hundreds of epochs, acks, cleanup runs and a held lock (see tests/ui/data.py).
    Session-wide: the UI only reads, and no test here writes to it."""
    store = EpochStore(migrated_db("ui"))
    try:
        yield populate(store)
    finally:
        store.close()


@pytest.fixture(scope="module")
def store(dataset: Dataset) -> Iterator[EpochStore]:
    """A store on the dataset's database (the page tests register and look at pipelines through it)."""
    s = EpochStore(dataset.dsn)
    try:
        yield s
    finally:
        s.close()


@pytest.fixture(scope="module")
def airflow_api(airflow_db: str, dataset: Dataset) -> Iterator[Any]:
    """Airflow's own api-server app, plugins loaded, our app mounted at /arroyo, reading ``dataset``."""
    from airflow.api_fastapi.app import create_app, purge_cached_app

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AIRFLOW_CONN_ARROYO_DEFAULT", dataset.dsn)
        app = create_app()
        source = mounted_arroyo_app(app).state.arroyo_source
        source.reset()  # the plugin app is built once per process: point it at this module's store
        try:
            yield app
        finally:
            source.reset()
            purge_cached_app()


def mounted_arroyo_app(app: Any) -> Any:
    from fastapi.routing import Mount

    mounts = [r for r in app.routes if isinstance(r, Mount) and r.path == "/arroyo"]
    assert len(mounts) == 1, [getattr(r, "path", r) for r in app.routes]
    return mounts[0].app


def make_token(username: str = "admin", role: str | None = "admin") -> str:
    """A JWT minted by the running auth manager, exactly as its login endpoint does."""
    from airflow.api_fastapi.app import get_auth_manager
    from airflow.api_fastapi.auth.managers.simple.user import SimpleAuthManagerUser

    return get_auth_manager().generate_jwt(SimpleAuthManagerUser(username=username, role=role))


@pytest.fixture(scope="module")
def client(airflow_api: Any) -> Iterator[Any]:
    """An authenticated client (Bearer token of an Airflow viewer)."""
    from fastapi.testclient import TestClient

    with TestClient(airflow_api) as c:
        c.headers["Authorization"] = f"Bearer {make_token('viewer_vera', 'viewer')}"
        yield c


@pytest.fixture(scope="module")
def anon(airflow_api: Any) -> Iterator[Any]:
    from fastapi.testclient import TestClient

    with TestClient(airflow_api) as c:
        yield c


# --------------------------------------------------------------------------- a real `airflow api-server`

REPO = Path(__file__).resolve().parents[2]
USER, PASSWORD = "vera", "arroyo-ui-test-password"
#: A user who may also decide commit gates (the simple auth manager's "user" role: more than a viewer).
APPROVER, APPROVER_PASSWORD = "ana", "arroyo-ui-approver-password"


@dataclass(frozen=True)
class ApiServer:
    url: str
    home: Path
    log: Path

    def token(self) -> str:
        """A JWT from the running server's own login endpoint (the simple auth manager)."""
        req = urllib.request.Request(f"{self.url}/auth/token", method="POST",
                                     data=json.dumps({"username": USER, "password": PASSWORD}).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            return str(json.load(r)["access_token"])

    def get_json(self, path: str, token: str | None = None) -> Any:
        req = urllib.request.Request(f"{self.url}{path}",
                                     headers={"Authorization": f"Bearer {token}"} if token else {})
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.load(r)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return bool(r.status == 200)
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


def wait_until(predicate: Callable[[], bool], what: str, timeout: float,
               proc: subprocess.Popen[bytes] | None = None, log: Path | None = None) -> None:
    """Poll ``predicate`` until true, failing with the log's tail at the deadline or if ``proc`` died."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc is not None and proc.poll() is not None:
            tail = log.read_text(errors="replace")[-4000:] if log else ""
            pytest.fail(f"{what}: the process exited with {proc.returncode}\n{tail}")
        if time.monotonic() > deadline:
            tail = log.read_text(errors="replace")[-4000:] if log else ""
            pytest.fail(f"{what}: not within {timeout:.0f}s\n{tail}")
        time.sleep(0.25)


@pytest.fixture(scope="session")
def api_server(airflow_db: str, dataset: Dataset, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiServer]:
    """``airflow api-server`` in its own process group: its own AIRFLOW_HOME (config, passwords), the
    session's already migrated metadata DB, the repository's ``plugins/`` folder, the simple auth
    manager with one known viewer and an approver of commit gates, the test store as ``arroyo_default``.
    Stopped with SIGINT to its group."""
    home = tmp_path_factory.mktemp("airflow-home")
    (home / "dags").mkdir()
    passwords = home / "passwords.json"
    passwords.write_text(json.dumps({USER: PASSWORD, APPROVER: APPROVER_PASSWORD}))
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW__", "AIRFLOW_CONN_"))}
    env.update({
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": os.environ.get("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN",
                                                             f"sqlite:///{airflow_db}/airflow.db"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__DAGS_FOLDER": str(home / "dags"),
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(REPO / "plugins"),
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": f"{USER}:viewer,{APPROVER}:user",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(passwords),
        "AIRFLOW__API_AUTH__JWT_SECRET": "arroyo-ui-test-secret-" + "x" * 48,
        "AIRFLOW__API__BASE_URL": f"http://127.0.0.1:{port}",
        "AIRFLOW_CONN_ARROYO_DEFAULT": dataset.dsn,
    })
    airflow = str(Path(sys.executable).parent / "airflow")
    log = home / "api-server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([airflow, "api-server", "-H", "127.0.0.1", "-p", str(port), "-w", "1"],
                                env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _healthy(f"{url}/api/v2/monitor/health"), "airflow api-server healthy", 240, proc, log)
        yield ApiServer(url=url, home=home, log=log)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
