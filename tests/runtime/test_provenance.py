"""Provenance per epoch (airflow_arroyo.core.provenance) on real Spark: a JSON file source -> an exactly-once Parquet
file sink, run through several epochs with one input file written after each completed epoch. Each epoch's file range
must equal the files whose rows the source stage wrote to its channel between the previous completed epoch's
barrier and its own (the channel, not Spark's offset log), consecutive ranges must tile, and every committed sink
file must map back to the epoch whose commit covered it, its rows all from that epoch's part of the channel."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from io import StringIO
from pathlib import Path
from typing import Any

import pytest

from airflow_arroyo.cli import EXIT_BAD_INPUT, EXIT_OK, main
from airflow_arroyo.core.epochs import EpochState
from airflow_arroyo.core.exceptions import ConfigurationError, NotFoundError, StoreError
from airflow_arroyo.core.provenance import epoch_of_file, epoch_of_table_version, epoch_provenance
from airflow_arroyo.runtime.channel import Channel
from airflow_arroyo.runtime.driver import PipelineDriver
from airflow_arroyo.runtime.layout import StorageLayout
from airflow_arroyo.runtime.pipeline import Pipeline
from airflow_arroyo.runtime.sinks.files import committed_files
from airflow_arroyo.store import EpochStore
from airflow_arroyo.testing import committed_rows, run_until

pytestmark = [pytest.mark.spark, pytest.mark.slow]

FILES, ROWS_PER_FILE = 4, 5


def pipeline(pipeline_id: str, inbox: Path, out: Path) -> Pipeline:
    def events(spark: Any) -> Any:
        return spark.readStream.schema("id LONG, file INT").option("maxFilesPerTrigger", 1).json(str(inbox))

    p = Pipeline(pipeline_id, chaining=False)
    src = p.source("events", events)
    p.sink("out", [src], format="parquet", options={"path": str(out)})
    return p


@dataclass
class Ran:
    pipeline_id: str
    layout: StorageLayout
    inbox: Path
    out: Path
    epochs: list[int]  # completed epochs, ascending


def write_file(inbox: Path, k: int) -> None:
    rows = "".join(json.dumps({"id": k * ROWS_PER_FILE + i, "file": k}) + "\n" for i in range(ROWS_PER_FILE))
    tmp = inbox.parent / f".{k}.tmp"
    tmp.write_text(rows)
    tmp.rename(inbox / f"{k:03d}.json")  # whole, or not there, when Spark lists the folder


@pytest.fixture(scope="module")
def ran(spark: Any, module_store: EpochStore, tmp_path_factory: pytest.TempPathFactory) -> Ran:
    pid = f"prov-{uuid.uuid4().hex[:8]}"
    root = tmp_path_factory.mktemp("prov")
    storage, inbox, out = root / "storage", root / "inbox", root / "out"
    inbox.mkdir()
    driver = PipelineDriver(pipeline(pid, inbox, out), module_store, storage_uri=str(storage), run_id="r1",
                            spark=spark)
    written = [0]

    def completed() -> int:
        return sum(e.state is EpochState.COMPLETED for e in module_store.list_epochs(pid))

    def done() -> bool:
        # one more input file after each completed epoch, so that the files spread over several epochs
        if written[0] < FILES and completed() >= written[0]:
            write_file(inbox, written[0])
            written[0] += 1
        return written[0] == FILES and len(committed_rows(out)) == FILES * ROWS_PER_FILE
    run_until(driver, module_store, done, what="every input row committed by the file sink", interval=1.0)
    epochs = sorted(e.epoch for e in module_store.list_epochs(pid) if e.state is EpochState.COMPLETED)
    return Ran(pid, StorageLayout.at(str(storage), pid), inbox, out, epochs)


def channel_segment(layout: StorageLayout, previous: int | None, epoch: int) -> list[dict[str, Any]]:
    """The rows the events channel holds between the barriers of ``previous`` (none: the start) and ``epoch``."""
    ch = Channel.open(layout.channel_uri("events"))
    end = ch.find_barrier(epoch)
    assert end is not None, epoch
    start = 0 if previous is None else ch.find_barrier(previous)
    assert start is not None, previous
    return list(ch.read_table(start, end).to_pylist())


def test_each_epochs_files_are_those_its_rows_came_from(ran: Ran, module_store: EpochStore) -> None:
    seen: list[str] = []
    previous_end: dict[str, Any] | None = None
    nonempty = 0
    for n in ran.epochs:
        p = epoch_provenance(module_store, ran.pipeline_id, n)
        assert p.previous_epoch == (None if n == ran.epochs[0] else ran.epochs[ran.epochs.index(n) - 1])
        assert not p.previous_pruned
        stage = next(s for s in p.stages if s.stage == "events")
        assert stage.objects == len(module_store.snapshot_entries(ran.pipeline_id, n, "events")) > 0
        rows = channel_segment(ran.layout, p.previous_epoch, n)
        expected = sorted({f"{r['file']:03d}.json" for r in rows})
        if stage.batch_id is None or stage.batch_id < 0:
            assert not rows and not stage.sources, n
            continue
        (source,) = stage.sources
        assert source.files is not None
        assert sorted(Path(f).name for f in source.files) == expected, n
        # tiling: this epoch starts where the previous one with a batch ended
        assert source.start == previous_end, n
        previous_end = source.end
        seen += source.files
        nonempty += bool(source.files)
    assert nonempty >= 2, "the files did not spread over two epochs: the ranges prove little"
    assert sorted(Path(f).name for f in seen) == sorted(f.name for f in ran.inbox.iterdir())
    assert len(seen) == len(set(seen)), "a file in two epochs' ranges"


def test_every_committed_file_maps_back_to_the_epoch_that_committed_it(ran: Ran, module_store: EpochStore,
                                                                      spark: Any) -> None:
    files = committed_files(str(ran.out))
    assert files
    by_epoch: dict[int, list[str]] = {}
    checked: list[int] = []
    for name in files:
        commit = epoch_of_file(module_store, ran.pipeline_id, str(ran.out / name))
        assert commit.sink == "out"
        assert epoch_of_file(module_store, ran.pipeline_id, name).epoch == commit.epoch  # relative to the sink
        by_epoch.setdefault(commit.epoch, []).append(name)
        # the file's rows all came through the channel between that epoch's barrier and the previous one's
        previous = max((e for e in ran.epochs if e < commit.epoch), default=None)
        ids = {r["id"] for r in channel_segment(ran.layout, previous, commit.epoch)}
        got = [r["id"] for r in spark.read.parquet(str(ran.out / name)).collect()]  # an empty batch: no rows
        assert set(got) <= ids, (name, commit.epoch)
        checked += got
    assert sorted(checked) == list(range(FILES * ROWS_PER_FILE))
    # and the epochs' own view agrees: each commit's names are the files mapped to it
    for n in ran.epochs:
        sinks = epoch_provenance(module_store, ran.pipeline_id, n).sinks
        names = next((s.file_names for s in sinks if s.sink == "out"), [])
        assert sorted(names or []) == sorted(by_epoch.get(n, [])), n
    with pytest.raises(NotFoundError):
        epoch_of_file(module_store, ran.pipeline_id, str(ran.out / "000000009999-part-0.parquet"))
    with pytest.raises(ConfigurationError):
        epoch_of_file(module_store, ran.pipeline_id, str(ran.inbox / "000.json"))
    with pytest.raises(NotFoundError):
        epoch_of_table_version(module_store, ran.pipeline_id, "out", 0)  # a file sink makes no table version


def cli(*argv: str) -> tuple[int, str, str]:
    out, err = StringIO(), StringIO()
    code = main(list(argv), stdout=out, stderr=err)
    return code, out.getvalue(), err.getvalue()


def test_cli(ran: Ran, module_store: EpochStore) -> None:
    n = ran.epochs[-1]
    code, out, err = cli("--dsn", module_store.dsn, "provenance", ran.pipeline_id, "--epoch", str(n), "--json")
    assert code == EXIT_OK, err
    doc = json.loads(out)
    assert doc["epoch"] == n and {s["stage"] for s in doc["stages"]} == {"events", "out"}
    code, out, err = cli("--dsn", module_store.dsn, "provenance", ran.pipeline_id, "--epoch", str(n))
    assert code == EXIT_OK and "STAGE" in out and "events" in out, err
    name = committed_files(str(ran.out))[-1]
    code, out, err = cli("--dsn", module_store.dsn, "provenance", ran.pipeline_id, "--file", str(ran.out / name),
                         "--json")
    assert code == EXIT_OK, err
    assert json.loads(out)["epoch"] == epoch_of_file(module_store, ran.pipeline_id, name).epoch
    code, _, err = cli("--dsn", module_store.dsn, "provenance", ran.pipeline_id, "--table-version", "1")
    assert code == EXIT_BAD_INPUT and "--sink" in err
    code, _, err = cli("--dsn", module_store.dsn, "provenance", ran.pipeline_id, "--file", "nope.parquet")
    assert code == EXIT_BAD_INPUT and "file sink" in err


# --------------------------------------------------------------------------- the UI, in Airflow's api-server app

@pytest.fixture(scope="module")
def ui(airflow_db: str, module_store: EpochStore) -> Iterator[Any]:
    """Airflow's own api-server app with our plugin mounted at /arroyo, reading this module's store, and a client
    signed in as a viewer."""
    from airflow.api_fastapi.app import create_app, purge_cached_app
    from fastapi.testclient import TestClient

    from tests.ui.conftest import make_token, mounted_arroyo_app

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AIRFLOW_CONN_ARROYO_DEFAULT", module_store.dsn)
        app = create_app()
        source = mounted_arroyo_app(app).state.arroyo_source
        source.reset()
        try:
            with TestClient(app) as c:
                c.headers["Authorization"] = f"Bearer {make_token('viewer_vera', 'viewer')}"
                yield c
        finally:
            source.reset()
            purge_cached_app()


def test_the_ui_shows_each_epochs_provenance_as_the_use_case_computes_it(ran: Ran, module_store: EpochStore,
                                                                        ui: Any) -> None:
    from fastapi.testclient import TestClient

    from tests.ui.html import parse

    base = f"/arroyo/pipelines/{ran.pipeline_id}"
    anonymous = TestClient(ui.app)
    assert anonymous.get(f"{base}/epochs/{ran.epochs[-1]}/provenance").status_code == 401
    assert anonymous.get(f"/arroyo/api/pipelines/{ran.pipeline_id}/provenance?file=x").status_code == 401
    shown_files: list[str] = []
    for n in ran.epochs:
        expected = epoch_provenance(module_store, ran.pipeline_id, n)
        api = ui.get(f"/arroyo/api/pipelines/{ran.pipeline_id}/epochs/{n}/provenance")
        assert api.status_code == 200, api.text
        assert api.json() == json.loads(json.dumps(expected.as_dict())), n
        epoch_page = parse(ui.get(f"{base}/epochs/{n}").text)
        assert epoch_page.find("a", id="provenance-link").attrs["href"] == f"{base}/epochs/{n}/provenance"
        page = ui.get(f"{base}/epochs/{n}/provenance")
        assert page.status_code == 200, page.text
        doc = parse(page.text)
        inputs = [li.text() for li in doc.find("table", id="inputs").find_all("li", **{"class": "source-file"})]
        assert inputs == [f for s in expected.stages for r in s.sources for f in (r.files or [])], n
        sinks = [s for s in expected.sinks if s.sink == "out"]
        if sinks:
            names = [li.text() for li in doc.find("table", id="commits").find_all("li", **{"class": "sink-file"})]
            assert names == (sinks[0].file_names or []), n
            shown_files += names
        else:
            doc.find("p", id="no-commits")
    # every committed file was shown on exactly one epoch's page
    assert sorted(shown_files) == sorted(committed_files(str(ran.out)))

    # which epoch wrote this file: by its path and by its name in the sink's folder, as the use case answers
    for name in committed_files(str(ran.out)):
        want = epoch_of_file(module_store, ran.pipeline_id, name).epoch
        for asked in (name, str(ran.out / name)):
            doc = parse(ui.get(f"{base}/provenance", params={"file": asked}).text)
            assert doc.find("a", id="answer-epoch").attrs["data-epoch"] == str(want), asked
        assert ui.get(f"/arroyo/api/pipelines/{ran.pipeline_id}/provenance", params={"file": name}).json()[
            "epoch"] == want


def test_the_ui_refuses_what_provenance_cannot_answer_and_says_why(ran: Ran, module_store: EpochStore,
                                                                  ui: Any) -> None:
    from tests.controlplane.test_store import start
    from tests.support import running, sql
    from tests.ui.html import parse

    base = f"/arroyo/pipelines/{ran.pipeline_id}"
    missing = ui.get(f"{base}/provenance", params={"file": str(ran.out / "000000009999-part-0.parquet")})
    assert missing.status_code == 404 and "no commit" in parse(missing.text).find(id="answer").text()
    not_sink = ui.get(f"{base}/provenance", params={"file": str(ran.inbox / "000.json")})
    assert not_sink.status_code == 422 and "not a committed file" in not_sink.text
    half = ui.get(f"/arroyo/api/pipelines/{ran.pipeline_id}/provenance", params={"table_version": 1})
    assert half.status_code == 422 and "sink" in half.json()["detail"]
    no_version = ui.get(f"/arroyo/api/pipelines/{ran.pipeline_id}/provenance",
                        params={"sink": "out", "table_version": 0})
    assert no_version.status_code == 404 and "none (not a table sink)" in no_version.json()["detail"]
    assert ui.get(f"{base}/provenance").status_code == 200  # the form alone
    assert ui.get("/arroyo/pipelines/no-such-pipeline/provenance").status_code == 404
    assert ui.get(f"{base}/epochs/99999/provenance").status_code == 404
    # an epoch in flight has no cut of every stage yet: refused, naming what to ask instead
    other = f"{ran.pipeline_id}-in-flight"
    running(module_store, other, stages=["src", "out"])
    try:
        epoch = start(module_store, other)
        refused = ui.get(f"/arroyo/api/pipelines/{other}/epochs/{epoch}/provenance")
        assert refused.status_code == 409 and "not completed" in refused.json()["detail"]
        assert "airflow-arroyo epochs" in refused.json()["detail"]
    finally:
        sql(module_store, "DELETE FROM arroyo_pipelines WHERE pipeline_id = %s", (other,))


def test_record_reads_are_read_only(module_store: EpochStore) -> None:
    from airflow_arroyo.store._db import Database
    from airflow_arroyo.store.reads import RecordReads, StoreReader

    with pytest.raises(ConfigurationError, match="read-only"):
        RecordReads(Database(module_store.dsn, max_connections=1, retry_seconds=1.0, application_name="t"))
    reader = StoreReader(module_store.dsn)
    try:
        def write(cur: Any) -> None:
            cur.execute("UPDATE arroyo_pipelines SET state = state")

        with pytest.raises(StoreError, match="read-only transaction"):  # the connections refuse any write
            reader.records._pipelines._db.tx(write)
    finally:
        reader.close()
