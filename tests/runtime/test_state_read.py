"""Reading a pipeline's state as of an epoch (airflow_arroyo.core.state) on real Spark: a keyed count run through
a few epochs; each epoch's state read through the API equals the counts computed in plain Python from the
generator rows before the epoch's barrier, and so does the diff of two epochs; the refusals; the CLI verb."""

from __future__ import annotations

import json
import uuid
from collections import Counter
from dataclasses import dataclass
from io import StringIO
from pathlib import Path
from typing import Any

import pytest

from airflow_arroyo.cli import EXIT_BAD_INPUT, EXIT_OK, main
from airflow_arroyo.core.epochs import CheckpointPolicy, EpochState
from airflow_arroyo.core.exceptions import ConfigurationError, NotFoundError, UnknownEpochError, UnknownPipelineError
from airflow_arroyo.core.state import diff_counts, read_state, read_state_diff, resolve_state, state_metadata
from airflow_arroyo.runtime.channel import Channel
from airflow_arroyo.runtime.driver import PipelineDriver
from airflow_arroyo.runtime.layout import StorageLayout
from airflow_arroyo.runtime.pipeline import Pipeline
from airflow_arroyo.store import EpochStore, SnapshotEntry
from airflow_arroyo.testing import channel_row_count, generate_row, generator_source, run_until
from tests.support import running

pytestmark = [pytest.mark.spark, pytest.mark.slow]

SEED, KEYS, ROWS, PER_BATCH = 33, 7, 480, 40


def counting(pipeline_id: str) -> Pipeline:
    """events (a generator: stateless) -> counts (a count per key after dropping duplicate ids: two stateful
    operators in one query, the ids seen and the counts)."""
    def events(spark: Any) -> Any:
        return generator_source(spark, seed=SEED, keys=KEYS, total_rows=ROWS, rows_per_batch=PER_BATCH)

    def counts(df: Any) -> Any:
        return df.dropDuplicates(["id"]).groupBy("key").count()

    p = Pipeline(pipeline_id, chaining=False)
    src = p.source("events", events)
    p.stage("counts", counts, inputs=[src], output_mode="update")
    return p


@dataclass
class Ran:
    pipeline_id: str
    layout: StorageLayout
    epochs: list[int]  # completed epochs whose counts cut is at a batch >= 0
    operators: dict[str, int]  # "dedup", "count" -> operator id


def rows_before(layout: StorageLayout, epoch: int) -> int:
    """How many generator rows the events channel holds before barrier ``epoch`` (they must be its first k)."""
    ch = Channel.open(layout.channel_uri("events"))
    ids = sorted(ch.read_table(0, ch.find_barrier(epoch)).column("id").to_pylist())
    assert ids == list(range(len(ids))), "the events channel is not the generator's prefix"
    return len(ids)


def expected_counts(layout: StorageLayout, epoch: int) -> dict[str, int]:
    """Counts per key of the generator rows before barrier ``epoch``, each row's key recomputed in plain Python."""
    return dict(Counter(generate_row(SEED, i, KEYS)[1] for i in range(rows_before(layout, epoch))))


def state_counts(df: Any) -> dict[str, int]:
    return {r["key"]["key"]: int(r["value"]["count"]) for r in df.collect()}


@pytest.fixture(scope="module")
def ran(spark: Any, module_store: EpochStore, tmp_path_factory: pytest.TempPathFactory) -> Ran:
    pid = f"state-{uuid.uuid4().hex[:8]}"
    storage = tmp_path_factory.mktemp("storage")
    driver = PipelineDriver(counting(pid), module_store, storage_uri=str(storage), run_id="r1", spark=spark)
    run_until(driver, module_store, lambda: channel_row_count(driver.layout.channel_uri("events")) >= ROWS,
              what="every generator row in the events channel", interval=1.0)
    completed = [e.epoch for e in module_store.list_epochs(pid) if e.state is EpochState.COMPLETED]
    cut = {n: next(a for a in module_store.acks(pid, n) if a.stage == "counts").details["batch_id"]
           for n in completed}
    epochs = sorted(n for n in completed if cut[n] >= 0)
    assert len(epochs) >= 2, f"need two epochs with state, got cuts {cut}"
    meta = state_metadata(module_store, pid, epochs[-1], "counts", spark=spark)
    names = {int(m["operatorId"]): str(m["operatorName"]).lower() for m in meta}
    assert len(names) == 2, meta
    operators = {"dedup": next(i for i, n in names.items() if "dedup" in n),
                 "count": next(i for i, n in names.items() if "dedup" not in n)}
    return Ran(pid, StorageLayout.at(str(storage), pid), epochs, operators)


def test_each_epochs_state_equals_the_counts_of_its_input(ran: Ran, module_store: EpochStore, spark: Any) -> None:
    seen = []
    for n in ran.epochs:
        expected = expected_counts(ran.layout, n)
        counts = read_state(module_store, ran.pipeline_id, n, "counts", spark=spark,
                            operator_id=ran.operators["count"])
        assert state_counts(counts) == expected, n
        ids = read_state(module_store, ran.pipeline_id, n, "counts", spark=spark, operator_id=ran.operators["dedup"])
        assert sorted(r["key"]["id"] for r in ids.collect()) == list(range(rows_before(ran.layout, n))), n
        seen.append(sum(expected.values()))
    assert len(set(seen)) > 1, f"every epoch held the same rows ({seen}): the reads prove little"


def test_diff_of_two_epochs_equals_the_python_diff(ran: Ran, module_store: EpochStore, spark: Any) -> None:
    # the two epochs furthest apart with different inputs
    first, last = ran.epochs[0], ran.epochs[-1]
    old, new = expected_counts(ran.layout, first), expected_counts(ran.layout, last)
    assert old != new
    diff = read_state_diff(module_store, ran.pipeline_id, first, last, "counts", spark=spark,
                           operator_id=ran.operators["count"])
    rows = {r["key"]["key"]: (r["change"], r["before"] and r["before"]["count"], r["after"] and r["after"]["count"])
            for r in diff.collect()}
    want: dict[str, tuple[str, int | None, int | None]] = {k: ("added", None, new[k]) for k in new.keys() - old.keys()}
    want |= {k: ("removed", old[k], None) for k in old.keys() - new.keys()}
    want |= {k: ("changed", old[k], new[k]) for k in old.keys() & new.keys() if old[k] != new[k]}
    assert rows == want
    assert diff_counts(diff) == {c: sum(1 for v in want.values() if v[0] == c) for c in ("added", "removed", "changed")}


def test_ack_records_state_bytes_and_rows(ran: Ran, module_store: EpochStore) -> None:
    counted = 0
    for n in ran.epochs:
        acks = {a.stage: a for a in module_store.acks(ran.pipeline_id, n)}
        state = [e for e in module_store.snapshot_entries(ran.pipeline_id, n, "counts")
                 if e.rel_path.startswith("state/")]
        assert acks["counts"].details["state_bytes"] == sum({e.object_key: e.bytes for e in state}.values()) > 0
        # the ids seen and the keys counted so far; None only where Spark had not reported the cut batch's progress
        rows = acks["counts"].details["state_rows"]
        assert rows is None or rows == rows_before(ran.layout, n) + len(expected_counts(ran.layout, n)), (n, rows)
        counted += rows is not None
        assert acks["events"].details["state_bytes"] == 0 and acks["events"].details["state_rows"] is None
    assert counted, "no acknowledgement recorded the state's row count"


def test_a_read_leaves_the_objects_and_the_live_checkpoint_alone(ran: Ran, module_store: EpochStore,
                                                                 spark: Any, tmp_path: Path) -> None:
    def tree(root: Path) -> dict[str, tuple[int, int]]:
        return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()}

    root = Path(ran.layout.fs.uri_of(ran.layout.snapshots_dir).removeprefix("file://")).parent
    before = tree(root)
    df = read_state(module_store, ran.pipeline_id, ran.epochs[-1], "counts", spark=spark, operator_id=0,
                    scratch_uri=str(tmp_path))
    assert tree(root) == before
    assert list(tmp_path.iterdir()) == []  # the scratch checkpoint is gone; the rows were materialised before
    assert df.count() > 0


# ----------------------------------------------------------------------------------------- refusals (no Spark)


def test_refusals_name_the_problem(ran: Ran, module_store: EpochStore) -> None:
    with pytest.raises(UnknownPipelineError):
        resolve_state(module_store, "no-such-pipeline", 1, "counts")
    with pytest.raises(UnknownEpochError):
        resolve_state(module_store, ran.pipeline_id, 10_000, "counts")
    with pytest.raises(NotFoundError, match="no stage 'nope'.*its stages are"):
        resolve_state(module_store, ran.pipeline_id, ran.epochs[-1], "nope")
    with pytest.raises(ConfigurationError, match="'events'.*holds no state.*stateful stages: counts"):
        resolve_state(module_store, ran.pipeline_id, ran.epochs[-1], "events")


@pytest.fixture(scope="module")
def unusable(module_store: EpochStore) -> str:
    """A pipeline whose epoch 1 cut its stage before batch 0, epoch 2 was pruned, epoch 4 is in flight."""
    pid = f"unusable-{uuid.uuid4().hex[:6]}"
    running(module_store, pid, stages=["counts"])
    policy = CheckpointPolicy(interval=3600, timeout=3600)
    for n in (1, 2, 3):
        assert module_store.trigger_tick(pid, policy, force=True).started is not None
        module_store.record_snapshot(pid, n, "counts", [SnapshotEntry("metadata", f"sha256/00/{n:064d}", 45)])
        module_store.ack_epoch(pid, n, "counts", details={"batch_id": -1 if n == 1 else 0})
    run = module_store.acquire_cleanup_lock(pid, "test")
    module_store.begin_prune(pid, run.id, [2])
    module_store.finish_prune(pid, run.id, {2: 0})
    module_store.release_cleanup_lock(pid, run.id)
    assert module_store.trigger_tick(pid, policy, force=True).started is not None
    return pid


@pytest.mark.parametrize(("epoch", "message"), [
    (1, "had not run a micro-batch.*batch -1.*no state yet; read a later epoch"),
    (2, "was pruned by retention.*pin"),
    (4, "is triggered, not completed.*read a completed epoch"),
])
def test_refusals_of_epochs_without_readable_state(unusable: str, module_store: EpochStore, epoch: int,
                                                   message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        resolve_state(module_store, unusable, epoch, "counts")


# ----------------------------------------------------------------------------------------- the CLI


def cli(*argv: str) -> tuple[int, str, str]:
    out, err = StringIO(), StringIO()
    code = main(list(argv), stdout=out, stderr=err)
    return code, out.getvalue(), err.getvalue()


def test_cli_prints_an_epochs_state_and_a_diff(ran: Ran, module_store: EpochStore, spark: Any) -> None:
    n, m = ran.epochs[-1], ran.epochs[0]
    counts = ("state", ran.pipeline_id, "--epoch", str(n), "--stage", "counts", "--operator",
              str(ran.operators["count"]))
    code, out, err = cli("--dsn", module_store.dsn, *counts, "--json")
    assert code == EXIT_OK, err
    rows = json.loads(out)
    assert {r["key"]["key"]: r["value"]["count"] for r in rows} == expected_counts(ran.layout, n)

    code, out, err = cli("--dsn", module_store.dsn, *counts, "--limit", "2")
    assert code == EXIT_OK, err
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["KEY", "VALUE", "PARTITION"] and len(lines) == 1 + 2 + 1, out
    assert f"{len(expected_counts(ran.layout, n))} rows" in lines[-1]

    code, out, err = cli("--dsn", module_store.dsn, *counts, "--diff", str(m), "--json")
    assert code == EXIT_OK, err
    result = json.loads(out)
    old, new = expected_counts(ran.layout, m), expected_counts(ran.layout, n)
    assert result["counts"]["changed"] == sum(1 for k in old.keys() & new.keys() if old[k] != new[k])
    assert result["counts"]["added"] == len(new.keys() - old.keys())


def test_cli_refusals(ran: Ran, module_store: EpochStore, spark: Any) -> None:
    base = ("--dsn", module_store.dsn, "state", ran.pipeline_id, "--epoch", str(ran.epochs[-1]), "--stage")
    code, _, err = cli(*base, "events")
    assert code == EXIT_BAD_INPUT and "holds no state" in err and "counts" in err, err
    # two stateful operators: the refusal names both, with Spark's names for them
    code, _, err = cli(*base, "counts")
    assert code == EXIT_BAD_INPUT and "several stateful operators" in err, err
    assert all(f"{i} (" in err for i in ran.operators.values()) and "dedup" in err.lower(), err
    code, _, err = cli(*base, "counts", "--operator", "7")
    assert code == EXIT_BAD_INPUT and "has no stateful operator 7" in err, err
