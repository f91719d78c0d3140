"""A snapshot recorded after its epoch was pruned must be refused (its objects would leak)."""

import pytest

from airflow_arroyo.core.epochs import CheckpointPolicy, PipelineState
from airflow_arroyo.core.exceptions import ConcurrencyConflict
from airflow_arroyo.store import SnapshotEntry


def test_record_snapshot_refused_for_pruned_epoch(store):
    store.register_pipeline("p", stages=["a"], run_id="r")
    store.set_pipeline_state("p", PipelineState.RUNNING)
    pol = CheckpointPolicy(interval=1)
    for _ in range(2):
        e = store.trigger_tick("p", pol, force=True).started
        store.record_snapshot("p", e.epoch, "a", [SnapshotEntry("x", f"k{e.epoch}", 1)])
        store.ack_epoch("p", e.epoch, "a")
    run = store.acquire_cleanup_lock("p", "me")
    plan = store.begin_prune("p", run.id, [1])
    assert plan.epochs == [1]
    with pytest.raises(ConcurrencyConflict, match="too late"):
        store.record_snapshot("p", 1, "a", [SnapshotEntry("y", "k9", 1)])
    assert store.known_objects("p", ["k9"]) == set()
