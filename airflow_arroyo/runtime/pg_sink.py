"""Deprecated name of :mod:`airflow_arroyo.runtime.sinks.postgres` (moved in 0.2; removed in 0.3): import the targets
from :mod:`airflow_arroyo.runtime` or the module from its new place."""

import warnings

from airflow_arroyo.runtime.sinks.postgres import *  # noqa: F403
from airflow_arroyo.runtime.sinks.postgres import __all__  # noqa: F401

warnings.warn("airflow_arroyo.runtime.pg_sink moved to airflow_arroyo.runtime.sinks.postgres", DeprecationWarning,
              stacklevel=2)
