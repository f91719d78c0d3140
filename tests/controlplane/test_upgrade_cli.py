"""``airflow-arroyo upgrade``: new code planned against a running pipeline, the old run stopped with a final epoch
that is pinned, and the new code started restoring it; refused before anything happens when the plan is. The
running code is the stand-in driver (tests/airflow/_fake_driver.py), a real process speaking the driver's protocol
with a real PostgreSQL store; no Spark."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from airflow_arroyo.core.epochs import EpochState, PipelineState
from airflow_arroyo.store import EpochStore
from airflow_arroyo.testing import wait_for
from tests.controlplane.test_cli import run

FAKE_DRIVER = str(Path(__file__).parents[1] / "airflow" / "_fake_driver.py")
NEW_CODE = "tests.controlplane._upgrade_code:up_cli"


@pytest.fixture
def old_run(store: EpochStore, tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """The old code running as pipeline 'up_cli', taking an epoch every 0.2 s."""
    env = {**os.environ, "ARROYO_DSN": store.dsn, "FAKE_EPOCH_INTERVAL": "0.2",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH")]))}
    with open(tmp_path / "old.log", "wb") as log:
        process = subprocess.Popen([sys.executable, FAKE_DRIVER, "--pipeline", "old:up_cli", "--run-id", "old",
                                    "--storage-uri", str(tmp_path / "storage")], stdout=log, stderr=subprocess.STDOUT,
                                   env=env)

    def epochs() -> int:
        try:
            return len(store.list_epochs("up_cli", states=[EpochState.COMPLETED]))
        except Exception:  # noqa: BLE001 - not registered yet
            return 0

    try:
        wait_for(lambda: process.poll() is not None or epochs() >= 2, timeout=60, what="two epochs of the old code")
        assert process.poll() is None, (tmp_path / "old.log").read_text()
        yield process
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(30)


def test_upgrade_stops_pins_and_starts_the_new_code_restoring_the_final_epoch(
        store: EpochStore, old_run: subprocess.Popen[bytes], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # the new code renames 'sink': without the mapping the plan is refused and the old code runs on
    code, out, err = run(capsys, "--dsn", store.dsn, "upgrade", "up_cli", "--pipeline-module", NEW_CODE)
    assert code == 2, (out, err)
    assert "step 'plan'" in err and "stage 'sink' removed" in err and "Nothing was changed" in err
    assert store.get_pipeline("up_cli").state is PipelineState.RUNNING and old_run.poll() is None

    log = tmp_path / "new.log"
    code, out, err = run(capsys, "--dsn", store.dsn, "--json", "upgrade", "up_cli", "--pipeline-module", NEW_CODE,
                         "--rename", "sink=sink_v2", "--label", "v2", "--wait", "60s", "--start",
                         "--driver", FAKE_DRIVER, "--log", str(log))
    assert code == 0, (out, err, log.read_text() if log.exists() else "")
    result = json.loads(out)
    assert old_run.wait(30) == 0  # the old code stopped by itself, after its final epoch
    pinned = store.get_epoch("up_cli", result["pinned_epoch"])
    assert (pinned.is_final, pinned.pin_label, pinned.run_id) == (True, "v2", "old")
    assert {s["stage"]: s["action"] for s in result["stages"]} == {"source": "restored", "sink_v2": "restored"}
    # chaining=False: the plan is of the queries the driver runs, known without Spark
    assert (result["physical"], result["fusion"]) == (True, "chaining=False: every stage is its own query")
    assert result["command"][-6:] == ["--restore-from", str(pinned.epoch), "--rename", "sink=sink_v2",
                                      "--storage-uri", str(tmp_path / "storage")]
    assert store.dsn not in " ".join(result["command"])  # the DSN goes through the environment
    new = store.get_pipeline("up_cli")
    assert (result["state"], result["run_id"], new.state) == ("running", new.run_id, PipelineState.RUNNING)
    assert new.run_id == result["command"][result["command"].index("--run-id") + 1]
    assert new.config["restore_from"] == str(pinned.epoch)
    store.request_stop("up_cli", "immediate")
    wait_for(lambda: store.get_pipeline("up_cli").state.terminal, timeout=30, what="the new run to stop")
