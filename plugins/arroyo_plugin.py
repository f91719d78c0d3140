"""Airflow plugins-folder entry for airflow-arroyo's checkpoint monitoring UI (``/arroyo``).

The plugin itself is :class:`airflow_arroyo.ui.plugin.ArroyoPlugin`. An installed ``airflow-arroyo``
already registers it through its ``airflow.plugins`` entry point; exposing it here as well would make
Airflow load it twice and report "Plugin 'airflow_arroyo' already registered" as a plugin import
error. So this file exposes the plugin only where the entry point is absent (the package on
``PYTHONPATH`` without being installed, e.g. copied next to the DAGs).
"""

from __future__ import annotations

from importlib.metadata import entry_points

PLUGIN_REF = "airflow_arroyo.ui.plugin:ArroyoPlugin"

REGISTERED_BY_ENTRY_POINT = any(ep.value == PLUGIN_REF for ep in entry_points(group="airflow.plugins"))

if not REGISTERED_BY_ENTRY_POINT:
    from airflow_arroyo.ui.plugin import ArroyoPlugin

    __all__ = ["ArroyoPlugin"]
