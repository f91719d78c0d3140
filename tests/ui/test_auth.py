"""Authentication of the plugin app as Airflow's api-server mounts it.

``airflow.api_fastapi.app.create_app()`` builds the real api-server app: it loads the plugins
(ours through the package's ``airflow.plugins`` entry point) and mounts ``fastapi_apps`` at their
``url_prefix``. Airflow adds no authentication to plugin apps; ours must refuse an anonymous
request on every route and serve a valid Airflow JWT, as a Bearer token or the UI's ``_token`` cookie.
"""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient

from tests.ui.conftest import make_token, mounted_arroyo_app

pytestmark = pytest.mark.airflow

# One concrete URL per route of the app (the test below checks that none is forgotten).
URLS = {
    "/": "/arroyo/",
    "/static/arroyo.css": "/arroyo/static/arroyo.css",
    "/pipelines/{pipeline_id}": "/arroyo/pipelines/orders",
    "/pipelines/{pipeline_id}/epochs/{epoch}": "/arroyo/pipelines/orders/epochs/241",
    "/pipelines/{pipeline_id}/retention": "/arroyo/pipelines/clicks/retention",
    "/api/pipelines": "/arroyo/api/pipelines",
    "/api/pipelines/{pipeline_id}": "/arroyo/api/pipelines/orders",
    "/api/pipelines/{pipeline_id}/epochs": "/arroyo/api/pipelines/orders/epochs",
    "/api/pipelines/{pipeline_id}/epochs/{epoch}": "/arroyo/api/pipelines/orders/epochs/241",
    "/api/pipelines/{pipeline_id}/retention": "/arroyo/api/pipelines/orders/retention",
    "/pipelines/{pipeline_id}/shadows": "/arroyo/pipelines/orders/shadows",
    "/api/pipelines/{pipeline_id}/shadows": "/arroyo/api/pipelines/orders/shadows",
}
# Routes whose answer on this dataset is not a 200 once signed in, and what it is: provenance needs the snapshot
# objects of a pipeline run with storage (tests/runtime/test_provenance.py has those), and a question.
ANSWERED = {
    "/pipelines/{pipeline_id}/provenance": ("/arroyo/pipelines/orders/provenance?sink=out&table_version=1", 404),
    "/pipelines/{pipeline_id}/epochs/{epoch}/provenance": ("/arroyo/pipelines/orders/epochs/241/provenance", 409),
    "/api/pipelines/{pipeline_id}/provenance": ("/arroyo/api/pipelines/orders/provenance?file=x", 422),
    "/api/pipelines/{pipeline_id}/epochs/{epoch}/provenance": (
        "/arroyo/api/pipelines/orders/epochs/241/provenance", 409),
}
# The writes (a verdict on a commit gate: tests/ui/test_gates_ui.py has the permission beyond reading).
POSTS = {
    "/pipelines/{pipeline_id}/gates/{sink}/{epoch}/verdict": "/arroyo/pipelines/orders/gates/out/1/verdict",
    "/api/pipelines/{pipeline_id}/gates/{sink}/{epoch}/verdict": "/arroyo/api/pipelines/orders/gates/out/1/verdict",
}


def test_every_route_of_the_mounted_app_is_listed_here(airflow_api: Any) -> None:
    routes = {(r.path, m) for r in mounted_arroyo_app(airflow_api).routes if isinstance(r, APIRoute) for m in r.methods}
    assert routes == {(p, "GET") for p in URLS | ANSWERED} | {(p, "POST") for p in POSTS}


@pytest.mark.parametrize("url", sorted(POSTS.values()))
def test_anonymous_writes_are_refused(anon: TestClient, url: str) -> None:
    r = anon.post(url, json={"passed": True}, headers={"Sec-Fetch-Site": "same-origin"})
    assert r.status_code == 401, (url, r.status_code, r.text[:200])


@pytest.mark.parametrize("url", sorted([*URLS.values(), *(u for u, _ in ANSWERED.values())]))
def test_anonymous_requests_are_refused(anon: TestClient, url: str) -> None:
    r = anon.get(url)
    assert r.status_code == 401, (url, r.status_code, r.text[:200])
    assert "orders" not in r.text or "/arroyo/" in r.text  # no data leaks into the refusal


@pytest.mark.parametrize("url", sorted(URLS.values()))
def test_a_bearer_token_is_served(anon: TestClient, url: str) -> None:
    r = anon.get(url, headers={"Authorization": f"Bearer {make_token('vera', 'viewer')}"})
    assert r.status_code == 200, (url, r.status_code, r.text[:300])


@pytest.mark.parametrize(("url", "status"), sorted(ANSWERED.values()))
def test_a_bearer_token_gets_the_answer_not_a_refusal(anon: TestClient, url: str, status: int) -> None:
    r = anon.get(url, headers={"Authorization": f"Bearer {make_token('vera', 'viewer')}"})
    assert r.status_code == status, (url, r.status_code, r.text[:300])


@pytest.mark.parametrize("url", ["/arroyo/", "/arroyo/pipelines/orders", "/arroyo/api/pipelines"])
def test_the_airflow_ui_cookie_is_served(airflow_api: Any, url: str) -> None:
    with TestClient(airflow_api) as c:
        c.cookies.set("_token", make_token("admin", "admin"))
        r = c.get(url)
    assert r.status_code == 200, (url, r.status_code, r.text[:300])


def test_an_invalid_or_forged_token_is_refused(anon: TestClient) -> None:
    good = make_token("admin", "admin")
    forged = good[:-4] + ("AAAA" if not good.endswith("AAAA") else "BBBB")
    for token in (forged, "not-a-jwt"):
        r = anon.get("/arroyo/api/pipelines", headers={"Authorization": f"Bearer {token}"})
        assert r.status_code in (401, 403), r.status_code
        assert "pipelines" not in r.json()


def test_a_user_without_the_plugins_view_permission_is_forbidden(anon: TestClient) -> None:
    # Simple auth manager: a user with no role may not view anything.
    r = anon.get("/arroyo/api/pipelines", headers={"Authorization": f"Bearer {make_token('nobody', None)}"})
    assert r.status_code == 403


def test_the_html_refusal_offers_the_airflow_sign_in(anon: TestClient) -> None:
    r = anon.get("/arroyo/pipelines/orders", headers={"Accept": "text/html"})
    assert r.status_code == 401
    assert r.headers["content-type"].startswith("text/html")
    assert "/auth/login" in r.text and "next=" in r.text


@pytest.mark.parametrize("url", ["/arroyo/docs", "/arroyo/redoc", "/arroyo/openapi.json"])
def test_no_docs_or_openapi_are_served(anon: TestClient, client: TestClient, url: str) -> None:
    assert anon.get(url).status_code in (401, 404)
    assert client.get(url).status_code == 404


def test_the_api_json_refusal_is_json(anon: TestClient) -> None:
    r = anon.get("/arroyo/api/pipelines/orders")
    assert r.status_code == 401
    assert r.json() == {"detail": "Not authenticated"}
