"""Which of Spark's checkpoint file managers a stage's query writes its checkpoint with.

On a local disk Spark's default (``FileContext``-based) manager starts processes for every file it writes
(``readlink``, ``chmod``), two files per micro-batch; the stage runner names the ``FileSystem``-based one for
its query instead (docs/runtime.md, "Channel hops"), unless the stage or the session names a manager. On S3 the
default writes a temporary object and copies it; the runner names the provider's abortable-stream manager, which
writes the final object (docs/runtime.md, "Object storage").
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from airflow_arroyo.runtime.channel import Channel
from airflow_arroyo.runtime.layout import StorageLayout
from airflow_arroyo.runtime.pipeline import StageKind, StageSpec
from airflow_arroyo.runtime.spark_checkpoint import (
    CHECKPOINT_FILE_MANAGER_CONF,
    OBJECT_STORE_CHECKPOINT_FILE_MANAGERS,
    local_checkpoint_file_manager,
    object_store_checkpoint_file_manager,
)
from airflow_arroyo.runtime.stage import StageRunner
from airflow_arroyo.testing import wait_for
from tests.runtime.conftest import S3Server, s3a_on
from tests.support import running_stage

pytestmark = [pytest.mark.spark]

SCHEMA = pa.schema([("id", pa.int64())])


@contextmanager
def started_stage(spark: Any, store: Any, root: Path, spark_conf: dict[str, str],
                  checkpoints: str | None = None) -> Iterator[StageRunner]:
    pid = f"ckpt-{uuid.uuid4().hex[:8]}"
    layout = StorageLayout.at(str(root), pid, checkpoints)
    Channel.create(layout.channel_uri("a"), SCHEMA).append_table(pa.table({"id": [1, 2]}, schema=SCHEMA), 0, "up")
    store.register_pipeline(pid, stages=["copy"], run_id="r1")
    spec = StageSpec(name="copy", kind=StageKind.STAGE, fn=lambda a: a, inputs=("a",), output="copy",
                     spark_conf=spark_conf)
    with running_stage(spark, store, layout, spec) as runner:
        yield runner


def managers(runner: StageRunner) -> set[str]:
    """The classes writing the query's offsets and commits logs."""
    assert runner.query is not None
    execution = runner.query._jsq.streamingQuery()
    return {str(log.fileManager().getClass().getName()) for log in (execution.offsetLog(), execution.commitLog())}


def test_a_local_checkpoint_is_written_through_hadoop_filesystem(spark: Any, store: Any, tmp_path: Path) -> None:
    expected = local_checkpoint_file_manager(spark)
    assert expected is not None and expected.endswith(".FileSystemBasedCheckpointFileManager")
    with started_stage(spark, store, tmp_path, {}) as runner:
        assert managers(runner) == {expected}
        assert spark.conf.get(CHECKPOINT_FILE_MANAGER_CONF, None) is None  # for that query only
        assert runner.output is not None
        out = runner.output
        wait_for(lambda: Channel.open(out.uri).read_table().num_rows == 2, timeout=180, what="the rows copied")
        wait_for(lambda: (runner.layout.checkpoint_fs.exists(f"{runner.checkpoint}/commits/0")), timeout=60,
                 what="batch 0's commit")


def test_a_manager_the_stage_names_is_kept(spark: Any, store: Any, tmp_path: Path) -> None:
    default = local_checkpoint_file_manager(spark)
    assert default is not None
    named = default.replace(".FileSystemBasedCheckpointFileManager", ".FileContextBasedCheckpointFileManager")
    with started_stage(spark, store, tmp_path, {CHECKPOINT_FILE_MANAGER_CONF: named}) as runner:
        assert managers(runner) == {named}


def test_a_checkpoint_on_s3_is_written_straight_to_its_objects(spark: Any, store: Any, tmp_path: Path, bucket: str,
                                                                s3_server: S3Server) -> None:
    """Channels on a local disk, the checkpoint on S3 (moto): the query writes its logs through the provider's
    abortable-stream manager, for that query only, and leaves no temporary object."""
    assert object_store_checkpoint_file_manager(spark) == OBJECT_STORE_CHECKPOINT_FILE_MANAGERS[0]
    with s3a_on(spark, s3_server, bucket), started_stage(spark, store, tmp_path, {}, f"{bucket}/ckpts") as runner:
        assert runner.checkpoint_uri.startswith("s3a://")
        assert managers(runner) == {OBJECT_STORE_CHECKPOINT_FILE_MANAGERS[0]}
        assert spark.conf.get(CHECKPOINT_FILE_MANAGER_CONF, None) is None
        wait_for(lambda: runner.layout.checkpoint_fs.exists(f"{runner.checkpoint}/commits/0"), timeout=120,
                 what="batch 0's commit on S3")
        keys = s3_server.keys(f"{bucket}/ckpts")
        assert any(k.endswith("/offsets/0") for k in keys) and not [k for k in keys if k.endswith(".tmp")], keys
