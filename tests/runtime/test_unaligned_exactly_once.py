"""Unaligned cuts are exactly-once (issue 34, deliverable 3), on real Spark with a real epoch store.

A source feeds, through a channel, a sink stage slowed so that a backlog builds in the channel; with
``alignment_timeout=0`` that stage cuts each epoch at its last completed micro-batch instead of waiting for the
barrier behind the backlog, so its cursor sits before the barrier and the records in between are in flight, kept
only by the channel. The driver process is SIGKILLed (its JVM with it) right after such an epoch completed, a run in
this process restores it and reads the rest of the input; the exactly-once file sink must hold every input id
once, as plain Python lists them: the in-flight records were read again exactly once. A restore of that
epoch into code that fuses the two stages (the channel, and the records in flight with it, gone) is refused."""

from __future__ import annotations

import json
import os
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from airflow_arroyo.core.epochs import EpochState, PipelineState
from airflow_arroyo.core.exceptions import ConfigurationError
from airflow_arroyo.runtime.channel import Channel
from airflow_arroyo.runtime.driver import PipelineDriver
from airflow_arroyo.runtime.layout import StorageLayout
from airflow_arroyo.runtime.pipeline import Pipeline
from airflow_arroyo.store import EpochStore
from airflow_arroyo.testing import CheckpointTicker, DriverThread, channel_row_count, generator_source, wait_for
from tests.runtime.pipeline_support import Driver, kill_at_random_after_an_epoch, kill_seed

pytestmark = [pytest.mark.spark]



def emitted(path: Path) -> list[int]:
    """Every id the sink committed."""
    out: list[int] = []
    for folder, dirs, files in os.walk(path):
        dirs[:] = [d for d in dirs if not d.startswith(("_", "."))]
        for name in files:
            if not name.startswith(("_", ".")):
                out += [int(json.loads(line)["id"]) for line in Path(folder, name).read_text().splitlines() if line]
    return out


def pipeline(pipeline_id: str, root: str, rows: int, rate: int, delay: float, chaining: bool = False) -> Pipeline:
    """The driver's ``--pipeline tests.runtime.test_unaligned_exactly_once:pipeline``: a generator of ``rows`` ids
    (``rate`` a second) into a channel, read by a file sink (exactly-once) that sleeps ``delay`` seconds per channel
    entry it reads (one Spark partition each); ``chaining``: the two fused into one query."""

    def slowed(df: Any) -> Any:
        def slow(batches: Iterator[Any]) -> Iterator[Any]:
            time.sleep(delay)
            yield from batches

        return df.mapInArrow(slow, df.schema)

    # a source writes an entry per micro-batch: at 0.1 s (not a source's default 0.5 s) it outruns the slowed reader,
    # so a backlog builds; both stages set it, as stages with different cadences do not fuse
    p = Pipeline(pipeline_id, chaining=chaining)
    src = p.source("src", lambda spark: generator_source(spark, total_rows=rows, rows_per_second=rate,
                                                          partitions=1).select("id"), trigger_interval=0.1)
    p.sink("out", [src], transform=slowed, format="json", options={"path": f"{root}/out"}, trigger_interval=0.1)
    return p


def unaligned_cut(store: EpochStore, pid: str, channel: Channel, epoch: int) -> int | None:
    """How many data entries were in flight (between the count stage's cursor and barrier ``epoch`` on the channel)
    if that stage cut ``epoch`` unaligned with its cursor strictly before the barrier; else None."""
    (ack,) = [a for a in store.acks(pid, epoch) if a.stage == "out"]
    barrier = channel.find_barrier(epoch)
    assert barrier is not None, epoch
    cursor = ack.cursors["src"]
    assert cursor <= barrier + 1, (epoch, cursor, barrier)  # a reader never crosses a barrier it has not cut
    if not ack.details.get("unaligned") or cursor == barrier + 1:
        return None
    return sum(1 for e in channel.entries(cursor, barrier) if not e.is_barrier)


def test_sigkilled_after_an_unaligned_cut_the_restore_reads_the_records_in_flight_exactly_once(
        spark: Any, module_store: EpochStore, tmp_path: Path) -> None:
    rng = kill_seed()
    rows = 3000
    expected = list(range(rows))  # each id once
    pid = f"unaligned-{uuid.uuid4().hex[:6]}"
    layout = StorageLayout.at(str(tmp_path / "storage"), pid)
    logs = tmp_path / "logs"
    logs.mkdir()
    # slowly: the source's first batch holds what its pace made exist while the queries started (long on a loaded
    # machine), and input must be left for the restore
    args = {"root": str(tmp_path), "rows": rows, "rate": 30, "delay": 0.3}

    def channel() -> Channel:
        return Channel.open(layout.channel_uri("src"))

    def latest_unaligned() -> bool:
        latest = module_store.latest_completed_epoch(pid)
        return latest is not None and (unaligned_cut(module_store, pid, channel(), latest.epoch) or 0) >= 2

    killed = Driver(dsn=module_store.dsn, storage=tmp_path / "storage", pipeline_id=pid, run_id="killed", logs=logs,
                    pipeline="tests.runtime.test_unaligned_exactly_once:pipeline", args=args,
                    options=["--alignment-timeout", "0"])
    with CheckpointTicker(module_store, pid, interval=0.5, timeout=240):
        latest = kill_at_random_after_an_epoch(killed, module_store, pid, rng, also=latest_unaligned, within=0.2,
                                               timeout=240)
    assert channel_row_count(layout.channel_uri("src")) < rows  # input is left for the restore
    in_flight = unaligned_cut(module_store, pid, channel(), latest.epoch)
    assert in_flight is not None and in_flight >= 2, f"epoch {latest.epoch} was cut aligned:\n{killed.tail()}"

    def written() -> bool:
        return len(emitted(tmp_path / "out")) >= rows

    driver = PipelineDriver(pipeline(pid, str(tmp_path), rows, rate=2000, delay=0.05), module_store,
                            storage_uri=str(tmp_path / "storage"), spark=spark, run_id="restored",
                            restore_from="latest", takeover=True, alignment_timeout=0)
    thread = DriverThread(driver).start()
    with CheckpointTicker(module_store, pid, interval=0.5, timeout=240):
        wait_for(lambda: thread.error or (driver.started.is_set() and written()), timeout=240,
                 what="the restored run to write every row", interval=0.2)
    module_store.request_stop(pid, "graceful")
    result = thread.join(240)
    assert result.state is PipelineState.STOPPED and result.restored_from_epoch == latest.epoch

    ids = sorted(emitted(tmp_path / "out"))
    assert ids == expected, (len(ids), sorted(i for i, c in Counter(ids).items() if c > 1)[:10],
                             sorted(set(expected) - set(ids))[:10])
    # every completed epoch's cursor is at or before its barrier (checked in unaligned_cut), and the restored run
    # cut unaligned too
    completed = [e for e in module_store.list_epochs(pid, limit=1000) if e.state is EpochState.COMPLETED]
    cuts = {e.epoch: unaligned_cut(module_store, pid, channel(), e.epoch) for e in completed}
    print(f"restored epoch {latest.epoch}, {in_flight} data entries in flight; in flight by epoch: {cuts}")
    assert any(cut is not None for e, cut in cuts.items() if e > latest.epoch), cuts

    # the epoch restored above, into code that fuses the stages: refused before anything is written
    newest = module_store.latest_completed_epoch(pid)
    with pytest.raises(ConfigurationError, match=rf"epoch {latest.epoch} cut out \(src\) unaligned, with records in "
                                                 "flight in the channel the merge removes"):
        PipelineDriver(pipeline(pid, str(tmp_path), rows, rate=2000, delay=0.05, chaining=True), module_store,
                       storage_uri=str(tmp_path / "storage"), spark=spark, run_id="fused", restore_from=latest.epoch,
                       takeover=True).run()
    assert module_store.latest_completed_epoch(pid) == newest
