"""A run that failed before its driver registered it (a failed submit, ``EpochStore.fail_run``) shows on the UI's
pages as the pipeline's failed run with its cause, though it has no stages."""

from __future__ import annotations

from typing import Any

from airflow_arroyo.store import EpochStore


def test_a_run_that_never_registered_shows_failed_with_its_cause(client: Any, store: EpochStore) -> None:
    store.fail_run("never-registered", "r1", "cannot import module 'orders_pipelines'", never_registered=True)
    try:
        for url in ("/arroyo/", "/arroyo/pipelines/never-registered", "/arroyo/api/pipelines"):
            response = client.get(url)
            assert response.status_code == 200, (url, response.text[:2000])
        assert "cannot import module" in client.get("/arroyo/pipelines/never-registered").text
    finally:  # the module's other tests count the dataset's pipelines
        conn = store.connect()
        try:
            with conn, conn.cursor() as cur:
                cur.execute("DELETE FROM arroyo_pipelines WHERE pipeline_id = 'never-registered'")
        finally:
            conn.close()
