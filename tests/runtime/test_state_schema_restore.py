"""The driver checks state schema compatibility before a restore writes anything (issue 32): new code whose
stateful stage keys its state differently is refused by name with the store, the checkpoints and the epoch as they
were; the same epoch then restores into a compatible change (a stateless filter added upstream) with its state, and
every key is emitted once over both runs (plain Python: the generator's keys)."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest

from airflow_arroyo.core.epochs import EpochState, PipelineState
from airflow_arroyo.core.exceptions import ConfigurationError, UnknownPipelineError
from airflow_arroyo.runtime.driver import PipelineDriver
from airflow_arroyo.runtime.pipeline import Pipeline
from airflow_arroyo.store import EpochStore
from airflow_arroyo.testing import CheckpointTicker, DriverThread, wait_for

from .pipeline_support import settled_files
from .test_upgrade_restore import KEYS, dedup, folder_values, source

pytestmark = [pytest.mark.spark]


def dedup_by_two_keys(df: Any) -> Any:
    from pyspark.sql import functions as F

    return df.select((F.col("id") % KEYS).alias("k"), (F.col("id") % 3).alias("j")).dropDuplicates(["k", "j"])


def dedup_after_a_filter(df: Any) -> Any:
    from pyspark.sql import functions as F

    return dedup(df.where(F.col("id") >= 0))


def tree(root: Path) -> list[tuple[str, int]]:
    return sorted((str(p), st.st_size) for p, st in settled_files(root))


def version(pid: str, root: Path, code: Any) -> Pipeline:
    p = Pipeline(pid, chaining=False)
    src = p.source("src", source)
    seen = p.stage("dedup", code, [src])
    p.sink("out", [seen], format="json", options={"path": str(root / "out")})
    return p


def test_a_changed_state_key_is_refused_before_anything_is_written_and_a_compatible_change_restores(
        spark: Any, module_store: EpochStore, tmp_path: Path) -> None:
    pid = f"schema-{uuid.uuid4().hex[:6]}"
    storage = str(tmp_path / "storage")

    def completed() -> list[int]:
        try:
            return [e.epoch for e in module_store.list_epochs(pid, states=[EpochState.COMPLETED])]
        except UnknownPipelineError:
            return []

    first = DriverThread(PipelineDriver(version(pid, tmp_path, dedup), module_store, storage_uri=storage,
                                        spark=spark)).start()
    with CheckpointTicker(module_store, pid, interval=1.0):
        wait_for(lambda: first.error or len(completed()) >= 2, timeout=240, what="two epochs of the old code")
    module_store.request_stop(pid, "graceful")
    assert first.join(240).state is PipelineState.STOPPED
    epoch = max(completed())
    before = (module_store.get_pipeline(pid).run_id, completed())
    files = tree(tmp_path / "storage")
    assert any("/state/" in f for f, _ in files)

    with pytest.raises(ConfigurationError, match=(
            r"stage 'dedup' incompatible: state changed shape since epoch \d+: state operator 0 \(dedupe\): key "
            r"schema \(k: long\) in the epoch, \(k: long, j: long\) in the new code; drop its state by name")):
        PipelineDriver(version(pid, tmp_path, dedup_by_two_keys), module_store, storage_uri=storage, spark=spark,
                       restore_from=epoch).run()
    assert (module_store.get_pipeline(pid).run_id, completed()) == before
    assert tree(tmp_path / "storage") == files  # checkpoints, channels, snapshots: nothing written

    second = DriverThread(PipelineDriver(version(pid, tmp_path, dedup_after_a_filter), module_store,
                                         storage_uri=storage, spark=spark, restore_from=epoch)).start()
    with CheckpointTicker(module_store, pid, interval=1.0):
        wait_for(lambda: second.error or len(completed()) >= len(before[1]) + 2, timeout=240,
                 what="two epochs of the new code")
    module_store.request_stop(pid, "graceful")
    result = second.join(240)
    assert result.restored_from_epoch == epoch
    # the restored state kept every key seen: none emitted twice (a lost state would emit them again)
    out = folder_values(tmp_path / "out", "k")
    assert sorted(out) == sorted(set(out)) and set(out) <= set(range(KEYS))
    assert len(out) == KEYS
