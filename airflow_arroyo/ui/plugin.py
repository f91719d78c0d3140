"""The Airflow plugin: the checkpoint monitoring app at ``/arroyo`` and a "Browse" menu entry.

Airflow loads this plugin in every process that loads plugins (api-server, scheduler, task
processes for macros...). Only the api-server mounts ``fastapi_apps``, so the app (and Airflow's
security module it imports) is built on first access to ``fastapi_apps``, not at import.
"""

from __future__ import annotations

import threading
from typing import Any
from urllib.parse import urlsplit

from airflow.plugins_manager import AirflowPlugin

from airflow_arroyo.links.pipeline import UI_ROUTE

__all__ = ["URL_PREFIX", "ArroyoPlugin"]

#: Where Airflow's api-server mounts the app (``links.pipeline`` builds the operators' extra
#: links to ``{URL_PREFIX}/pipelines/{pipeline_id}``).
URL_PREFIX = "/arroyo"


def _api_base_path() -> str:
    """The path part of ``[api] base_url`` (a deployment behind a path prefix), without a trailing slash."""
    from airflow.configuration import conf

    return urlsplit(conf.get("api", "base_url", fallback="") or "").path.rstrip("/")


class _LazyFastAPIApps:
    """A class-level attribute whose value (the mounted app) is built once, on first read.

    Works on the class and on instances: Airflow keeps entry-point and plugins-folder plugins as
    instances and provider plugins as classes.
    """

    def __init__(self) -> None:
        self._apps: list[dict[str, Any]] | None = None
        self._lock = threading.Lock()

    def __get__(self, obj: object, owner: type | None = None) -> list[dict[str, Any]]:
        if self._apps is None:
            with self._lock:
                if self._apps is None:
                    from airflow_arroyo.ui.app import create_app

                    self._apps = [{"name": "arroyo", "app": create_app(), "url_prefix": URL_PREFIX}]
        return self._apps


class ArroyoPlugin(AirflowPlugin):
    """Checkpoint monitoring for airflow-arroyo pipelines."""

    name = "airflow_arroyo"
    fastapi_apps = _LazyFastAPIApps()
    external_views = [
        {
            "name": "Arroyo checkpoints",
            "href": f"{_api_base_path()}{URL_PREFIX}/",
            "url_route": UI_ROUTE,
            "category": "browse",
            "destination": "nav",
        }
    ]
