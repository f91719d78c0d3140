"""The modules that moved into ``airflow_arroyo.core`` in 0.2 keep their old names until 0.3: a DAG or a pipeline
module written against ``airflow_arroyo.gates`` (say) gets the very same module, with a DeprecationWarning, and no
file is left at the old place."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import airflow_arroyo

PACKAGE = Path(airflow_arroyo.__file__).parent


@pytest.mark.parametrize("name", airflow_arroyo.MOVED_TO_CORE)
def test_an_old_name_is_the_core_module_itself(name: str) -> None:
    assert not (PACKAGE / f"{name}.py").exists() and (PACKAGE / "core" / f"{name}.py").exists()
    core = importlib.import_module(f"airflow_arroyo.core.{name}")
    # a fresh interpreter: the warning comes with the first import of the old name
    code = (f"import warnings; warnings.simplefilter('error', DeprecationWarning)\n"
            f"try:\n    import airflow_arroyo.{name}\nexcept DeprecationWarning as w:\n    print(w)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert f"airflow_arroyo.{name} moved to airflow_arroyo.core.{name}" in out
    with pytest.warns(DeprecationWarning):
        sys.modules.pop(f"airflow_arroyo.{name}", None)
        old = importlib.import_module(f"airflow_arroyo.{name}")
    assert old is core and core.__spec__ is not None and core.__spec__.name == f"airflow_arroyo.core.{name}"


def test_names_that_did_not_move_are_not_aliased() -> None:
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("airflow_arroyo.no_such_module")


def test_a_class_keeps_one_identity_under_both_names() -> None:
    with pytest.warns(DeprecationWarning):
        sys.modules.pop("airflow_arroyo.gates", None)
        from airflow_arroyo.gates import Gate as OldGate  # type: ignore[import-not-found]
    from airflow_arroyo.core.gates import Gate

    assert OldGate is Gate
