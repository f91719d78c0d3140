"""Helpers for pipeline tests beyond :mod:`airflow_arroyo.testing`: barriers against the cuts, and the
steps of a restore (a failure or a kill injected at one, what the store and the storage hold meanwhile)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

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


def file_tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every file below ``root``: size and mtime (a rewrite, even of the same bytes, shows)."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")
            if p.is_file()}


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
