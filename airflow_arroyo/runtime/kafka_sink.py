"""Deprecated name of :mod:`airflow_arroyo.runtime.sinks.kafka` (moved in 0.2; removed in 0.3): import the targets
from :mod:`airflow_arroyo.runtime` or the module from its new place."""

import warnings

from airflow_arroyo.runtime.sinks.kafka import *  # noqa: F403
from airflow_arroyo.runtime.sinks.kafka import __all__  # noqa: F401

warnings.warn("airflow_arroyo.runtime.kafka_sink moved to airflow_arroyo.runtime.sinks.kafka", DeprecationWarning,
              stacklevel=2)
