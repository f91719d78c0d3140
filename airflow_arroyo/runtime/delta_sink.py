"""Deprecated name of :mod:`airflow_arroyo.runtime.sinks.delta` (moved in 0.2; removed in 0.3): import the targets
from :mod:`airflow_arroyo.runtime` or the module from its new place."""

import warnings

from airflow_arroyo.runtime.sinks.delta import *  # noqa: F403
from airflow_arroyo.runtime.sinks.delta import __all__  # noqa: F401

warnings.warn("airflow_arroyo.runtime.delta_sink moved to airflow_arroyo.runtime.sinks.delta", DeprecationWarning,
              stacklevel=2)
