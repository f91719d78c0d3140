"""Where the UI's store comes from: the ``arroyo_default`` connection through the hook, resolved
lazily, cached for a while, the pool replaced when the DSN changes."""

from __future__ import annotations

import pytest

from airflow_arroyo.core.exceptions import ConfigurationError
from airflow_arroyo.ui.store_source import StoreSource, resolve_dsn


class FakeQueries:
    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.closed = False

    def close(self) -> None:
        self.closed = True


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_resolves_lazily_caches_and_follows_a_changed_dsn() -> None:
    dsn = {"value": "postgresql://a/db1"}
    calls: list[str] = []

    def resolve() -> str:
        calls.append(dsn["value"])
        return dsn["value"]

    clock = Clock()
    source = StoreSource(resolve, ttl_s=60, factory=FakeQueries, clock=clock)  # type: ignore[arg-type]
    assert calls == []  # nothing at construction
    first = source.get()
    assert first.dsn == "postgresql://a/db1" and calls == ["postgresql://a/db1"]
    clock.t = 59
    assert source.get() is first and len(calls) == 1  # cached
    clock.t = 61
    assert source.get() is first and len(calls) == 2  # re-resolved, same DSN: same pool
    dsn["value"] = "postgresql://a/db2"
    clock.t = 200
    second = source.get()
    assert second is not first and second.dsn == "postgresql://a/db2" and first.closed
    source.reset()
    assert second.closed
    assert source.get() is not second


def test_not_configured_raises_configuration_error_and_is_retried_next_time() -> None:
    attempts = {"n": 0}

    def resolve() -> str:
        attempts["n"] += 1
        if attempts["n"] == 1:
            raise ConfigurationError("no connection")
        return "postgresql://a/db"

    source = StoreSource(resolve, factory=FakeQueries)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError):
        source.get()
    assert source.get().dsn == "postgresql://a/db"


def test_resolve_dsn_reads_the_airflow_connection(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIRFLOW_CONN_ARROYO_DEFAULT", "postgresql://ui:s%40cret@db.example:5433/arroyo?sslmode=require")
    dsn = resolve_dsn()
    assert dsn.startswith("postgresql://ui:s%40cret@db.example:5433/arroyo")
    assert "sslmode=require" in dsn


def test_resolve_dsn_without_a_connection_says_what_to_create(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AIRFLOW_CONN_ARROYO_UI_MISSING", raising=False)
    with pytest.raises(ConfigurationError, match="arroyo_ui_missing.*AIRFLOW_CONN_ARROYO_UI_MISSING"):
        resolve_dsn("arroyo_ui_missing")


def test_the_writer_is_made_on_first_use_on_the_readers_dsn_and_closed_with_them() -> None:
    dsn = {"value": "postgresql://a/db1"}
    clock = Clock()
    source = StoreSource(lambda: dsn["value"], ttl_s=60, factory=FakeQueries,  # type: ignore[arg-type]
                         writer_factory=FakeQueries, clock=clock)  # type: ignore[arg-type]
    first = source.writer()
    assert first.dsn == "postgresql://a/db1" and source.writer() is first
    dsn["value"] = "postgresql://a/db2"
    clock.t = 200
    second = source.writer()  # the connection changed: a writer on the new DSN, the old one closed
    assert second.dsn == "postgresql://a/db2" and first.closed and not second.closed
    source.reset()
    assert second.closed
