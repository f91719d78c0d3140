"""The plugin as Airflow loads it: attributes, lazy app, the plugins-folder file, and what a running
``airflow api-server`` reports about it (``/api/v2/plugins``, no plugin import errors)."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.ui.conftest import REPO, ApiServer

pytestmark = pytest.mark.airflow


def test_plugin_declares_the_app_and_a_browse_menu_entry() -> None:
    from airflow_arroyo.ui.plugin import URL_PREFIX, ArroyoPlugin

    assert ArroyoPlugin.name == "airflow_arroyo"
    (view,) = ArroyoPlugin.external_views
    assert view["category"] == "browse" and view["url_route"] == "arroyo"
    assert view["href"].endswith(f"{URL_PREFIX}/") and view["destination"] == "nav"
    (app,) = ArroyoPlugin.fastapi_apps
    assert app["url_prefix"] == URL_PREFIX == "/arroyo"
    # built once: the class (provider plugins) and instances (entry point, plugins folder) share it
    assert ArroyoPlugin().fastapi_apps[0]["app"] is app["app"]


def test_importing_the_plugin_builds_nothing() -> None:
    """Every Airflow process that loads plugins imports this module; only the api-server needs the app."""
    code = (
        "import sys\n"
        "from airflow_arroyo.ui.plugin import ArroyoPlugin\n"
        "heavy = ['airflow.api_fastapi.core_api.security', 'airflow_arroyo.ui.app', 'psycopg2.pool']\n"
        "print('MODULES', sorted(m for m in heavy if m in sys.modules))\n"
        "ArroyoPlugin.fastapi_apps\n"
        "print('MODULES', sorted(m for m in heavy if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300)
    before, after = [line.removeprefix("MODULES ") for line in out.stdout.splitlines() if line.startswith("MODULES ")]
    assert before == "[]"
    assert "airflow.api_fastapi.core_api.security" in after and "airflow_arroyo.ui.app" in after


def test_the_entry_point_names_the_plugin_class() -> None:
    eps = [ep for ep in importlib.metadata.entry_points(group="airflow.plugins") if ep.name == "airflow_arroyo"]
    assert [ep.value for ep in eps] == ["airflow_arroyo.ui.plugin:ArroyoPlugin"]
    from airflow_arroyo.ui.plugin import ArroyoPlugin

    assert eps[0].load() is ArroyoPlugin


def _load_plugins_folder(folder: Path) -> tuple[list[Any], dict[str, str]]:
    from airflow._shared.plugins_manager import _load_plugins_from_plugin_directory

    return _load_plugins_from_plugin_directory(plugins_folder=str(folder))


def test_plugins_folder_file_defers_to_the_entry_point() -> None:
    """Installed package: the entry point registers the plugin, so the folder file must not (Airflow
    would report "already registered" as a plugin import error)."""
    plugins, errors = _load_plugins_folder(REPO / "plugins")
    assert errors == {}
    assert [p for p in plugins if p.name == "airflow_arroyo"] == []


def test_plugins_folder_file_exposes_the_plugin_without_the_entry_point(monkeypatch: pytest.MonkeyPatch) -> None:
    """Package only on PYTHONPATH (no entry point): the folder file is what brings the plugin in."""
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda **_: [])
    plugins, errors = _load_plugins_folder(REPO / "plugins")
    assert errors == {}
    assert [type(p).__name__ for p in plugins if p.name == "airflow_arroyo"] == ["ArroyoPlugin"]


def test_a_running_api_server_lists_the_plugin_once_and_no_import_error(api_server: ApiServer) -> None:
    token = api_server.token()
    plugins = api_server.get_json("/api/v2/plugins", token)["plugins"]
    ours = [p for p in plugins if p["name"] == "airflow_arroyo"]
    assert len(ours) == 1, [p["name"] for p in plugins]
    (view,) = ours[0]["external_views"]
    assert view["name"] == "Arroyo checkpoints" and view["category"] == "browse"
    assert view["href"] == "/arroyo/"
    assert [a["url_prefix"] for a in ours[0]["fastapi_apps"]] == ["/arroyo"]
    errors = api_server.get_json("/api/v2/plugins/importErrors", token)
    assert errors["total_entries"] == 0, errors


def test_a_running_api_server_refuses_anonymous_and_serves_its_own_tokens(api_server: ApiServer) -> None:
    import urllib.error

    with pytest.raises(urllib.error.HTTPError) as refused:
        api_server.get_json("/arroyo/api/pipelines")
    assert refused.value.code == 401
    body = api_server.get_json("/arroyo/api/pipelines", api_server.token())
    assert [p["pipeline"]["pipeline_id"] for p in body["pipelines"]] == ["clicks", "fresh", "orders", "payments",
                                                                         "sessions"]
