"""airflow-arroyo: Arroyo/Flink-style checkpoint epochs for PySpark Structured Streaming, controlled by Airflow.

Layers (dependencies point one way): ``core`` (the model and the use cases, Airflow-free) <- ``store``
(PostgreSQL) <- ``runtime`` (Spark) <- ``hooks``/``operators``/``sensors``/``triggers``/``ui`` (Airflow).
Heavy modules are imported lazily by their users; this package root imports nothing heavy.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from collections.abc import Sequence
from types import ModuleType

__version__ = "0.2.0"

__all__ = ["__version__"]

#: modules moved into :mod:`airflow_arroyo.core` in 0.2; their old names import the new modules until 0.3
MOVED_TO_CORE = ("connections", "epochs", "exceptions", "fs", "gates", "processes", "provenance", "restores",
                 "retention", "scrub", "state", "stopping", "summary", "supervision", "units", "upgrades")


class _MovedToCore(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``airflow_arroyo.<name>`` of a moved module is its module in ``airflow_arroyo.core`` (the same object, so
    classes and state are shared), with a DeprecationWarning. No file stays behind at the old place."""

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        del path, target  # a moved module is found by its name alone
        head, _, name = fullname.partition(".")
        if head != __name__ or name not in MOVED_TO_CORE:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        del spec
        return None  # the default module, which exec_module replaces

    def exec_module(self, module: ModuleType) -> None:
        new = f"{__name__}.core.{module.__name__.rpartition('.')[2]}"
        warnings.warn(f"{module.__name__} moved to {new} (0.2); the old name goes in 0.3", DeprecationWarning,
                      stacklevel=2)
        # the import system returns what sys.modules holds after exec_module: the core module itself
        sys.modules[module.__name__] = importlib.import_module(new)


if not any(isinstance(f, _MovedToCore) for f in sys.meta_path):
    sys.meta_path.insert(0, _MovedToCore())
