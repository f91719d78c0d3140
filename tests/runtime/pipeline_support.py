"""Helpers for pipeline tests: a checkpoint controller thread, waiting with deadlines, channel contents."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from airflow_arroyo.epochs import CheckpointPolicy
from airflow_arroyo.runtime.channel import Channel
from tests.support import wait_for

T = TypeVar("T")


class Controller:
    """Plays the checkpoint trigger: one ``trigger_tick`` every ``tick`` seconds (what the Airflow trigger does)."""

    def __init__(self, store: Any, pipeline_id: str, *, interval: float = 1.5, timeout: float = 120.0,
                 tick: float = 0.25) -> None:
        self.store = store
        self.pipeline_id = pipeline_id
        self.policy = CheckpointPolicy(interval=interval, timeout=timeout)
        self.tick = tick
        self.started: list[int] = []
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"controller-{pipeline_id}", daemon=True)

    def __enter__(self) -> Controller:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(30)

    def _run(self) -> None:
        from airflow_arroyo.exceptions import ArroyoError

        while not self._stop.wait(self.tick):
            try:
                result = self.store.trigger_tick(self.pipeline_id, self.policy, triggered_by="test-controller")
            except ArroyoError as exc:  # e.g. the pipeline is not registered yet
                self.errors.append(exc)
                continue
            if result.started is not None:
                self.started.append(result.started.epoch)


class DriverThread:
    """Runs ``driver.run()`` in a thread and keeps its result or exception."""

    def __init__(self, driver: Any) -> None:
        self.driver = driver
        self.result: Any = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="driver", daemon=True)

    def _run(self) -> None:
        try:
            self.result = self.driver.run()
        except BaseException as exc:  # noqa: BLE001 - handed to the test, which re-raises it in join()
            self.error = exc

    def start(self) -> DriverThread:
        self.thread.start()
        return self

    def join(self, timeout: float) -> Any:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"the driver did not end within {timeout:g}s"
        if self.error is not None:
            raise self.error
        return self.result


def rows_of(uri: str) -> list[tuple[Any, ...]]:
    table = Channel.open(uri).read_table()
    return sorted(tuple(r.values()) for r in table.to_pylist())


def row_count(uri: str) -> int:
    """Rows committed to a channel (from its entries; no data file is read)."""
    if not Channel.exists(uri):
        return 0
    ch = Channel.open(uri)
    return sum(e.rows for e in ch.data_entries(ch.start_position(), ch.end_position()))


def barriers(uri: str) -> list[tuple[int, int]]:
    """(index, epoch) of every barrier entry, in log order."""
    ch = Channel.open(uri)
    return [(e.index, int(e.epoch)) for e in ch.entries(ch.start_position()) if e.is_barrier and e.epoch is not None]


def check_barriers_follow_cuts(store: Any, pipeline_id: str, channel_uris: dict[str, str]) -> int:
    """For every completed epoch and every stage writing a channel: barrier n follows the output of the
    stage's cut batch (its ack's ``details["batch_id"]``) and precedes any later batch's output.
    Returns how many (epoch, stage) pairs were checked."""
    from airflow_arroyo.epochs import EpochState

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


def run_until(driver: Any, store: Any, done: Callable[[], bool], *, what: str, epochs: bool = True,
              stop: str = "graceful", interval: float = 1.5) -> Any:
    """Run ``driver`` in a thread (with a checkpoint controller if ``epochs``) until ``done()``, then
    request ``stop`` and return the driver's result. ``done`` is first called once the driver started
    (a restore truncates channels, so they are read only after it)."""
    pipeline_id = driver.pipeline.pipeline_id
    thread = DriverThread(driver).start()
    controller = Controller(store, pipeline_id, interval=interval)
    if epochs:
        controller.__enter__()
    try:
        wait_for(lambda: driver.started.is_set() or thread.error, timeout=300, what="the queries to start")
        wait_for(lambda: thread.error or done(), timeout=600, what=what)
    finally:
        controller.stop()
    store.request_stop(pipeline_id, stop)
    return thread.join(300)


def committed_rows(path: Any) -> list[tuple[Any, ...]]:
    """What a reader of a file sink's folder sees, sorted (pyarrow skips '_arroyo_sink', where pending
    batches wait)."""
    import pyarrow.dataset as ds

    if not os.path.exists(path):
        return []
    table = ds.dataset(str(path), format="parquet").to_table()
    return sorted(tuple(r.values()) for r in table.to_pylist())
