"""The storage layout: checkpoint folders behind a pointer, switched without renaming any folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from airflow_arroyo.core.exceptions import ConfigurationError
from airflow_arroyo.runtime.layout import StorageLayout, object_path


def test_checkpoint_pointer_switches_keep_one_previous_folder(tmp_path: Path) -> None:
    layout = StorageLayout.at(str(tmp_path / "storage"), "p", str(tmp_path / "ckpts"))
    first = layout.checkpoint("s")
    assert first == "p/stages/s/checkpoint"  # no pointer yet: the first folder
    assert layout.checkpoint_uri("s") == f"file://{tmp_path}/ckpts/p/stages/s/checkpoint"
    assert layout.channel_uri("c") == f"file://{tmp_path}/storage/p/channels/c"
    (tmp_path / "ckpts" / first / "commits").mkdir(parents=True)

    second = layout.new_checkpoint("s", 3)
    (tmp_path / "ckpts" / second).mkdir()
    assert layout.switch_checkpoint("s", second) == first
    assert layout.checkpoint("s") == second and (tmp_path / "ckpts" / first).is_dir()  # kept as previous
    third = layout.new_checkpoint("s", 5)
    (tmp_path / "ckpts" / third).mkdir()
    assert layout.switch_checkpoint("s", third) == second
    assert not (tmp_path / "ckpts" / first).exists()  # the previous-but-one is dropped
    assert layout.checkpoint("s") == third and (tmp_path / "ckpts" / second).is_dir()

    # what an interrupted restore left (and an old layout's staging folder) is stray; the live and the
    # previous folder never are
    (tmp_path / "ckpts" / layout.new_checkpoint("s", 7)).mkdir()
    (tmp_path / "ckpts" / "p/stages/s/checkpoint.restoring-2-abc").mkdir()
    stray = layout.stray_checkpoints("s")
    assert len(stray) == 2 and third not in stray and second not in stray
    assert not (tmp_path / "storage" / "p").exists()  # nothing of this went to the storage root


def test_bad_pointer_and_foreign_folder_are_refused(tmp_path: Path) -> None:
    layout = StorageLayout.at(str(tmp_path), "p")
    with pytest.raises(ConfigurationError, match="not a checkpoint folder of stage 's'"):
        layout.switch_checkpoint("s", "p/stages/other/checkpoint-1")
    (tmp_path / "p/stages/s").mkdir(parents=True)
    (tmp_path / "p/stages/s/checkpoint.json").write_text('["not", "a", "pointer"]')
    with pytest.raises(ConfigurationError, match="is not a checkpoint pointer"):
        layout.checkpoint("s")
    with pytest.raises(ConfigurationError, match="not a relative path"):
        object_path("p", "../../etc/passwd")
    assert object_path("p", "sha256/ab/abc") == "p/snapshots/objects/sha256/ab/abc"
