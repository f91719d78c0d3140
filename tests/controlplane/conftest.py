"""Fixtures of the control-plane tests.

``pg_server`` is overridden here: pytest's temporary folders are private (mode 0700) to the user
running the tests, and when that user is root the server runs as the ``postgres`` user, which then
cannot enter them. The server gets its own folder under the system temp dir instead (which
:class:`ThrowawayPostgres` makes reachable and removes afterwards).
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
