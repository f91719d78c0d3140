"""Alignment made visible on real Spark: a two-input stage whose input ``b`` is held back. Input ``a``
delivers barrier 1 and has more data behind it; the stage caps ``a`` at its barrier (caps.json) and
keeps reading ``b``; when ``b`` finally delivers barrier 1 (a barrier-only batch: an idle input does not
deadlock the other), that batch is the cut, barrier 1 goes to the output right after it, the cap is
lifted and ``a``'s later data follows, after the barrier."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from airflow_arroyo.core.epochs import CheckpointPolicy, EpochState, PipelineState
from airflow_arroyo.runtime.channel import Channel
from airflow_arroyo.runtime.layout import StorageLayout
from airflow_arroyo.runtime.pipeline import StageKind, StageSpec
from airflow_arroyo.runtime.spark_checkpoint import checkpoint_offsets
from airflow_arroyo.runtime.stage import StageRunner
from airflow_arroyo.testing import wait_for
from tests.support import running_stage

pytestmark = [pytest.mark.spark]

SCHEMA = pa.schema([("id", pa.int64()), ("src", pa.string())])


def rows(src: str, ids: list[int]) -> pa.Table:
    return pa.table({"id": pa.array(ids, pa.int64()), "src": [src] * len(ids)}, schema=SCHEMA)


def output_ids(ch: Channel, start: int = 0, end: int | None = None) -> list[int]:
    return sorted(Channel.open(ch.uri).read_table(start, end).column("id").to_pylist())


@pytest.fixture
def runner(spark: Any, store: Any, tmp_path: Path) -> Iterator[StageRunner]:
    pid = f"align-{uuid.uuid4().hex[:8]}"
    layout = StorageLayout.at(str(tmp_path), pid)
    Channel.create(layout.channel_uri("a"), SCHEMA)
    Channel.create(layout.channel_uri("b"), SCHEMA)
    store.register_pipeline(pid, stages=["merge"], run_id="r1")
    store.set_pipeline_state(pid, PipelineState.RUNNING)
    spec = StageSpec(name="merge", kind=StageKind.STAGE, fn=lambda a, b: a.unionByName(b), inputs=("a", "b"),
                     output="merge")
    with running_stage(spark, store, layout, spec, workers=2) as r:
        yield r


def test_held_back_input_caps_the_other_at_its_barrier_until_the_cut(runner: StageRunner, store: Any) -> None:
    pid = runner.pipeline_id
    layout = runner.layout
    a = Channel.open(layout.channel_uri("a"))
    b = Channel.open(layout.channel_uri("b"))
    assert runner.output is not None
    out = runner.output
    a.append_table(rows("a", [0, 1]), 0, "up-a")
    b.append_table(rows("b", [100, 101]), 0, "up-b")
    wait_for(lambda: len(output_ids(out)) == 4, timeout=180, what="the first rows through the stage")

    # no driver heartbeats here (the test runs the stage itself): liveness is not what this test is about, and on a
    # busy machine the first rows can take longer than the default heartbeat timeout
    epoch = store.trigger_tick(pid, CheckpointPolicy(interval=1, heartbeat_timeout=None), force=True).started.epoch
    bar_a = a.append_barrier(epoch, "up-a")
    a.append_table(rows("a", [2, 3]), 1, "up-a")  # behind a's barrier: must wait for the cut

    wait_for(lambda: runner.caps() == {"a": bar_a + 1}, timeout=180, what="input a capped at its barrier")
    assert layout.fs.read_json(layout.caps("merge")) == {"caps": {"a": bar_a + 1}}

    # b is held back, but its data still flows while a is capped
    b.append_table(rows("b", [102]), 1, "up-b")
    wait_for(lambda: 102 in output_ids(out), timeout=180, what="b's data to pass while a is capped")
    assert output_ids(out) == [0, 1, 100, 101, 102]  # nothing of a past its barrier
    assert runner.caps() == {"a": bar_a + 1}
    assert Channel.open(out.uri).find_barrier(epoch) is None
    assert store.get_epoch(pid, epoch).state is EpochState.TRIGGERED

    bar_b = b.append_barrier(epoch, "up-b")  # b delivers the barrier, with no data: a barrier-only batch
    wait_for(lambda: store.get_epoch(pid, epoch).state is EpochState.COMPLETED, timeout=180,
             what=f"epoch {epoch} to complete")
    wait_for(lambda: 3 in output_ids(out), timeout=180, what="a's data behind the barrier, after the cut")

    out = Channel.open(out.uri)
    bar_out = out.find_barrier(epoch)
    assert bar_out is not None
    assert output_ids(out, 0, bar_out) == [0, 1, 100, 101, 102]  # the epoch's data, before the barrier
    assert output_ids(out, bar_out + 1) == [2, 3]  # released exactly after the cut
    assert runner.caps() == {}
    cut = runner.cuts[0]
    assert (cut.epoch, cut.output_barrier) == (epoch, bar_out)
    ends = {o["key"]: o["pos"] for o in checkpoint_offsets(runner.checkpoint_uri, cut.batch_id) if o}
    assert ends == {"a": bar_a + 1, "b": bar_b + 1}  # the cut batch ends exactly on both barriers
    later = {o["key"]: o["pos"] for o in checkpoint_offsets(runner.checkpoint_uri, cut.batch_id + 1) if o}
    assert later["a"] > bar_a + 1  # the next batch reads past a's barrier: the cap was lifted
    (ack,) = store.acks(pid, epoch)
    assert ack.cursors == {"a": bar_a + 1, "b": bar_b + 1}
    assert ack.alignment_ms is not None and ack.alignment_ms > 0  # a waited for b
    assert ack.details["batch_id"] == cut.batch_id
