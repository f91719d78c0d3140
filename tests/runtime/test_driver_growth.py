"""What a driver keeps per epoch stays bounded over a long run (issue 30, finding 6 b), against a real epoch store
and without Spark: the driver's loop step that follows epochs (``_follow_epochs``) and commits its exactly-once
sinks is driven over many epochs the store triggers, completes and fails, with a recording sink in place of the
file sink (its commit and trim calls are what the driver decides)."""

from __future__ import annotations

from collections import deque
from pathlib import Path

from airflow_arroyo.core.epochs import CheckpointPolicy, EpochState, PipelineState
from airflow_arroyo.examples import SINK_STAGE, demo
from airflow_arroyo.runtime.driver import EPOCHS_SEEN_KEPT, PipelineDriver, _LoopState
from airflow_arroyo.runtime.sinks.base import SinkCommit
from airflow_arroyo.store import EpochStore

# No heartbeat timeout: the test drives the driver's epoch step, not its heartbeat, and on a slow machine its epochs
# outlast the default timeout, after which the store starts no epoch for a driver that never beat.
TICK = CheckpointPolicy(interval=3600, heartbeat_timeout=None)


class RecordingSink:
    """Stands in for the file sink: records what the driver asks."""

    token = None
    uri = "file:///out"

    def __init__(self) -> None:
        self.commits: list[int] = []
        self.trims: list[int] = []

    def commit_through(self, batch_id: int) -> SinkCommit:
        self.commits.append(batch_id)
        return SinkCommit(files=0, bytes=0, rows=0, batches=())

    def trim_through(self, batch_id: int) -> None:
        self.trims.append(batch_id)


def _containers(obj: object) -> dict[str, int]:
    """The size of every container attribute of ``obj``."""
    return {name: len(value) for name, value in vars(obj).items() if isinstance(value, list | dict | set | deque)}


def test_the_driver_keeps_a_bounded_record_of_the_epochs_it_saw(store: EpochStore, tmp_path: Path) -> None:
    driver = PipelineDriver(demo("growth", sink_path=str(tmp_path / "out"), chaining=False), store,
                            storage_uri=str(tmp_path), run_id="run-1", spark=None)
    sink = RecordingSink()
    driver.sinks = {SINK_STAGE: sink}  # type: ignore[dict-item]
    stages = driver.graph.stage_names
    store.register_pipeline("growth", stages=list(stages), run_id="run-1", storage_uri=str(tmp_path))
    store.set_pipeline_state("growth", PipelineState.RUNNING)
    turn = _LoopState(last_seen=0)
    sizes: list[dict[str, int]] = []
    completed: list[int] = []
    epochs = 3 * EPOCHS_SEEN_KEPT
    for i in range(epochs):
        started = store.trigger_tick("growth", TICK, force=True).started
        assert started is not None
        n = started.epoch
        driver._follow_epochs(turn, True)  # handed to the stages
        if i % 7 == 3:  # some epochs fail, and some in a row
            store.fail_epoch("growth", n, "a stage could not snapshot")
        elif i % 50 in (10, 11, 12):
            store.fail_epoch("growth", n, "expired")
        else:
            for stage in stages:
                store.ack_epoch("growth", n, stage, details={"batch_id": 10 * n})
            assert store.get_epoch("growth", n).state is EpochState.COMPLETED
            completed.append(n)
        driver._follow_epochs(turn, True)  # the epoch ended: commit what completed
        sizes.append(_containers(driver))

    # the sink was committed through each completed epoch's cut, in order, exactly as before
    assert sink.commits == [10 * n for n in completed]
    # what the driver holds does not grow with the epochs: the same at the end as a third of the way in
    grown = {k: (sizes[epochs // 3][k], v) for k, v in sizes[-1].items() if v > max(sizes[epochs // 3][k], 16)}
    assert not grown, f"driver attributes grew with the epochs (after a third, at the end): {grown}"

    result = driver._finish(completed[-1])
    assert result.epochs_seen_count == epochs
    assert result.epochs_seen == list(range(epochs - EPOCHS_SEEN_KEPT + 1, epochs + 1))
    assert store.get_pipeline("growth").state is PipelineState.STOPPED


def test_epochs_still_to_commit_never_changes_what_is_committed() -> None:
    """Trimming the seen epochs to those a later commit may still choose gives the same commits as the whole
    list, for every interleaving of completions, failures and still-running epochs (exhaustive, small)."""
    import itertools

    from airflow_arroyo.runtime.decisions import epoch_to_commit, epochs_still_to_commit

    ends = (EpochState.COMPLETED, EpochState.FAILED, EpochState.EXPIRED, EpochState.SUPERSEDED)
    for outcome in itertools.product(ends, repeat=4):
        for order in itertools.permutations(range(1, 5)):  # the order in which the epochs end
            seen: list[int] = []
            kept: list[int] = []
            done_all = done_kept = 0
            states: dict[int, EpochState] = {}
            for epoch in order:
                seen.append(epoch)
                kept.append(epoch)
                states[epoch] = outcome[epoch - 1]
                view = {e: states.get(e, EpochState.TRIGGERED) for e in range(1, 5)}
                a = epoch_to_commit(done_all, seen, {e: view[e] for e in seen if e > done_all})
                b = epoch_to_commit(done_kept, kept, {e: view[e] for e in kept if e > done_kept})
                assert a == b, (outcome, order, epoch)
                done_all, done_kept = a or done_all, b or done_kept
                kept = epochs_still_to_commit(done_kept, kept, view)
                assert all(view[e] in (EpochState.TRIGGERED, EpochState.COMPLETED) and e > done_kept for e in kept)


def test_a_stage_keeps_no_parsed_channel_entries_from_before_its_cut(store: EpochStore, tmp_path: Path) -> None:
    """A stage runner's channel handles (its inputs, which alignment reads, and its output, which it appends to)
    hold the entries they parsed; a run lasts months, so what they hold must not grow with the epochs. The
    runner is driven as its micro-batches drive it, without Spark: the upstream appends data and a barrier per
    epoch, Spark's offsets log says how far each batch read, the stage's output gets a batch per batch."""
    import json
    from concurrent.futures import ThreadPoolExecutor

    import pyarrow as pa

    from airflow_arroyo.runtime.channel import Channel
    from airflow_arroyo.runtime.graph import StageKind, StageSpec
    from airflow_arroyo.runtime.layout import StorageLayout
    from airflow_arroyo.runtime.snapshot import SnapshotStore
    from airflow_arroyo.runtime.stage import StageRunner

    store.register_pipeline("growth", stages=["b"], run_id="run-1", storage_uri=str(tmp_path))
    layout = StorageLayout.at(str(tmp_path), "growth")
    schema = pa.schema([("v", pa.int64())])
    upstream = Channel.create(layout.channel_uri("a"), schema=schema)
    spec = StageSpec("b", StageKind.STAGE, None, inputs=("a",), output="b")
    with ThreadPoolExecutor(1) as executor:
        runner = StageRunner(spec, layout=layout, store=store, snapshots=SnapshotStore(layout.fs, "growth", store),
                             executor=executor)
        runner.inputs["a"] = Channel.open(layout.channel_uri("a"))
        runner.output = Channel.create(layout.channel_uri("b"), schema=schema)
        held: list[int] = []
        for batch in range(300):
            epoch = batch // 2 + 1
            upstream.append_table(pa.table({"v": [batch]}, schema=schema), batch, "a")
            if batch % 2:
                upstream.append_barrier(epoch, "a")
            layout.checkpoint_fs.write_bytes_atomic(  # what Spark's offsets log says batch `batch` read
                f"{runner.checkpoint}/offsets/{batch}",
                f"v1\n{{}}\n{json.dumps({'key': 'a', 'pos': upstream.end_position()})}".encode())
            runner.output.last_batch_id("b")  # as _write does before it appends
            runner.output.append_table(pa.table({"v": [batch]}, schema=schema), batch, "b")
            with runner._lock:
                runner._channel_cut(batch)
            held.append(len(runner.inputs["a"]._cache.entries) + len(runner.output._cache.entries))
    assert runner.last_cut_epoch == 150
    assert max(held[100:]) <= 8, held  # the entries since the last cut, not every entry of the run
