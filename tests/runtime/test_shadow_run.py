"""A shadow run on real Spark (issue 32, deliverable 5): a live pipeline reads half a bounded input and stops with a
final epoch, then restores it and reads the rest; a shadow forks that epoch with code that drops some ids and
changes a computed column for others; compare reports exactly the rows the change implies over the input after
the fork point, computed apart in plain Python; discard leaves the live pipeline untouched.

The same pipeline writes two PostgreSQL sinks: the rows appended to a table, and per bucket a running count and
sum upserted (Spark's update mode). Their diffs are checked window by window against what plain Python computes
from the input ids each window covered (the generator's offsets in the epochs' provenance)."""

from __future__ import annotations

import io
import json
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from airflow_arroyo.cli import main
from airflow_arroyo.core.epochs import EpochState
from airflow_arroyo.core.provenance import epoch_provenance
from airflow_arroyo.core.shadow import compare_shadow, discard_shadow, read_file_rows, shadow_pipeline, start_shadow
from airflow_arroyo.runtime.driver import PipelineDriver
from airflow_arroyo.runtime.pipeline import Pipeline
from airflow_arroyo.runtime.sinks.files import committed_files
from airflow_arroyo.runtime.sinks.postgres import PostgresTarget
from airflow_arroyo.store import EpochStore
from airflow_arroyo.testing import generator_source, run_until
from tests.support import sql

pytestmark = [pytest.mark.spark]

ROWS = 300
HALF = 150  # the live pipeline's first run reads this far and ends with a final epoch: the fork point
PG_ENV = "ARROYO_TEST_SHADOW_PG"
BUCKETS = 5


def source(total: int) -> Any:
    def read(spark: Any) -> Any:
        return generator_source(spark, total_rows=total, rows_per_second=60, partitions=1).select("id")

    return read


def calc_v1(df: Any) -> Any:
    from pyspark.sql import functions as F

    return df.select("id", (F.col("id") * 10).alias("v"))


def calc_v2(df: Any) -> Any:
    """Drops every id divisible by 11; v + 1 for ids divisible by 7."""
    from pyspark.sql import functions as F

    return df.where(F.col("id") % 11 != 0).select(
        "id", (F.col("id") * 10 + F.when(F.col("id") % 7 == 0, 1).otherwise(0)).alias("v"))


def totals(df: Any) -> Any:
    from pyspark.sql import functions as F

    return df.groupBy((F.col("id") % BUCKETS).alias("bucket")).agg(F.count("*").alias("n"), F.sum("v").alias("total"))


def code(pid: str, root: Path, calc: Any, total: int = ROWS) -> Pipeline:
    p = Pipeline(pid, chaining=False)
    src = p.source("src", source(total))
    out = p.stage("calc", calc, [src])
    p.sink("out", [out], format="json", options={"path": str(root / "out")})
    p.sink("rows_pg", [out], postgres=PostgresTarget(table="rows_t", dsn_env=PG_ENV, mode="append"))
    p.sink("totals_pg", [out], transform=totals, output_mode="update",
           postgres=PostgresTarget(table="totals_t", dsn_env=PG_ENV, mode="upsert", key=("bucket",)))
    return p


def v1(i: int) -> int:
    return i * 10


def v2(i: int) -> int | None:
    """calc_v2 in plain Python: None for a dropped id."""
    return None if i % 11 == 0 else i * 10 + (1 if i % 7 == 0 else 0)


def expected_totals(ids: range, v: Any) -> dict[int, tuple[int, int]]:
    out: dict[int, tuple[int, int]] = {}
    for i in ids:
        if (x := v(i)) is not None:
            n, t = out.get(i % BUCKETS, (0, 0))
            out[i % BUCKETS] = (n + 1, t + x)
    return out


def keyed_counts(live: dict[Any, Any], shadow: dict[Any, Any], keys: set[Any]) -> dict[str, int]:
    """added / removed / changed over ``keys`` between two key -> row maps, and each side's rows."""
    return {"added": sum(1 for k in keys if k in shadow and k not in live),
            "removed": sum(1 for k in keys if k in live and k not in shadow),
            "changed": sum(1 for k in keys if k in live and k in shadow and live[k] != shadow[k]),
            "live_rows": sum(1 for k in keys if k in live), "shadow_rows": sum(1 for k in keys if k in shadow)}


def next_id(store: EpochStore, pid: str, epoch: int) -> int:
    """The generator's offset at ``epoch``'s cut: the next id it would read."""
    src = next(st for st in epoch_provenance(store, pid, epoch).stages if st.stage == "src")
    end = src.sources[0].end
    return int(end["id"]) if end else 0


def _rows(path: Path) -> list[dict[str, Any]]:
    return read_file_rows(str(path), committed_files(str(path)), "json")


def test_a_shadow_reports_exactly_the_rows_its_code_changes_and_discard_leaves_the_live_pipeline(
        spark: Any, module_store: EpochStore, tmp_path: Path, pg_server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    pid, sid = f"live-{uuid.uuid4().hex[:6]}", f"shadow-{uuid.uuid4().hex[:6]}"
    target = pg_server.create_database(f"shadow_{uuid.uuid4().hex[:10]}")
    monkeypatch.setenv(PG_ENV, target)
    sql(target, "CREATE TABLE rows_t (id bigint NOT NULL, v bigint NOT NULL)")
    sql(target, "CREATE TABLE totals_t (bucket bigint PRIMARY KEY, n bigint NOT NULL, total bigint NOT NULL)")
    live_storage, shadow_storage = tmp_path / "live-storage", tmp_path / "shadow-storage"

    def live_output(n: int) -> Callable[[], bool]:
        return lambda: len(_rows(tmp_path / "out")) >= n and sql(target, "SELECT count(*) FROM rows_t")[0][0] >= n

    # the first run reads half the input and stops with a final epoch (a fork point whatever the machine's pace),
    # the second restores it and reads the rest
    run_until(PipelineDriver(code(pid, tmp_path, calc_v1, HALF), module_store, storage_uri=str(live_storage),
                             spark=spark), module_store, live_output(HALF), what="the live output's first half",
              interval=1.0)
    fork_point = module_store.list_epochs(pid, limit=1, states=[EpochState.COMPLETED])[0].epoch
    fork_end = next_id(module_store, pid, fork_point)  # HALF, or less if the final epoch did not complete
    assert fork_end <= HALF
    run_until(PipelineDriver(code(pid, tmp_path, calc_v1), module_store, storage_uri=str(live_storage), spark=spark,
                             restore_from="latest"), module_store, live_output(ROWS), what="the live output",
              interval=1.0)
    through = max((c.batch_id for c in module_store.sink_commits(pid, sink="out") if c.epoch <= fork_point),
                  default=None)
    before_fork = set() if through is None else {
        r["id"] for r in read_file_rows(str(tmp_path / "out"), committed_files(str(tmp_path / "out"), through), "json")}
    after = sorted(r["id"] for r in _rows(tmp_path / "out") if r["id"] not in before_fork)
    assert after == list(range(fork_end, ROWS)), "the file sink's output after the fork: the input's"
    live_before = module_store.get_pipeline(pid)

    record = start_shadow(module_store, pid, fork_point, sid, "tests.runtime.test_shadow_run:v2",
                          pipeline=code(pid, tmp_path, calc_v2))
    rows_shadow, totals_shadow = record.sinks["rows_pg"]["shadow"], record.sinks["totals_pg"]["shadow"]
    for live_table, table in (("rows_t", rows_shadow), ("totals_t", totals_shadow)):
        sql(target, f"CREATE TABLE {table} (LIKE {live_table} INCLUDING ALL)")
    shadow_out = Path(f"{tmp_path / 'out'}.shadow-{sid}")
    expected_shadow = [i for i in after if i % 11 != 0]
    shadow = PipelineDriver(shadow_pipeline(code(pid, tmp_path, calc_v2), sid), module_store,
                            storage_uri=str(shadow_storage), spark=spark, restore_from="latest")
    run_until(shadow, module_store, lambda: len(_rows(shadow_out)) >= len(expected_shadow) and
              sql(target, f"SELECT count(*) FROM {rows_shadow}")[0][0] >= len(expected_shadow),  # noqa: S608
              what="the shadow output", interval=1.0)
    assert sorted(r["id"] for r in _rows(shadow_out)) == expected_shadow
    assert len(_rows(tmp_path / "out")) == ROWS  # the live sink was never written by the shadow

    report = compare_shadow(module_store, sid, key={"out": ["id"]})
    diffs = [d for d in report["diffs"] if d["sink"] == "out"]
    assert diffs and all(d["closed"] for d in diffs), diffs
    total = {k: sum(d[k] for d in diffs) for k in ("added", "removed", "changed", "live_rows", "shadow_rows")}
    assert total == {"added": 0, "removed": sum(1 for i in after if i % 11 == 0),
                     "changed": sum(1 for i in after if i % 7 == 0 and i % 11 != 0),
                     "live_rows": len(after), "shadow_rows": len(expected_shadow)}

    # PostgreSQL sinks, window by window: each window's input ids from the generator's offsets at its cuts
    counts = ("added", "removed", "changed", "live_rows", "shadow_rows")
    keyed = compare_shadow(module_store, sid, key={"rows_pg": ["id"]})
    for sink in ("rows_pg", "totals_pg"):
        got = [d for d in report["diffs"] if d["sink"] == sink]
        assert [(d["live_epochs"], d["shadow_epochs"]) for d in got] == [
            (d["live_epochs"], d["shadow_epochs"]) for d in diffs], got
        assert all(d["closed"] and "added" in d for d in got), got
    start, seen = fork_end, []
    rows_by_key = [d for d in keyed["diffs"] if d["sink"] == "rows_pg"]
    for rows_d, keyed_d, totals_d in zip([d for d in report["diffs"] if d["sink"] == "rows_pg"], rows_by_key,
                                         [d for d in report["diffs"] if d["sink"] == "totals_pg"], strict=True):
        end = next_id(module_store, pid, rows_d["live_epochs"][-1])
        window = range(start, end)
        seen += window
        lv = {(i, v1(i)) for i in window}
        sv = {(i, v2(i)) for i in window if v2(i) is not None}
        assert {k: rows_d[k] for k in counts} == {"added": len(sv - lv), "removed": len(lv - sv), "changed": 0,
                                                   "live_rows": len(lv), "shadow_rows": len(sv)}, rows_d
        assert {k: keyed_d[k] for k in counts} == keyed_counts(dict(lv), dict(sv), {i for i in window}), keyed_d
        # upsert: every bucket either side wrote, its row at each side's cut; a bucket the shadow has not written
        # since the fork holds the live row at the fork point
        live_at = expected_totals(range(end), v1)
        shadow_at = {**expected_totals(range(fork_end), v1),
                     **{b: t for b, t in expected_totals(range(end), lambda i: v1(i) if i < fork_end else v2(i)).items()
                        if any(v2(i) is not None and i % BUCKETS == b for i in range(fork_end, end))}}
        touched = {i % BUCKETS for i in window}
        assert {k: totals_d[k] for k in counts} == keyed_counts(live_at, shadow_at, touched), totals_d
        start = end
    assert seen == after, "the windows cover exactly the input after the fork point"
    assert any(d["changed"] for d in report["diffs"] if d["sink"] == "totals_pg"), "a test that cannot fail"

    # the CLI prints each PostgreSQL sink's window; --json is the same report
    out = io.StringIO()
    assert main(["shadow", "compare", sid, "--dsn", module_store.dsn, "--key", "out=id"], stdout=out) == 0
    printed = [line.split() for line in out.getvalue().splitlines()]
    columns = ("live_rows", "shadow_rows", "added", "removed", "changed")  # the table's last five, no note
    for d in (d for d in report["diffs"] if d["sink"] in ("rows_pg", "totals_pg")):
        line = [d["sink"], *(str(d[k]) for k in columns)]
        assert any(cols[:1] + cols[-5:] == line for cols in printed), (line, out.getvalue())
    out = io.StringIO()
    assert main(["shadow", "compare", sid, "--dsn", module_store.dsn, "--key", "out=id", "--json"], stdout=out) == 0
    assert json.loads(out.getvalue())["diffs"] == json.loads(json.dumps(report["diffs"], default=str))

    # the UI compares through a read-only connection: the same answer
    from airflow_arroyo.store.reads import StoreReader

    reader = StoreReader(module_store.dsn)
    try:
        assert compare_shadow(reader.records, sid, key={"out": ["id"]}) == report  # type: ignore[arg-type]
        assert [s.shadow_id for s in reader.records.shadows_of(pid)] == [sid]
    finally:
        reader.close()

    discard_shadow(module_store, sid)
    assert module_store.get_shadow(sid).state == "discarded"
    assert module_store.get_epoch(pid, fork_point).pin_label is None
    now = module_store.get_pipeline(pid)
    assert (now.state, now.run_id, now.last_epoch) == (live_before.state, live_before.run_id, live_before.last_epoch)
    assert len(_rows(tmp_path / "out")) == ROWS
