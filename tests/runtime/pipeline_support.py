"""Helpers for pipeline tests beyond :mod:`airflow_arroyo.testing`: barriers against the cuts, the steps of a
restore (a failure or a kill injected at one, what the store and the storage hold meanwhile), and the driver as a
process of its own, SIGKILLed with its JVM at a chosen moment or right after a step of its restore."""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from airflow_arroyo.core.exceptions import UnknownPipelineError
from airflow_arroyo.runtime.channel import Channel
from airflow_arroyo.testing import DriverThread, wait_for

T = TypeVar("T")


def check_barriers_follow_cuts(store: Any, pipeline_id: str, channel_uris: dict[str, str]) -> int:
    """For every completed epoch and every stage writing a channel: barrier n follows the output of the
    stage's cut batch (its ack's ``details["batch_id"]``) and precedes any later batch's output.
    Returns how many (epoch, stage) pairs were checked."""
    from airflow_arroyo.core.epochs import EpochState

    completed = [e.epoch for e in store.list_epochs(pipeline_id, limit=10_000) if e.state is EpochState.COMPLETED]
    checked = 0
    for stage, uri in channel_uris.items():
        ch = Channel.open(uri)
        entries = ch.entries(ch.start_position())
        for n in completed:
            (ack,) = [a for a in store.acks(pipeline_id, n) if a.stage == stage]
            cut = ack.details["batch_id"]
            at = ch.find_barrier(n)
            assert at is not None, (stage, n)
            before = [e.batch_id for e in entries if e.index < at and not e.is_barrier]
            after = [e.batch_id for e in entries if e.index > at and not e.is_barrier]
            assert all(b <= cut for b in before), (stage, n, cut, before[-3:])
            assert all(b > cut for b in after), (stage, n, cut, after[:3])
            checked += 1
    return checked


# --------------------------------------------------------------------------- the steps of a restore


class Injected(Exception):
    """The failure a test injects at a step of the driver (``PipelineDriver.on_step``)."""


def restore_steps(driver: Any) -> tuple[list[str], list[str]]:
    """The steps of a restore with ``driver``'s pipeline, before and after the commit point, in the driver's order."""
    stages = driver.graph.stage_names
    before = ["registered", "verified", *(f"prepared:{s}" for s in stages)]
    after = ["committed", *(f"switched:{s}" for s in stages), *(f"truncated:{c}" for c in driver.graph.channels),
             *(f"rolled-back:{k}" for k in driver.sinks)]
    return before, after


def store_view(store: Any, pipeline_id: str) -> dict[str, Any]:
    """What a restore may change in the store: every epoch's state and reason, restored_from_epoch, the latest
    completed epoch."""
    latest = store.latest_completed_epoch(pipeline_id)
    return {
        "epochs": {e.epoch: (e.state, e.failure_reason) for e in store.list_epochs(pipeline_id, limit=10_000)},
        "restored_from_epoch": store.get_pipeline(pipeline_id).restored_from_epoch,
        "latest": latest.epoch if latest is not None else None,
    }


# N.snapshot, its .crc, and the temporary names Spark writes them under first (.N.snapshot.<uuid>.tmp, ..crc)
_MAINTENANCE_SNAPSHOT = re.compile(r"\.{0,2}\d+\.snapshot(\.[^/]*\.tmp)?(\.crc)?")


def spark_maintenance_wrote(path: Path) -> bool:
    """A ``.snapshot`` file of a live checkpoint's state store: Spark's maintenance thread writes these on its own
    schedule (every 200 ms in the tests' session), also shortly after a query stopped while its provider is still
    loaded, so a tree read after a stop can gain one that no code under test wrote."""
    return "state" in path.parts and _MAINTENANCE_SNAPSHOT.fullmatch(path.name) is not None


def settled_files(root: Path) -> list[tuple[Path, os.stat_result]]:
    """Every file below ``root`` with its stat, without what Spark's maintenance writes by itself
    (:func:`spark_maintenance_wrote`) and without a file renamed or deleted between the listing and its stat."""
    found = []
    for p in root.rglob("*"):
        if spark_maintenance_wrote(p):
            continue
        with contextlib.suppress(FileNotFoundError):
            st = p.stat()
            if stat.S_ISREG(st.st_mode):
                found.append((p, st))
    return found


def file_tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every settled file below ``root`` (:func:`settled_files`): size and mtime (a rewrite, even of the same
    bytes, shows)."""
    return {str(p.relative_to(root)): (st.st_size, st.st_mtime_ns) for p, st in settled_files(root)}


def fail_at(step: str) -> Callable[[str], None]:
    """A step hook raising :class:`Injected` at ``step``."""

    def hook(name: str) -> None:
        if name == step:
            raise Injected(f"injected at {step}")

    return hook


class KillAt:
    """A step hook blocking the driver at ``step`` (as if killed there: nothing after it happens) until
    released; then it raises :class:`Injected` so that the frozen thread ends."""

    def __init__(self, step: str) -> None:
        self.step = step
        self.reached = threading.Event()
        self.release = threading.Event()

    def __call__(self, name: str) -> None:
        if name == self.step:
            self.reached.set()
            self.release.wait(120)
            raise Injected(f"killed at {self.step}")


def interrupted_restore(make_driver: Callable[[str, Callable[[str], None]], Any], step: str, mode: str,
                        look: Callable[[], None]) -> None:
    """One restore that fails (``mode='fail'``) or is killed (``'kill'``) at ``step``: ``make_driver(run_id,
    hook)`` builds its driver; ``look()`` checks what it left, after the failure or while the driver is frozen
    at the step."""
    from airflow_arroyo.core.exceptions import PipelineFailedError

    run_id = f"{mode}-{step.replace(':', '-')}-{time.monotonic_ns() % 100_000}"
    if mode == "fail":
        try:
            make_driver(run_id, fail_at(step)).run()
        except PipelineFailedError as exc:
            assert f"injected at {step}" in str(exc), exc
        else:
            raise AssertionError(f"the restore did not fail at {step}")
        look()
        return
    kill = KillAt(step)
    thread = DriverThread(make_driver(run_id, kill)).start()
    try:
        wait_for(lambda: kill.reached.is_set() or thread.error, timeout=120, what=f"the restore to reach {step}")
        assert kill.reached.is_set(), thread.error
        look()
    finally:
        kill.release.set()
        thread.thread.join(120)
    assert isinstance(thread.error, PipelineFailedError) and f"killed at {step}" in str(thread.error), thread.error


_KILL_AT_STEP = """
import json, os, signal, sys
from airflow_arroyo.runtime.driver import PipelineDriver, load_pipeline
from airflow_arroyo.store import EpochStore
a = json.loads(sys.argv[1])
driver = PipelineDriver(load_pipeline(a["pipeline"], a["kwargs"]), EpochStore(a["dsn"]), storage_uri=a["storage"],
                        restore_from=a["restore_from"], run_id=a["run_id"], takeover=True)
driver.on_step = lambda name: os.kill(os.getpid(), signal.SIGKILL) if name == a["step"] else None
driver.run()
"""


def sigkill_restore_at(step: str, *, dsn: str, storage: Path, pipeline: str, kwargs: dict[str, Any],
                       restore_from: Any, run_id: str) -> None:
    """A restore in a process of its own (no Spark: a restore starts no query) that SIGKILLs itself at ``step``."""
    args = {"pipeline": pipeline, "kwargs": kwargs, "dsn": dsn, "storage": str(storage), "step": step,
            "restore_from": restore_from, "run_id": run_id}
    proc = subprocess.run([sys.executable, "-c", _KILL_AT_STEP, json.dumps(args)], capture_output=True, text=True,
                          timeout=180, cwd=str(Path(__file__).resolve().parents[2]))
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, proc.stderr[-3000:])


# --------------------------------------------------------------------------- the driver as a process of its own

SINK_DSN_ENV = "ARROYO_TEST_SINK_DSN"  # the environment variable a test's PostgreSQL sinks read their DSN from
DEMO_ROWS = 2000  # the demo pipeline's input in the SIGKILL proofs
DEMO_ROWS_PER_BATCH = 100
KILL_AT_STEP_ENV = "ARROYO_TEST_KILL_AT_STEP"

# The driver's own command line (airflow_arroyo.runtime.driver.main: its Spark session, its restore) in a process
# that SIGKILLs its process group (itself, its JVM, its Python workers) right after the step of its start that
# KILL_AT_STEP_ENV names (PipelineDriver._step, the step on_step is told of): a kill in the middle of a restore.
_MAIN_KILLED_AT_STEP = f"""
import os, signal, sys
from airflow_arroyo.runtime import driver
step = os.environ[{KILL_AT_STEP_ENV!r}]
done = driver.PipelineDriver._step
def _step(self, name):
    done(self, name)
    if name == step:
        print("SIGKILL at step " + name, flush=True)
        os.killpg(0, signal.SIGKILL)
driver.PipelineDriver._step = _step
sys.exit(driver.main(sys.argv[1:]))
"""


class Driver:
    """The driver as a subprocess in its own process group (so that SIGKILL takes the JVM too).

    By default the demo pipeline with its arguments; ``pipeline`` (a module ref) another, given only ``args``
    (JSON-encoded). ``options`` are more of the driver's options (``--rename``, ``--rescale``...);
    ``kill_at_step`` makes the process SIGKILL its whole group right after that step of its start."""

    def __init__(self, *, dsn: str, storage: Path | str, pipeline_id: str, run_id: str, logs: Path,
                 sink: Path | str | None = None, rows: int = DEMO_ROWS, checkpoints: Path | None = None,
                 env: dict[str, str] | None = None, sink_dsn: str | None = None, chaining: bool = False,
                 args: dict[str, object] | None = None, pipeline: str | None = None, options: Sequence[str] = (),
                 kill_at_step: str | None = None, restore_from: str = "latest") -> None:
        self.run_id = run_id
        self.log_path = logs / f"{run_id}.log"
        demo_args = [
            "--arg", f"rows={rows}", "--arg", f"rows_per_batch={DEMO_ROWS_PER_BATCH}", "--arg", f"sink_path={sink}",
            "--arg", f"chaining={'true' if chaining else 'false'}"]
        entry = ["-m", "airflow_arroyo.runtime.driver"] if kill_at_step is None else ["-c", _MAIN_KILLED_AT_STEP]
        cmd = [
            sys.executable, *entry,
            "--pipeline", pipeline or "airflow_arroyo.examples.pipelines:demo", "--arg", f"pipeline_id={pipeline_id}",
            *(demo_args if pipeline is None else []),
            *(a for key, value in (args or {}).items() for a in ("--arg", f"{key}={json.dumps(value)}")),
            *(["--arg", f"pg_dsn_env={SINK_DSN_ENV}", "--arg", "pg_report_table=report_rows",
               "--arg", "pg_totals_table=key_totals"] if sink_dsn else []),
            "--storage-uri", str(storage), "--run-id", run_id, "--restore-from", restore_from, "--takeover",
            "--master", "local[2]", "--conf", "spark.sql.shuffle.partitions=2", "--conf", "spark.ui.enabled=false",
            "--conf", "spark.driver.memory=1g", "--poll-interval", "0.05",
            *(["--checkpoint-uri", str(checkpoints)] if checkpoints is not None else []),
            *options,
        ]
        env = {**os.environ, **(env or {}), **({SINK_DSN_ENV: sink_dsn} if sink_dsn else {}), "ARROYO_DSN": dsn,
               "PYSPARK_PYTHON": sys.executable,
               "PYSPARK_DRIVER_PYTHON": sys.executable,
               **({KILL_AT_STEP_ENV: kill_at_step} if kill_at_step is not None else {})}
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - the process writes it until wait() closes it
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     cwd=str(Path(__file__).resolve().parents[2]), start_new_session=True)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.wait(60)

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            self._log.close()

    def tail(self, n: int = 60) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])


def current(store: Any, pid: str) -> Any:
    """The pipeline's record, ``None`` before it registered."""
    try:
        return store.get_pipeline(pid)
    except UnknownPipelineError:
        return None


def kill_at_random_after_an_epoch(driver: Driver, store: Any, pid: str, rng: random.Random, *,
                                  also: Callable[[], bool] = lambda: True, within: float = 3.0,
                                  timeout: float = 300.0) -> Any:
    """Once ``driver``'s run completed an epoch of its own and ``also()`` holds, SIGKILL its process group after a
    random while (up to ``within`` seconds: anywhere in an epoch's cycle, an epoch in flight or not). Returns the
    latest completed epoch after the kill (what ``restore_from='latest'`` takes next)."""

    def ready() -> bool:
        if not driver.alive():
            return True
        latest = store.latest_completed_epoch(pid) if current(store, pid) is not None else None
        return latest is not None and latest.run_id == driver.run_id and also()

    try:
        wait_for(ready, timeout=timeout, interval=0.1, what=f"an epoch of run {driver.run_id}")
    except AssertionError:
        driver.kill()
        raise AssertionError(f"run {driver.run_id} completed no epoch:\n{driver.tail()}") from None
    assert driver.alive(), f"run {driver.run_id} ended by itself:\n{driver.tail()}"
    time.sleep(rng.uniform(0.0, within))  # the kill's moment, chosen at random
    assert driver.alive(), f"run {driver.run_id} ended by itself:\n{driver.tail()}"
    driver.kill()
    latest = store.latest_completed_epoch(pid)
    assert latest is not None
    return latest


def restore_killed_at(step: str, start: Callable[..., Driver], run_id: str) -> None:
    """A restore in a driver process of its own (its own local Spark) that SIGKILLs its process group right after
    ``step`` (``rescaled:<stage>``, ``split:<stage>``...); ``start(run_id=, kill_at_step=)`` starts it."""
    driver = start(run_id=run_id, kill_at_step=step)
    try:
        code = driver.wait(300)
    except subprocess.TimeoutExpired:
        driver.kill()  # never reached the step: no driver and JVM left behind
        raise AssertionError(f"the restore did not reach {step} in 300 s:\n{driver.tail()}") from None
    assert code == -signal.SIGKILL and f"SIGKILL at step {step}" in driver.tail(), (code, driver.tail())


def epoch_objects(store: Any, storage: Path, pid: str, epoch: int) -> dict[str, tuple[int, int]]:
    """Every object of ``epoch``'s snapshots on local ``storage``: size and mtime (a rewrite, even of the same bytes,
    shows)."""
    from airflow_arroyo.runtime.layout import object_path

    out: dict[str, tuple[int, int]] = {}
    for stage in store.get_epoch(pid, epoch).stages:
        for entry in store.snapshot_entries(pid, epoch, stage):
            stat = (storage / object_path(pid, entry.object_key)).stat()
            out[entry.object_key] = (stat.st_size, stat.st_mtime_ns)
    assert out, f"epoch {epoch} has no snapshot object"
    return out


def kill_seed() -> random.Random:
    """The random source of a test's kill moments (``ARROYO_TEST_SEED`` replays a run's, printed)."""
    seed = int(os.environ.get("ARROYO_TEST_SEED", random.randrange(1 << 30)))
    print(f"ARROYO_TEST_SEED={seed}")
    return random.Random(seed)
