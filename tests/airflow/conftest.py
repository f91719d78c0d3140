"""Fixtures of the Airflow-side tests.

``pg_server`` is overridden as in ``tests/controlplane``: pytest's temporary folders are private
(mode 0700), and when the tests run as root the server runs as ``postgres``, which cannot enter
them. The server gets its own folder under the system temp dir instead.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from airflow_arroyo.devtools.postgres import ThrowawayPostgres


@pytest.fixture(scope="session")
def pg_server() -> Iterator[ThrowawayPostgres]:
    pg = ThrowawayPostgres()
    pg.start()
    try:
        yield pg
    finally:
        pg.cleanup()
