"""The embedded default: everything on one machine, started and stopped by one command.

    python -m airflow_arroyo.devtools.embedded [--epochs 5] [--interval 5] [--minutes 10]

1. a throwaway PostgreSQL from the machine's binaries: database ``arroyo`` (the epoch store) and
   ``airflow`` (Airflow's metadata, so that LocalExecutor runs tasks in parallel);
2. ``airflow standalone`` (api-server, scheduler, dag-processor, triggerer) with this repository's
   ``dags/`` and ``plugins/``, connections ``arroyo_default`` (the store) and ``spark_default``
   (Spark ``local[2]``), an admin login, and a retention DAG that runs every few minutes;
3. triggers ``example_streaming_pipeline`` through the REST API (a JWT from ``/auth/token``),
   prints where to look, follows the epochs as they complete; with ``--kafka``, starts a Kafka broker on
   loopback first (``devtools/kafka.py``), fills its ``orders`` topic and triggers ``example_kafka_pipeline``
   instead, then reads the output topic as a ``read_committed`` consumer would; with ``--gated``, triggers
   ``example_gated_pipeline`` instead (a PostgreSQL sink behind a commit gate) with ``example_gate_check``
   unpaused, which checks each epoch's pending orders as its gate opens; the demo prints each gate's verdict
   and, at the end, what reached the table;
   At the end it prints the UI pages of the newest completed epoch that committed output: its page, its
   provenance (what it read, per source, and committed, per sink), and the "which epoch wrote this" lookup.
4. when the DAG run ends (after ``--epochs`` epochs or ``--minutes``), on Ctrl-C or at the
   deadline: stops the pipeline (gracefully, then immediately), stops Airflow (SIGINT to standalone,
   which stops its components; signals to its whole process group only if it does not exit), ends
   any spark-submit left behind (by the pid files the submit operator writes) and stops PostgreSQL.

:class:`EmbeddedAirflow` is the same machinery as a context manager (the end-to-end test uses it):
start, REST calls, wait for a DAG run, stop.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from airflow_arroyo.devtools.postgres import ThrowawayPostgres

__all__ = ["EXAMPLE_DAG", "GATED_DAG", "GATE_CHECK_DAG", "RETENTION_DAG", "EmbeddedAirflow", "EmbeddedSettings",
           "GatedResult", "gated_result", "main"]

REPO = Path(__file__).resolve().parents[2]
EXAMPLE_DAG = "example_streaming_pipeline"
RETENTION_DAG = "arroyo_retention"
PIPELINE_ID = "arroyo-demo"
TERMINAL_RUN_STATES = ("success", "failed")


def _free_ports(n: int) -> list[int]:
    """``n`` distinct ports free right now (all bound at once, so none repeats)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]


def _say(message: str) -> None:
    print(f"[arroyo] {message}", flush=True)


@dataclass
class EmbeddedSettings:
    """What the embedded Airflow is started with."""

    home: Path | None = None  # AIRFLOW_HOME (default: a temporary folder, removed afterwards)
    keep_home: bool = False
    port: int | None = None  # api-server port (default: a free one)
    dags_folder: Path = REPO / "dags"
    plugins_folder: Path = REPO / "plugins"
    parallelism: int = 4
    retention_schedule: str = "*/2 * * * *"
    retention_keep_last: int = 5
    extra_env: dict[str, str] = field(default_factory=dict)
    startup_timeout: float = 300.0


class EmbeddedAirflow:
    """A throwaway PostgreSQL and ``airflow standalone`` around them. Use as a context manager."""

    def __init__(self, settings: EmbeddedSettings | None = None) -> None:
        self.settings = settings or EmbeddedSettings()
        self._own_home = self.settings.home is None
        self.home = Path(self.settings.home or tempfile.mkdtemp(prefix="arroyo-embedded-")).resolve()
        ports = _free_ports(3)
        self.port = self.settings.port or ports[0]
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_ports = (ports[1], ports[2])
        self.username = "admin"
        self.password = secrets.token_urlsafe(12)
        self.pg: ThrowawayPostgres | None = None
        self.store_dsn = ""
        self.airflow_dsn = ""
        self.process: subprocess.Popen[bytes] | None = None
        self.log_path = self.home / "standalone.log"
        self._token: str | None = None
        # set when something failed: the temporary home, with the log the messages pointed at, is kept
        self.failed = False

    # ------------------------------------------------------------------ life cycle

    def __enter__(self) -> EmbeddedAirflow:
        try:
            self.start()
        except BaseException as exc:
            self.failed = self.failed or not isinstance(exc, KeyboardInterrupt)
            self.stop()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is not None and not issubclass(exc_type, KeyboardInterrupt):
            self.failed = True
        self.stop()

    def start(self) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        # its own temporary folder: as root the server runs as the postgres user, who must reach it
        self.pg = ThrowawayPostgres()
        _say(f"starting PostgreSQL ({self.pg.bindir})")
        self.pg.start()
        self.store_dsn = self.pg.dsn
        self.airflow_dsn = self.pg.create_database("airflow").replace("postgresql://", "postgresql+psycopg2://", 1)
        from airflow_arroyo.store import EpochStore

        store = EpochStore(self.store_dsn, max_connections=1)
        try:
            store.migrate()
        finally:
            store.close()
        (self.home / "passwords.json").write_text(json.dumps({self.username: self.password}) + "\n")
        env = self.environment()
        _say(f"starting airflow standalone on {self.base_url} (log: {self.log_path})")
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [str(Path(sys.executable).parent / "airflow"), "standalone"],
                env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, cwd=self.home,
                start_new_session=True,
            )
        self.wait_healthy(self.settings.startup_timeout)

    def environment(self) -> dict[str, str]:
        """The environment of every Airflow process (and, through them, of the Spark drivers)."""
        s = self.settings
        venv_bin = str(Path(sys.executable).parent)
        env = dict(os.environ)
        env.update({
            "PATH": os.pathsep.join([venv_bin, env.get("PATH", "")]),
            "PYSPARK_PYTHON": env.get("PYSPARK_PYTHON") or sys.executable,
            "PYSPARK_DRIVER_PYTHON": env.get("PYSPARK_DRIVER_PYTHON") or sys.executable,
            "AIRFLOW_HOME": str(self.home),
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": self.airflow_dsn,
            "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
            "AIRFLOW__CORE__DAGS_FOLDER": str(s.dags_folder),
            "AIRFLOW__CORE__PLUGINS_FOLDER": str(s.plugins_folder),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "False",
            "AIRFLOW__CORE__PARALLELISM": str(s.parallelism),
            "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
            "AIRFLOW__API__PORT": str(self.port),
            # the log servers of the scheduler and the triggerer: free ports, not 8793/8794
            "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": str(self.log_ports[0]),
            "AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT": str(self.log_ports[1]),
            "AIRFLOW__API__HOST": "127.0.0.1",
            "AIRFLOW__API__BASE_URL": self.base_url,
            "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{self.base_url}/execution/",
            "AIRFLOW__API_AUTH__JWT_SECRET": secrets.token_urlsafe(32),
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": f"{self.username}:admin",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(self.home / "passwords.json"),
            "AIRFLOW_CONN_ARROYO_DEFAULT": self.store_dsn,
            "AIRFLOW_CONN_SPARK_DEFAULT": json.dumps({"conn_type": "spark", "host": "local[2]"}),
            "AIRFLOW__ARROYO__STORAGE_URI": str(self.home / "arroyo-data"),
            # one machine: Spark binds and reports 127.0.0.1 (its UI link then works in a browser here)
            "SPARK_LOCAL_IP": env.get("SPARK_LOCAL_IP") or "127.0.0.1",
            "AIRFLOW__ARROYO__RETENTION_SCHEDULE": s.retention_schedule,
            "AIRFLOW__ARROYO__RETENTION_KEEP_LAST": str(s.retention_keep_last),
        })
        for key in ("AIRFLOW__CORE__UNIT_TEST_MODE", "AIRFLOW_CONFIG"):
            env.pop(key, None)
        env.update(s.extra_env)
        return env

    def stop(self, grace: float = 60.0) -> None:
        """Stop everything this object started; safe to call twice and after a failed start."""
        try:
            self._stop_pipelines()
            self._stop_airflow(grace)
            self._kill_left_over_spark_submits()
        finally:
            if self.pg is not None:
                _say("stopping PostgreSQL")
                with contextlib.suppress(RuntimeError):
                    self.pg.cleanup()
                self.pg = None
            if self._own_home and not self.settings.keep_home:
                if self.failed:
                    _say(f"kept {self.home} for reading what failed (airflow standalone's log: {self.log_path}; "
                         f"task logs: {self.home / 'logs'}); delete it when done")
                else:
                    shutil.rmtree(self.home, ignore_errors=True)

    def _stop_pipelines(self, timeout: float = 60.0) -> None:
        """Ask every live pipeline to stop (graceful, then immediate) and wait for it."""
        if self.pg is None or not self.store_dsn:
            return
        from airflow_arroyo.core.exceptions import ArroyoError
        from airflow_arroyo.store import EpochStore

        store = EpochStore(self.store_dsn, max_connections=1, retry_seconds=5.0)
        try:
            live = [p for p in store.list_pipelines() if not p.state.terminal]
            for mode, share in (("graceful", 0.5), ("immediate", 0.5)):
                if not live:
                    return
                for p in live:
                    _say(f"stopping pipeline {p.pipeline_id} ({mode})")
                    with contextlib.suppress(ArroyoError):
                        store.request_stop(p.pipeline_id, mode)
                deadline = time.monotonic() + timeout * share
                while live and time.monotonic() < deadline:
                    time.sleep(0.5)
                    live = [p for p in store.list_pipelines() if not p.state.terminal]
            if live:
                _say(f"pipelines still not stopped: {', '.join(p.pipeline_id for p in live)}")
        except ArroyoError as exc:
            _say(f"could not stop the pipelines through the epoch store: {exc}")
        finally:
            store.close()

    def _stop_airflow(self, grace: float) -> None:
        proc = self.process
        if proc is None:
            return
        self.process = None
        if proc.poll() is None:
            # SIGINT to standalone alone: it terminates its components itself. SIGINT to the whole group
            # would also reach LocalExecutor's workers, which the scheduler then waits on for minutes, so
            # the group gets signals only if standalone does not exit.
            _say("stopping airflow standalone (SIGINT)")
            steps = ((os.kill, signal.SIGINT, grace), (os.killpg, signal.SIGINT, 15.0),
                     (os.killpg, signal.SIGTERM, 15.0), (os.killpg, signal.SIGKILL, 10.0))
            for send, sig, wait in steps:
                with contextlib.suppress(ProcessLookupError):
                    send(proc.pid, sig)
                try:
                    proc.wait(timeout=wait)
                    break
                except subprocess.TimeoutExpired:
                    _say(f"airflow standalone still running {wait:g}s after {sig.name}")
        # the components (and LocalExecutor's workers) share the group: end any straggler
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)

    def _kill_left_over_spark_submits(self) -> None:
        """spark-submit runs in a session of its own (it must outlive its task): end what is left,
        identified by the pid files the submit operator wrote (pid + start time, never a recycled pid)."""
        from airflow_arroyo.core.processes import LocalProcess

        for pid_file in sorted((self.home / "logs" / "arroyo").glob("*/*.pid")):
            fields = pid_file.read_text().split()
            if len(fields) < 3 or not fields[0].isdigit():
                continue
            process = LocalProcess(int(fields[0]), fields[2], int(fields[1]) if fields[1].isdigit() else None)
            if process.signal_group(signal.SIGTERM):
                _say(f"ended spark-submit process group {process.pid} ({pid_file.name})")
                deadline = time.monotonic() + 15
                while process.group_alive() and time.monotonic() < deadline:
                    time.sleep(0.2)
                process.signal_group(signal.SIGKILL)

    # ------------------------------------------------------------------ REST API

    def _client(self) -> Any:
        import httpx

        return httpx.Client(base_url=self.base_url, timeout=30.0)

    def token(self) -> str:
        """A JWT for the admin user (``POST /auth/token``)."""
        if self._token is None:
            with self._client() as client:
                resp = client.post("/auth/token", json={"username": self.username, "password": self.password})
                resp.raise_for_status()
                self._token = str(resp.json()["access_token"])
        return self._token

    def api(self, method: str, path: str, *, attempts: int = 3, **kwargs: Any) -> Any:
        """Call the REST API v2 (``path`` under ``/api/v2``) as the admin; the decoded JSON. A read that times
        out is asked again (up to ``attempts`` times): on a busy 2-core machine the single api-server worker
        can stall for tens of seconds while a Spark driver and the scheduler start."""
        import httpx

        for attempt in range(1, attempts + 1):
            try:
                with self._client() as client:
                    resp = client.request(method, f"/api/v2{path}",
                                          headers={"Authorization": f"Bearer {self.token()}"}, **kwargs)
                break
            except httpx.TimeoutException:
                if method.upper() != "GET" or attempt == attempts:
                    raise
                _say(f"GET /api/v2{path} timed out (attempt {attempt} of {attempts}); asking again")
        if resp.status_code >= 400:
            raise RuntimeError(f"{method} /api/v2{path} -> {resp.status_code}: {resp.text[:500]}")
        return resp.json() if resp.content else None

    def health(self) -> dict[str, Any]:
        with self._client() as client:
            resp = client.get("/api/v2/monitor/health")
            resp.raise_for_status()
            result: dict[str, Any] = resp.json()
            return result

    def wait_healthy(self, timeout: float) -> None:
        """Until the metadata DB, scheduler, triggerer and dag-processor report healthy."""
        import httpx

        deadline = time.monotonic() + timeout
        last = "no answer yet"
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"airflow standalone exited ({self.process.returncode}); see {self.log_path}")
            try:
                health = self.health()
                parts = ("metadatabase", "scheduler", "triggerer", "dag_processor")
                states = {k: (health.get(k) or {}).get("status") for k in parts}
                if all(v == "healthy" for v in states.values()):
                    return
                last = str(states)
            except (httpx.HTTPError, ValueError) as exc:
                last = f"{type(exc).__name__}: {exc}"
            time.sleep(1.0)
        raise RuntimeError(f"airflow standalone not healthy after {timeout:g}s ({last}); see {self.log_path}")

    def wait_dag(self, dag_id: str, timeout: float = 120.0) -> dict[str, Any]:
        """Until the dag-processor has parsed ``dag_id``; unpause it if needed."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                dag: dict[str, Any] = self.api("GET", f"/dags/{dag_id}")
                break
            except RuntimeError:
                if time.monotonic() > deadline:
                    errors = self.api("GET", "/importErrors")
                    raise RuntimeError(f"DAG {dag_id} not found after {timeout:g}s; import errors: {errors}") from None
                time.sleep(1.0)
        if dag.get("is_paused"):
            dag = self.api("PATCH", f"/dags/{dag_id}", json={"is_paused": False})
        return dag

    def trigger(self, dag_id: str, conf: Mapping[str, Any] | None = None) -> str:
        """Trigger a DAG run; its run id."""
        self.wait_dag(dag_id)
        run = self.api("POST", f"/dags/{dag_id}/dagRuns", json={"logical_date": None, "conf": dict(conf or {})})
        return str(run["dag_run_id"])

    def dag_run(self, dag_id: str, run_id: str) -> dict[str, Any]:
        result: dict[str, Any] = self.api("GET", f"/dags/{dag_id}/dagRuns/{run_id}")
        return result

    def task_instances(self, dag_id: str, run_id: str) -> dict[str, str | None]:
        tis = self.api("GET", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances")["task_instances"]
        return {ti["task_id"] if ti.get("map_index", -1) < 0 else f"{ti['task_id']}[{ti['map_index']}]": ti["state"]
                for ti in tis}

    def wait_run(self, dag_id: str, run_id: str, timeout: float,
                 on_poll: Callable[[], None] | None = None, interval: float = 2.0) -> str:
        """Until the DAG run ends (its final state) or ``timeout`` (then its current state)."""
        deadline = time.monotonic() + timeout
        while True:
            state = str(self.dag_run(dag_id, run_id)["state"])
            if state in TERMINAL_RUN_STATES or time.monotonic() > deadline:
                return state
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"airflow standalone exited ({self.process.returncode}); see {self.log_path}")
            if on_poll is not None:
                on_poll()
            time.sleep(interval)


# --------------------------------------------------------------------------- the command


class _EpochFollower:
    """Prints each epoch of the demo pipeline once it ends."""

    def __init__(self, dsn: str, pipeline_id: str) -> None:
        from airflow_arroyo.store import EpochStore

        self.store = EpochStore(dsn, max_connections=1, retry_seconds=5.0)
        self.pipeline_id = pipeline_id
        self.seen: set[int] = set()
        self.spark_ui: str | None = None
        self.completed = 0
        self.last_completed: int | None = None
        self.gate_states: dict[tuple[str, int], str] = {}

    def __call__(self) -> None:
        from airflow_arroyo.core.exceptions import UnknownPipelineError
        from airflow_arroyo.core.units import bytes_human, duration_human

        try:
            pipeline = self.store.get_pipeline(self.pipeline_id)
        except UnknownPipelineError:
            return
        if pipeline.spark_ui_url and pipeline.spark_ui_url != self.spark_ui:
            self.spark_ui = pipeline.spark_ui_url
            _say(f"pipeline {self.pipeline_id} is {pipeline.state}; Spark UI: {self.spark_ui}")
        for epoch in sorted(self.store.list_epochs(self.pipeline_id, limit=50), key=lambda e: e.epoch):
            if epoch.epoch in self.seen or epoch.ended_at is None:
                continue
            self.seen.add(epoch.epoch)
            if epoch.state.value == "completed":
                self.completed += 1
                self.last_completed = max(epoch.epoch, self.last_completed or 0)
            took = duration_human(epoch.duration_s) if epoch.duration_s is not None else "-"
            size = (f", {bytes_human(epoch.bytes_new)} new, {bytes_human(epoch.bytes_total)} in all"
                    if epoch.bytes_new is not None else "")
            final = " (final)" if epoch.is_final else ""
            _say(f"epoch {epoch.epoch} {epoch.state.value} in {took}{size}{final}")
        self._gates()

    def worth_showing(self) -> int | None:
        """The newest completed epoch that committed something (its provenance page has the most to show), else
        the newest completed one."""
        from airflow_arroyo.core.epochs import EpochState

        completed = {e.epoch for e in self.store.list_epochs(self.pipeline_id, limit=200,
                                                             states=[EpochState.COMPLETED])}
        committed = [c.epoch for c in self.store.sink_commits(self.pipeline_id, limit=10_000) if c.epoch in completed]
        return max(committed, default=self.last_completed)

    def _gates(self) -> None:
        """Each gate's state as it changes: opened (pending), the verdict and who gave it, committed."""
        after = 0
        while True:
            page = self.store.list_gates(self.pipeline_id, after_seq=after, limit=200)
            for g in page:
                key = (g.sink, g.epoch)
                if self.gate_states.get(key) == g.state.value:
                    continue
                self.gate_states[key] = g.state.value
                by = f" by {g.decided_by}" if g.decided_by and g.state.value not in ("pending", "committed") else ""
                why = f" ({g.reason})" if g.reason else ""
                _say(f"gate of epoch {g.epoch} for sink {g.sink}: {g.state.value}{by}{why}")
            if len(page) < 200:
                return
            after = page[-1].seq

    def close(self) -> None:
        self.store.close()


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m airflow_arroyo.devtools.embedded",
        description="Start PostgreSQL and airflow standalone, run the example streaming DAG, stop everything.",
    )
    parser.add_argument("--epochs", type=int, default=5, help="epochs of the run before it stops (default 5)")
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between checkpoints (default 5)")
    parser.add_argument("--minutes", type=float, default=10.0,
                        help="the run stops after this long even if the epochs are not reached (default 10)")
    parser.add_argument("--rows", type=int, default=20000, help="rows each demo source generates")
    parser.add_argument("--port", type=int, default=None, help="Airflow UI/API port (default: a free one)")
    parser.add_argument("--home", type=Path, default=None, help="AIRFLOW_HOME to use (default: a temporary one)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary AIRFLOW_HOME (logs, data)")
    parser.add_argument("--stay", action="store_true",
                        help="after the DAG run, keep Airflow up for exploring until Ctrl-C")
    parser.add_argument("--no-trigger", action="store_true", help="start Airflow only; trigger nothing")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--kafka", action="store_true",
                      help="run the Kafka example instead: a Kafka broker on loopback, orders in, deduplicated "
                           "orders out exactly once (example_kafka_pipeline; --rows orders are produced)")
    mode.add_argument("--gated", action="store_true",
                      help="run the gated example instead: orders into PostgreSQL, each epoch committed only once "
                           "example_gate_check's SQL check passed it (example_gated_pipeline; --rows orders)")
    return parser.parse_args(argv)


GATED_DAG = "example_gated_pipeline"
GATE_CHECK_DAG = "example_gate_check"


@dataclass(frozen=True)
class GatedResult:
    """What the gated example left: the orders in its table, and its gates by state."""

    orders: int
    distinct: int
    #: the table holds orders 0 .. orders-1: the generator's first batches, each once
    prefix: bool
    gates: dict[str, list[int]]
    deciders: frozenset[str]

    @property
    def exact(self) -> bool:
        return self.orders == self.distinct and self.prefix


def gated_result(dsn: str) -> GatedResult:
    """Read the gated example's table and gates (``dsn``: the epoch store, where the example writes)."""
    import psycopg2

    from airflow_arroyo.examples.names import GATED_PIPELINE_ID, GATED_TABLE
    from airflow_arroyo.store import EpochStore

    conn = psycopg2.connect(dsn)
    try:
        with conn, conn.cursor() as cur:
            cur.execute(f"SELECT order_id FROM {GATED_TABLE}")  # noqa: S608 (a constant name)
            ids = [int(r[0]) for r in cur.fetchall()]
    finally:
        conn.close()
    store = EpochStore(dsn, max_connections=1, retry_seconds=5.0)
    try:
        gates = store.list_gates(GATED_PIPELINE_ID, limit=10_000)
    finally:
        store.close()
    by_state: dict[str, list[int]] = {}
    for g in gates:
        by_state.setdefault(g.state.value, []).append(g.epoch)
    return GatedResult(len(ids), len(set(ids)), sorted(set(ids)) == list(range(len(set(ids)))), by_state,
                       frozenset(g.decided_by for g in gates if g.decided_by))


def _say_gated(result: GatedResult) -> None:
    from airflow_arroyo.examples.names import GATED_TABLE

    gates = "; ".join(f"{state}: epochs {', '.join(map(str, epochs))}" for state, epochs in result.gates.items())
    _say(f"table {GATED_TABLE}: {result.orders} orders ({result.distinct} distinct"
         f"{', the first ones in order' if result.prefix else ', NOT the first ones in order'}); gates: "
         f"{gates or 'none'}; verdicts by {', '.join(sorted(result.deciders)) or 'nobody'}")
    if result.gates.get("passed"):
        _say("passed gates the pipeline stopped before committing are committed by its next restore (restore_from="
             "'latest')")


KAFKA_DAG = "example_kafka_pipeline"
KAFKA_PIPELINE_ID = "arroyo-kafka-demo"
KAFKA_TOPICS = ("orders", "orders-deduplicated")


@contextlib.contextmanager
def _kafka_demo(home: Path, rows: int) -> Iterator[tuple[Any, dict[str, Any], int]]:
    """A broker on loopback with the input topic holding ``rows`` orders (every tenth twice, as an
    at-least-once producer leaves them): yields the broker, the DAG's conf and the number of distinct orders."""
    from airflow_arroyo.devtools.kafka import KafkaBroker
    from airflow_arroyo.examples.pipelines import kafka_order

    with KafkaBroker(home / "kafka") as broker:
        source, out = KAFKA_TOPICS
        broker.create_topic(source, partitions=3)
        broker.create_topic(out, partitions=3)
        sent = [i for i in range(rows) for _ in range(2 if i % 10 == 0 else 1)]
        broker.produce(source, [(f"k{i}", json.dumps(kafka_order(i))) for i in sent])
        _say(f"Kafka broker at {broker.bootstrap_servers}: {len(sent)} orders ({rows} distinct) in topic {source!r}")
        yield broker, {"bootstrap_servers": broker.bootstrap_servers, "input_topic": source, "output_topic": out}, rows


def _kafka_result(broker: Any, distinct: int) -> bool:
    """What a read_committed consumer sees in the output topic: every order once?"""
    from collections import Counter

    seen = Counter(json.loads(r.value)["id"] for r in broker.read_all(KAFKA_TOPICS[1], read_committed=True))
    twice = sum(1 for n in seen.values() if n > 1)
    _say(f"output topic {KAFKA_TOPICS[1]!r}, read_committed: {sum(seen.values())} records, {len(seen)} of "
         f"{distinct} orders, {twice} twice")
    return twice == 0


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        print("error: Java is required by Spark (e.g. apt-get install openjdk-17-jre-headless)", file=sys.stderr)
        return 2
    settings = EmbeddedSettings(home=args.home, keep_home=args.keep or args.home is not None, port=args.port)
    interrupted = False

    def on_sigterm(_signum: int, _frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_sigterm)
    airflow = EmbeddedAirflow(settings)
    follower: _EpochFollower | None = None
    state = "not started"
    try:
        with airflow:
            _say(f"Airflow is up: {airflow.base_url}  (user {airflow.username}, password {airflow.password})")
            _say(f"AIRFLOW_HOME: {airflow.home}; epoch store: {airflow.store_dsn}")
            if args.no_trigger:
                _say("press Ctrl-C to stop")
                _wait_forever(airflow)
                return 0
            conf: dict[str, Any] = {"interval": args.interval, "epochs": args.epochs, "minutes": args.minutes}
            dag_id, pipeline = (KAFKA_DAG, KAFKA_PIPELINE_ID) if args.kafka else (EXAMPLE_DAG, PIPELINE_ID)
            if args.gated:
                from airflow_arroyo.examples.names import GATED_PIPELINE_ID

                dag_id, pipeline = GATED_DAG, GATED_PIPELINE_ID
                airflow.wait_dag(GATE_CHECK_DAG)  # unpaused: it runs on every gate the pipeline opens
            with contextlib.ExitStack() as stack:
                if args.kafka:
                    broker, kafka_conf, distinct = stack.enter_context(_kafka_demo(airflow.home, args.rows))
                    conf.update(kafka_conf)
                else:
                    conf["rows"] = args.rows
                run_id = airflow.trigger(dag_id, conf)
                _say(f"triggered {dag_id} run {run_id} with {json.dumps(conf)}")
                _say(f"  DAG run:        {airflow.base_url}/dags/{dag_id}/runs/{run_id}")
                # inside Airflow's UI (as links.pipeline.pipeline_page_url builds it; that module imports Airflow)
                _say(f"  checkpoints:    {airflow.base_url}/plugin/arroyo/arroyo/pipelines/{pipeline}")
                _say(f"  retention DAG:  {airflow.base_url}/dags/{RETENTION_DAG} (every 2 minutes)")
                if args.gated:
                    _say(f"  gate checks:    {airflow.base_url}/dags/{GATE_CHECK_DAG} (a run per gate opened); the "
                         "gates, with Approve/Reject: the checkpoints page above")
                _say("Ctrl-C stops everything")
                follower = _EpochFollower(airflow.store_dsn, pipeline)
                state = airflow.wait_run(dag_id, run_id, timeout=args.minutes * 60 + 300, on_poll=follower)
                follower()
                _say(f"DAG run {run_id}: {state}; tasks: {airflow.task_instances(dag_id, run_id)}")
                _say(f"{follower.completed} epochs completed")
                if args.kafka and not _kafka_result(broker, distinct):
                    state = "duplicates in the output"
                if args.gated:
                    result = gated_result(airflow.store_dsn)
                    _say_gated(result)
                    if not result.exact:
                        state = "the gated table is not exact"
                shown = follower.worth_showing()
                if shown is not None:
                    _say_epoch_pages(airflow.base_url, pipeline, shown)
                airflow.failed = state != "success"
            if args.stay:
                _say(f"Airflow stays up at {airflow.base_url}; press Ctrl-C to stop")
                _wait_forever(airflow)
    except KeyboardInterrupt:
        interrupted = True
        _say("interrupted: stopping everything")
    finally:
        if follower is not None:
            follower.close()
    _say("stopped" + (" (interrupted)" if interrupted else ""))
    if interrupted:
        return 130
    return 0 if state == "success" else 1


def _say_epoch_pages(base_url: str, pipeline: str, epoch: int) -> None:
    from urllib.parse import quote

    page = f"{base_url}/plugin/arroyo/arroyo/pipelines/{quote(pipeline, safe='')}"
    _say(f"epoch {epoch} (the newest completed one that committed output, if any did):")
    _say(f"  its page:       {page}/epochs/{epoch}")
    _say(f"  provenance:     {page}/epochs/{epoch}/provenance  (the input it read per source, what each sink "
         "committed)")
    _say(f"  which epoch wrote a file or table version: {page}/provenance")


def _wait_forever(airflow: EmbeddedAirflow) -> None:
    while airflow.process is not None and airflow.process.poll() is None:
        time.sleep(1.0)


@contextlib.contextmanager
def embedded(settings: EmbeddedSettings | None = None) -> Iterator[EmbeddedAirflow]:
    """An embedded Airflow for a ``with`` block (the same as ``with EmbeddedAirflow() as airflow``)."""
    with EmbeddedAirflow(settings) as airflow:
        yield airflow


if __name__ == "__main__":
    sys.exit(main())
