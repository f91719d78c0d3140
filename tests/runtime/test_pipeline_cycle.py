"""A loop (FLIP-16) on real Spark: every record goes around the loop ``n`` times (n = value mod 4),
then leaves. The iteration head does not align on its feedback channel; its part of an epoch completes
when the barrier came back around the loop; a restore from a middle epoch replays the records that
were in flight in the loop from the feedback channel, and the outputs stay exactly-once.

::

    src ──> loop (head: src + feedback) ──> step (n > 0: n - 1) ──┐
                  ^                    └──> done (n = 0)          │
                  └──────────────── feedback ─────────────────────┘
"""

from __future__ import annotations

import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from airflow_arroyo.core.epochs import EpochState
from airflow_arroyo.runtime.channel import Channel
from airflow_arroyo.runtime.driver import PipelineDriver
from airflow_arroyo.runtime.layout import StorageLayout
from airflow_arroyo.runtime.pipeline import Pipeline
from airflow_arroyo.testing import channel_barriers, channel_row_count, generate_rows, generator_source, run_until

pytestmark = [pytest.mark.spark]

ROWS = 600
SEED = 5
LAPS = 4


def loop_pipeline(pid: str) -> Pipeline:
    p = Pipeline(pid)
    src = p.source("src", lambda s: generator_source(s, seed=SEED, keys=10, total_rows=ROWS, rows_per_batch=60)
                   .selectExpr("id", f"value % {LAPS} AS n"))
    p.stage("loop", lambda s, fb: s.unionByName(fb), inputs=[src], feedback=["step"])
    p.stage("step", lambda x: x.where("n > 0").selectExpr("id", "n - 1 AS n"), inputs=["loop"])
    p.stage("done", lambda x: x.where("n = 0").select("id"), inputs=["loop"])
    return p


def expected_loop() -> Counter[tuple[int, int]]:
    t = generate_rows(SEED, 0, ROWS, 10).to_pydict()
    return Counter((i, k) for i, v in zip(t["id"], t["value"], strict=True) for k in range(v % LAPS + 1))


def run(spark: Any, store: Any, pid: str, storage: Path, *, restore_from: Any = None, epochs: bool = True) -> Any:
    driver = PipelineDriver(loop_pipeline(pid), store, storage_uri=str(storage), spark=spark,
                            restore_from=restore_from)
    layout = driver.layout
    total = sum(expected_loop().values())
    return run_until(driver, store, lambda: channel_row_count(layout.channel_uri("done")) >= ROWS
                     and channel_row_count(layout.channel_uri("loop")) >= total,
                     what="every record to leave the loop", epochs=epochs)


def check_outputs(layout: StorageLayout) -> None:
    done = Channel.open(layout.channel_uri("done")).read_table().column("id").to_pylist()
    assert sorted(done) == list(range(ROWS))  # each record leaves exactly once
    loop = Channel.open(layout.channel_uri("loop")).read_table().to_pydict()
    assert Counter(zip(loop["id"], loop["n"], strict=True)) == expected_loop()  # each lap exactly once


def test_loop_epochs_complete_and_restore_replays_the_feedback(spark: Any, store: Any, tmp_path: Path) -> None:
    pid = f"loop-{uuid.uuid4().hex[:8]}"
    storage = tmp_path / "storage"
    layout = StorageLayout.at(str(storage), pid)
    first = run(spark, store, pid, storage)
    check_outputs(layout)
    completed = sorted(e.epoch for e in store.list_epochs(pid) if e.state is EpochState.COMPLETED)
    assert len(completed) >= 2 and first.final_epoch == completed[-1]
    feedback_positions = dict((e, i) for i, e in channel_barriers(layout.channel_uri("step")))
    step = Channel.open(layout.channel_uri("step"))
    for n in completed:
        acks = {a.stage: a for a in store.acks(pid, n)}
        assert sorted(acks) == ["done", "loop", "src", "step"]
        # the head's cursor on its feedback: where it stood at its cut, at or before barrier n there
        assert acks["loop"].cursors["step"] <= feedback_positions[n]
        # the head acknowledged only once barrier n had come back around the loop
        returned_at = step.entry(feedback_positions[n]).time
        assert returned_at is not None and acks["loop"].acked_at.timestamp() >= returned_at
    # restore from the first completed epoch whose feedback range is not empty: records in flight
    in_flight = [n for n in completed[:-1]
                 if store.acks(pid, n) and
                 {a.stage: a for a in store.acks(pid, n)}["loop"].cursors["step"] < feedback_positions[n]]
    assert in_flight, "no epoch had records in flight in the loop at its cut; nothing to replay"
    target = in_flight[0]
    second = run(spark, store, pid, storage, restore_from=target, epochs=False)
    assert second.restored_from_epoch == target
    check_outputs(layout)
