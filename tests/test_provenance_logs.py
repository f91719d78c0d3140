"""Provenance's readers of Spark's checkpoint logs, without Spark: the branches a short real run does not reach.
An offset log entry with a source that had no offset yet (``-``) and Kafka's per-partition offsets; a file source
log whose older entries Spark compacted into ``<n>.compact`` (every 10th log file by default, each entry keeping
its ``batchId``), of which only the entries in a range's log offsets count."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from airflow_arroyo.core.exceptions import ConfigurationError
from airflow_arroyo.core.fs import FileSystem
from airflow_arroyo.core.provenance import _Snapshot, parse_offset_log
from airflow_arroyo.runtime.layout import object_path
from airflow_arroyo.store import SnapshotEntry


def test_offset_log_lines_are_one_per_source() -> None:
    kafka = {"orders": {"0": 17, "1": 4}}
    text = "\n".join(["v1", json.dumps({"batchWatermarkMs": 0, "batchTimestampMs": 1}), json.dumps(kafka), "-",
                      json.dumps({"logOffset": 3})])
    assert parse_offset_log(text) == [kafka, None, {"logOffset": 3}]
    with pytest.raises(ConfigurationError):
        parse_offset_log('{"logOffset": 3}')


def test_file_source_log_ranges_read_compacted_and_single_log_files(tmp_path: Path) -> None:
    fs = FileSystem.from_uri(str(tmp_path))

    def entry(batch: int) -> str:
        return json.dumps({"path": f"file:///in/{batch:03d}.json", "timestamp": batch, "batchId": batch})

    logs = {"sources/0/9.compact": ["v1", *(entry(b) for b in range(10))],
            "sources/0/10": ["v1", entry(10)], "sources/0/11": ["v1", entry(11)]}
    entries = []
    for i, (rel, lines) in enumerate(sorted(logs.items())):
        key = f"k{i}"
        data = ("\n".join(lines) + "\n").encode()
        fs.write_bytes_atomic(object_path("p", key), data)
        entries.append(SnapshotEntry(rel, key, len(data)))
    snap = _Snapshot(fs, "p", entries)
    assert snap.source_files(0, 7, 11) == [f"file:///in/{b:03d}.json" for b in (8, 9, 10, 11)]
    assert snap.source_files(0, -1, 1) == ["file:///in/000.json", "file:///in/001.json"]
    assert snap.source_files(0, 11, 11) == []
    assert snap.source_files(1, -1, 11) == []  # another source's log
