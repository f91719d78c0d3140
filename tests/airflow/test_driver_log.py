"""The driver's log on the worker host stays bounded (issue 30, finding 6 d): spark-submit's output goes through a
size-rotating writer that keeps the last N files (``<run>.log``, ``<run>.log.1`` ...), the readers of the current
file (``log_tail``) keep working, and the provider's drivers print no console progress bars (the noise)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from airflow_arroyo.operators.pipeline import SubmitPipelineOperator
from airflow_arroyo.triggers.pipeline import log_tail

PID = "orders"
LINES = [f"driver line {n:05d} " + "x" * 40 for n in range(3000)]  # ~160 kB


def _op(tmp_path: Path, **kwargs: Any) -> SubmitPipelineOperator:
    return SubmitPipelineOperator(task_id="submit", pipeline=f"pkg.pipes:{PID}", pipeline_id=PID,
                                  submit_log_dir=str(tmp_path), **kwargs)


def test_the_driver_log_rotates_by_size_and_keeps_the_last_files(tmp_path: Path) -> None:
    op = _op(tmp_path, driver_log_max_bytes=16 * 1024, driver_log_backups=3)
    producer = "import sys\nfor line in sys.argv[1:]:\n    print(line, flush=True)\n"
    _, path = op.start_detached([sys.executable, "-c", producer, *LINES], {"PATH": "/usr/bin:/bin"}, "r1")
    assert op._popen is not None and op._popen.wait(60) == 0
    # what a trigger does once spark-submit exited: its last line is there, written or waited for
    assert log_tail(str(path), 1, settle=30) == LINES[-1]
    assert op._log_writer is not None and op._log_writer.wait(60) == 0  # it ends with spark-submit's output
    files = sorted(p.name for p in path.parent.iterdir() if p.name.startswith("r1.log") and p.suffix != ".writer")
    assert files == ["r1.log", "r1.log.1", "r1.log.2", "r1.log.3"]
    for name in files:
        assert (path.parent / name).stat().st_size <= 16 * 1024, name
    kept = "".join((path.parent / n).read_text() for n in ["r1.log.3", "r1.log.2", "r1.log.1", "r1.log"])
    lines = kept.splitlines()
    assert lines == LINES[-len(lines):], "rotation lost, split or reordered lines"  # whole lines, the newest
    assert 3 * 16 * 1024 < len(kept) <= 4 * 16 * 1024
    # the readers of the current file: its last lines, and across a rotation that just happened
    assert log_tail(str(path), 5).splitlines() == LINES[-5:]
    (path.parent / "r1.log.1").write_text("a\nb\nc\n")
    path.write_text("d\n")  # as if the writer had just rotated
    assert log_tail(str(path), 3).splitlines() == ["b", "c", "d"]

def test_the_providers_drivers_print_no_console_progress_bars(monkeypatch: pytest.MonkeyPatch,
                                                              tmp_path: Path) -> None:
    """Spark's console progress bars (``[Stage 3:=>  (12 + 2) / 200]``, redrawn every 200 ms of every stage that
    runs over half a second) are noise in a log file: off for every driver the operator submits, unless asked for."""
    for master in ("local[2]", "spark://10.0.0.5:7077", "yarn"):
        monkeypatch.setenv("AIRFLOW_CONN_SPARK_X", json.dumps({"conn_type": "spark", "host": master}))
        command, *_ = _op(tmp_path, spark_conn_id="spark_x").build_spark_submit("r1", None, "postgresql://a@b/c")
        confs = dict(command[i + 1].split("=", 1) for i, part in enumerate(command) if part == "--conf")
        assert confs["spark.ui.showConsoleProgress"] == "false", master
        command, *_ = _op(tmp_path, spark_conn_id="spark_x", conf={"spark.ui.showConsoleProgress": "true"}
                          ).build_spark_submit("r1", None, "postgresql://a@b/c")
        assert "spark.ui.showConsoleProgress=true" in command, master
