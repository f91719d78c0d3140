"""Channel retention keeps what an unaligned cut's restore reads again (issue 34, deliverable 3), against a real
Postgres epoch store and real channel files.

A stage cut unaligned records as its cursor the end of its last completed micro-batch, before the epoch's barrier
on its input: a restore of that epoch reads the records between the cursor and the barrier again from the channel.
Retention must therefore keep a channel from the oldest retained epoch's cursor on, not from its barrier: a
watermark at the barrier would delete those records and a restore would skip them."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest

from airflow_arroyo.core.epochs import RetentionPolicy
from airflow_arroyo.runtime.channel import Channel, ChannelError
from airflow_arroyo.store import EpochStore
from tests.controlplane.test_retention import Pipeline, prune


def build(store: EpochStore, tmp_path: Path) -> tuple[str, list[int]]:
    """A channel ``events`` read by ``agg``: epoch 1 cut aligned (cursor right after its barrier), epochs 2 and 3
    cut unaligned with data entries in flight between the cursor and the barrier.

    Positions: 0 d0, 1 b1, 2 d1, 3 d2, 4 b2, 5 d3, 6 d4, 7 b3, 8 d5 (dN holds x = 10N .. 10N+9)."""
    uri = str(tmp_path / "channels" / "events")
    channel = Channel.create(uri)
    pipe = Pipeline(store, tmp_path, stages=("agg",), channels={"events": uri})
    batch = 0

    def data(n: int) -> None:
        nonlocal batch
        for _ in range(n):
            channel.append_table(pa.table({"x": list(range(batch * 10, batch * 10 + 10))}), batch_id=batch,
                                 writer="src")
            batch += 1

    epochs = []
    for before, cursor in ((1, 2), (2, 3), (2, 5)):
        data(before)
        n = pipe.start()
        channel.append_barrier(n, writer="src")
        pipe.snapshot(n, "agg", {f"state-{n}": 10})
        store.ack_epoch("orders", n, "agg", cursors={"events": cursor}, details={"unaligned": cursor != batch + n})
        epochs.append(n)
    data(1)
    return uri, epochs


def test_retention_keeps_the_records_in_flight_at_the_oldest_retained_unaligned_cut(store: EpochStore,
                                                                                    tmp_path: Path) -> None:
    uri, epochs = build(store, tmp_path)
    assert Channel.open(uri).find_barrier(epochs[2]) == 7

    report = prune(store, policy=RetentionPolicy(keep_last=1))

    assert report.epochs_pruned == epochs[:2]
    reopened = Channel.open(uri)
    assert reopened.start_position() <= 5  # the cursor of epoch 3, not its barrier (7)
    # what a restore of epoch 3 reads again (cursor 5 up to its barrier), then after it: nothing lost
    assert reopened.read_table(5, 7).column("x").to_pylist() == list(range(30, 50))
    assert reopened.find_barrier(epochs[2]) == 7
    # entries no retained epoch needs are gone (retention still frees space)
    with pytest.raises(ChannelError, match="deleted by retention"):
        reopened.read_table(2, 4)


def test_retention_keeps_each_retained_epochs_records_in_flight(store: EpochStore, tmp_path: Path) -> None:
    uri, epochs = build(store, tmp_path)

    report = prune(store, policy=RetentionPolicy(keep_last=2))

    assert report.epochs_pruned == epochs[:1]
    reopened = Channel.open(uri)
    # epoch 2 was cut with d2 in flight (cursor 3, barrier 2 at 4): a restore of it reads d2 again
    assert reopened.read_table(3, 4).column("x").to_pylist() == list(range(20, 30))
    assert reopened.find_barrier(epochs[1]) == 4
