"""Airflow operator extra links of airflow-arroyo (import the modules directly).

``from airflow_arroyo.links import ArroyoPipelineLink`` (the 0.1 path, when this was one module) still works:
those names are looked up lazily in :mod:`airflow_arroyo.links.pipeline`, so importing this package imports
nothing.
"""

from __future__ import annotations

import importlib
from typing import Any

_MOVED = ("ArroyoPipelineLink", "SparkUILink", "XCOM_PIPELINE_ID", "XCOM_SPARK_UI_URL", "UI_MOUNT", "UI_ROUTE",
          "pipeline_page_url")


def __getattr__(name: str) -> Any:
    if name not in _MOVED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module("airflow_arroyo.links.pipeline"), name)
