"""FileSystem: local and fsspec backends, atomic writes, exclusive creation under a real race."""

from __future__ import annotations

import multiprocessing as mp
import pickle
import uuid
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
import pytest

from airflow_arroyo.core.exceptions import ConfigurationError
from airflow_arroyo.core.fs import FileSystem, arrow_uri


@pytest.fixture(params=["local", "file-uri", "memory"])
def fs(request: pytest.FixtureRequest, tmp_path: Path) -> FileSystem:
    if request.param == "local":
        return FileSystem.from_uri(str(tmp_path / "root"))
    if request.param == "file-uri":
        return FileSystem.from_uri(f"file://{tmp_path}/root")
    return FileSystem.from_uri(f"memory://arroyo-test-{uuid.uuid4().hex}/root")


def test_write_read_list_delete(fs: FileSystem) -> None:
    assert not fs.exists("a/b.json")
    fs.write_bytes_atomic("a/b.json", b'{"x": 1}')
    fs.write_json_atomic("a/c.json", {"y": 2})
    assert fs.exists("a/b.json") and fs.is_dir("a") and not fs.is_dir("a/b.json")
    assert fs.read_bytes("a/b.json") == b'{"x": 1}'
    assert fs.read_json("a/c.json") == {"y": 2}
    assert fs.size("a/b.json") == 8
    fs.write_bytes_atomic("a/b.json", b"replaced")
    assert fs.read_bytes("a/b.json") == b"replaced"

    with fs.open_output("d/e/f.bin") as out:
        out.write(b"streamed")
    with fs.open_input("d/e/f.bin") as inp:
        assert inp.read() == b"streamed"
    fs.copy_file("d/e/f.bin", "g/copy.bin")
    assert fs.read_bytes("g/copy.bin") == b"streamed"

    assert [e.name for e in fs.list_dir("")] == ["a", "d", "g"]
    assert [(e.path, e.size) for e in fs.list_files("a")] == [("a/b.json", 8), ("a/c.json", 8)]
    assert [e.path for e in fs.list_files("")] == ["a/b.json", "a/c.json", "d/e/f.bin", "g/copy.bin"]
    assert fs.list_dir("missing") == [] and fs.list_files("missing") == []

    assert fs.delete("a/b.json") is True
    assert fs.delete("a/b.json") is False
    fs.delete_tree("d")
    fs.delete_tree("d")  # missing is fine
    assert [e.path for e in fs.list_files("")] == ["a/c.json", "g/copy.bin"]
    with pytest.raises(FileNotFoundError):
        fs.read_bytes("a/b.json")
    with pytest.raises(FileNotFoundError):
        fs.size("a/b.json")


def test_create_exclusive_only_once(fs: FileSystem) -> None:
    assert fs.create_exclusive("log/0.json", b"first") is True
    assert fs.create_exclusive("log/0.json", b"second") is False
    assert fs.read_bytes("log/0.json") == b"first"
    # no temporary files are left next to the target
    assert [e.name for e in fs.list_dir("log")] == ["0.json"]


def test_child_and_uris(fs: FileSystem) -> None:
    child = fs.child("sub/dir")
    child.write_bytes_atomic("x", b"1")
    assert fs.read_bytes("sub/dir/x") == b"1"
    assert child.uri == fs.uri_of("sub/dir")
    assert FileSystem.join("a/", "/b", "", "c") == "a/b/c"
    with pytest.raises(ConfigurationError):
        fs.read_bytes("../escape")
    with pytest.raises(ConfigurationError):
        fs.delete_tree("")


def test_local_uris_and_pickle(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    rel = FileSystem.from_uri("rel/dir")
    assert rel.uri == f"file://{tmp_path}/rel/dir" and rel.is_local
    rel.write_bytes_atomic("f", b"z")
    same = FileSystem.from_uri(f"file://{tmp_path}/rel/dir")
    assert same.read_bytes("f") == b"z"
    clone = pickle.loads(pickle.dumps(rel))
    assert clone.uri == rel.uri and clone.read_bytes("f") == b"z"
    assert rel.spark_uri_of("f") == f"file://{tmp_path}/rel/dir/f"


def test_hadoop_s3_spellings_are_understood() -> None:
    assert arrow_uri("s3a://bucket/ck/offsets") == "s3://bucket/ck/offsets"
    assert arrow_uri("S3N://bucket/x") == "s3://bucket/x"
    assert arrow_uri("gs://bucket/x") == "gs://bucket/x"
    assert arrow_uri("/local/path") == "/local/path"


def test_spark_uri_maps_s3_scheme() -> None:
    # Constructed directly: no network access is needed to test the spelling.
    import pyarrow.fs as pafs

    fs = FileSystem("s3://bucket/prefix", pafs.LocalFileSystem(), "/nonexistent")
    assert fs.spark_uri_of("data/x.parquet") == "s3a://bucket/prefix/data/x.parquet"


def test_unknown_scheme_is_a_configuration_error() -> None:
    with pytest.raises(ConfigurationError, match="no filesystem backend"):
        FileSystem.from_uri("nosuchscheme-arroyo://x/y")
    with pytest.raises(ConfigurationError):
        FileSystem.from_uri("")


# ---------------------------------------------------------------------- real races between processes
def _race_create(root: str, rounds: int, barrier: mp.synchronize.Barrier, results: mp.Queue) -> None:
    fs = FileSystem.from_uri(root)
    for round_ in range(rounds):
        barrier.wait()
        results.put((round_, fs.create_exclusive(f"entry-{round_}", uuid.uuid4().hex.encode())))


def test_create_exclusive_race_between_processes(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    n, rounds = 4, 5
    barrier = ctx.Barrier(n)
    results: mp.Queue = ctx.Queue()
    procs = [ctx.Process(target=_race_create, args=(str(tmp_path), rounds, barrier, results)) for _ in range(n)]
    for p in procs:
        p.start()
    outcomes = [results.get(timeout=120) for _ in range(n * rounds)]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    for round_ in range(rounds):
        assert sorted(won for r, won in outcomes if r == round_) == [False] * (n - 1) + [True]
        assert len((tmp_path / f"entry-{round_}").read_bytes()) == 32
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"entry-{r}" for r in range(rounds)]


def _rewrite(root: str, rounds: int, barrier: mp.synchronize.Barrier) -> None:
    fs = FileSystem.from_uri(root)
    barrier.wait()
    for i in range(rounds):
        fs.write_bytes_atomic("value", bytes([i % 256]) * 200_000)


def test_atomic_write_is_never_seen_partial(tmp_path: Path) -> None:
    fs = FileSystem.from_uri(str(tmp_path))
    fs.write_bytes_atomic("value", b"\xff" * 200_000)
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(2)
    writer = ctx.Process(target=_rewrite, args=(str(tmp_path), 200, barrier))
    writer.start()
    barrier.wait()
    reads = 0
    while writer.is_alive() or reads == 0:
        data = fs.read_bytes("value")
        assert len(data) == 200_000 and data == data[:1] * 200_000
        reads += 1
    writer.join(timeout=60)
    assert writer.exitcode == 0
    assert [e.name for e in fs.list_dir("")] == ["value"]



class _VanishingFolder:
    """A pyarrow file system whose recursive listings fail ``fails`` times as pyarrow's local one does when a
    folder below vanishes while it is listed (another process's job commit deleting ``_temporary``)."""

    def __init__(self, real: Any, fails: int) -> None:
        self.real, self.fails = real, fails

    def get_file_info(self, what: Any) -> Any:
        if isinstance(what, pafs.FileSelector) and what.recursive and self.fails:
            self.fails -= 1
            raise FileNotFoundError(f"[Errno 2] Cannot list directory '{what.base_dir}/_temporary/0/_temporary'")
        return self.real.get_file_info(what)


@pytest.mark.parametrize("fails", [1, FileSystem.LIST_ATTEMPTS])
def test_a_folder_vanishing_below_a_listing_is_listed_again_never_answered_empty(tmp_path: Path, fails: int) -> None:
    """A sink's commit lists its folder while Spark writes the next batch below it: a listing that met a
    vanishing folder (as pyarrow raises it) was answered with an empty list, from which the commit would write
    manifests naming no files. It is taken again (this fails on the old code); a folder that keeps failing
    raises, and a folder that is itself gone lists as empty."""
    real = FileSystem.from_uri(str(tmp_path))
    files = {f"data/part-{i}.parquet" for i in range(3)}
    for name in files:
        real.write_bytes_atomic(name, b"x")
    flaky = FileSystem(real.uri, _VanishingFolder(real.arrow_fs, fails), real.arrow_path(""))
    if fails < FileSystem.LIST_ATTEMPTS:
        assert {e.path for e in flaky.list_files()} == files
    else:
        with pytest.raises(FileNotFoundError, match="Cannot list directory"):
            flaky.list_files()
    gone = FileSystem(real.uri, _VanishingFolder(real.arrow_fs, 1), real.arrow_path("missing"))
    assert gone.list_files() == []
