"""The Airflow hook of the epoch store.

Connection: type ``arroyo`` (its own form in the UI), or any ``postgres`` connection. Both carry
host, port, schema (the database), login, password and libpq options in ``extra`` (``sslmode``,
``sslrootcert``, ``connect_timeout``...). A URI works too, e.g. in the environment::

    AIRFLOW_CONN_ARROYO_DEFAULT='postgresql://arroyo:secret@db.example:5432/arroyo?sslmode=require'

The hook turns the connection into a DSN and hands out the store: :meth:`ArroyoHook.get_store`
(sync, for operators and DAG code) and :meth:`ArroyoHook.aget_store` (async, for triggers: the
connection is read with ``aget_connection`` and every store call runs in a worker thread). Stores are
shared per DSN and process, so that hundreds of triggers in one triggerer share one small
connection pool, and the schema is migrated (idempotently) the first time a process uses a DSN.
Retries are the store's: transient failures retried with bounded backoff, permanent ones raised
at once as :class:`~airflow_arroyo.exceptions.StoreError`. The password never reaches a log line.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, urlencode

from airflow.sdk import BaseHook

from airflow_arroyo import config
from airflow_arroyo.exceptions import ArroyoError, ConfigurationError
from airflow_arroyo.store import AsyncEpochStore, EpochStore, redact_dsn

if TYPE_CHECKING:
    from airflow.sdk import Connection

__all__ = ["ArroyoHook", "dsn_from_connection"]

log = logging.getLogger(__name__)

ACCEPTED_CONN_TYPES = ("arroyo", "postgres", "postgresql")

# libpq connection parameters that may come from a connection's extra (passed on as they are).
LIBPQ_EXTRAS = frozenset(
    {
        "sslmode", "sslrootcert", "sslcert", "sslkey", "sslpassword", "sslcrl", "sslcrldir", "sslsni",
        "sslcompression", "ssl_min_protocol_version", "ssl_max_protocol_version", "gssencmode",
        "requiressl", "connect_timeout", "application_name", "options", "target_session_attrs",
        "keepalives", "keepalives_idle", "keepalives_interval", "keepalives_count", "tcp_user_timeout",
        "channel_binding", "krbsrvname", "service", "passfile", "hostaddr",
    }
)
# Extras of Airflow's Postgres connection that this hook cannot honour: refuse rather than ignore.
UNSUPPORTED_EXTRAS = frozenset({"iam", "aws_conn_id", "azure_conn_id", "redshift", "cluster-identifier"})


def dsn_from_connection(conn: Connection) -> str:
    """A libpq URI for an ``arroyo`` or ``postgres`` Airflow connection. Pure; raises ConfigurationError."""
    conn_type = (conn.conn_type or "").lower()
    if conn_type not in ACCEPTED_CONN_TYPES:
        raise ConfigurationError(
            f"connection {conn.conn_id!r} has type {conn.conn_type!r}; the epoch store needs an 'arroyo' "
            "or 'postgres' connection (host, port, database in 'schema', login, password)"
        )
    if not conn.host:
        raise ConfigurationError(
            f"connection {conn.conn_id!r} has no host; set it to the PostgreSQL server of the epoch store"
        )
    extra = _extra_of(conn)
    return _build_dsn(conn, extra)


def _extra_of(conn: Connection) -> dict[str, Any]:
    # Connection.extra is a JSON string; parse it without the secret masking of extra_dejson
    # (that masking talks to the supervisor synchronously, which an event loop must not do).
    import json

    if not conn.extra:
        return {}
    try:
        value = json.loads(conn.extra)
    except ValueError as exc:
        raise ConfigurationError(
            f"the extra of connection {conn.conn_id!r} is not valid JSON; write it as an object, "
            'e.g. {"sslmode": "require"}'
        ) from exc
    if not isinstance(value, dict):
        raise ConfigurationError(f"the extra of connection {conn.conn_id!r} must be a JSON object")
    # Form fields (conn-fields) may be stored with Airflow's prefix; an empty field is not a setting.
    prefix = f"extra__{(conn.conn_type or '').lower()}__"
    return {(k[len(prefix):] if k.startswith(prefix) else k): v for k, v in value.items() if v not in (None, "")}


def _build_dsn(conn: Connection, extra: Mapping[str, Any]) -> str:
    bad = sorted(k for k in extra if k in UNSUPPORTED_EXTRAS)
    if bad:
        raise ConfigurationError(
            f"connection {conn.conn_id!r} asks for {', '.join(bad)}, which the epoch store hook does not "
            "support; give a login and password (or a client certificate via sslcert/sslkey) instead"
        )
    ignored = sorted(k for k in extra if k not in LIBPQ_EXTRAS)
    if ignored:
        log.info("connection %s: ignoring extra keys %s (not libpq connection parameters)", conn.conn_id,
                 ", ".join(ignored))
    userinfo = ""
    if conn.login:
        userinfo = quote(conn.login, safe="")
        if conn.password:
            userinfo += ":" + quote(conn.password, safe="")
        userinfo += "@"
    host = conn.host or ""
    if ":" in host and not host.startswith("["):  # an IPv6 literal
        host = f"[{host}]"
    port = f":{int(conn.port)}" if conn.port else ""
    database = quote(conn.schema or "", safe="")
    params = {k: _libpq_value(v) for k, v in sorted(extra.items()) if k in LIBPQ_EXTRAS and v is not None}
    query = f"?{urlencode(params)}" if params else ""
    return f"postgresql://{userinfo}{host}{port}/{database}{query}"


def _libpq_value(value: Any) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)


# ---------------------------------------------------------------- process-wide stores

_stores: dict[tuple[str, int, float], EpochStore] = {}
_migrated: set[str] = set()
_stores_lock = threading.Lock()


def _shared_store(dsn: str, *, max_connections: int, retry_seconds: float, migrate: bool) -> EpochStore:
    """One store per (DSN, pool size, retry budget) and process; the schema migrated once per DSN."""
    key = (dsn, max_connections, retry_seconds)
    with _stores_lock:
        store = _stores.get(key)
        if store is None or store._closed:
            store = EpochStore(dsn, max_connections=max_connections, retry_seconds=retry_seconds,
                               application_name="airflow-arroyo-hook")
            _stores[key] = store
        if migrate and dsn not in _migrated:
            applied = store.migrate()
            if applied:
                log.info("epoch store %s: applied migrations %s", redact_dsn(dsn), applied)
            _migrated.add(dsn)
    return store


def _reset_shared_stores() -> None:
    """Close every shared store (tests; a process that forks)."""
    with _stores_lock:
        for store in _stores.values():
            store.close()
        _stores.clear()
        _migrated.clear()


class ArroyoHook(BaseHook):
    """The epoch store behind an Airflow connection.

    :param arroyo_conn_id: an ``arroyo`` or ``postgres`` connection (default ``[arroyo] conn_id``,
        itself ``arroyo_default`` by default).
    :param max_connections: size of the process-wide connection pool for this DSN.
    :param retry_seconds: how long transient store failures are retried before a
        :class:`~airflow_arroyo.exceptions.TransientStoreError`.
    :param migrate: apply missing schema migrations on first use (idempotent, safe concurrently).
    """

    conn_name_attr = "arroyo_conn_id"
    default_conn_name = "arroyo_default"
    conn_type = "arroyo"
    hook_name = "Arroyo epoch store"

    def __init__(self, arroyo_conn_id: str | None = None, *, max_connections: int = 8,
                 retry_seconds: float = 60.0, migrate: bool = True) -> None:
        super().__init__()
        if max_connections < 1:
            raise ConfigurationError(f"max_connections must be at least 1, got {max_connections!r}")
        if retry_seconds <= 0:
            raise ConfigurationError(f"retry_seconds must be positive, got {retry_seconds!r}")
        self.arroyo_conn_id = arroyo_conn_id or config.get("conn_id")
        self.max_connections = max_connections
        self.retry_seconds = retry_seconds
        self.migrate = migrate

    # The connection form (fields, labels, placeholders) is declared in the provider info
    # (``conn-fields`` / ``ui-field-behaviour``): ``get_ui_field_behaviour`` is deprecated since Airflow 3.2.

    # ------------------------------------------------------------------ sync

    def get_dsn(self) -> str:
        """The epoch store's DSN from the connection."""
        return dsn_from_connection(self.get_connection(self.arroyo_conn_id))

    def get_store(self) -> EpochStore:
        """The process-wide store for this connection, migrated on first use."""
        dsn = self.get_dsn()
        store = _shared_store(dsn, max_connections=self.max_connections, retry_seconds=self.retry_seconds,
                              migrate=self.migrate)
        log.debug("connection %s: epoch store %s", self.arroyo_conn_id, redact_dsn(dsn))
        return store

    def get_conn(self) -> EpochStore:
        """Airflow: the hook's client, the epoch store."""
        return self.get_store()

    def test_connection(self) -> tuple[bool, str]:
        """For the UI's "Test" button: reach the server and report the schema version."""
        try:
            dsn = self.get_dsn()
            store = EpochStore(dsn, max_connections=1, retry_seconds=min(self.retry_seconds, 5.0),
                               application_name="airflow-arroyo-test")
            try:
                version = store.check_schema(complete=False)  # the hook migrates on first use
            finally:
                store.close()
        except ArroyoError as exc:
            return False, str(exc)
        return True, f"reached the epoch store at {redact_dsn(dsn)}; schema version {version}"

    # ------------------------------------------------------------------ async (triggers)

    async def aget_dsn(self) -> str:
        """The epoch store's DSN from the connection, without blocking the event loop."""
        conn = await self.aget_connection(self.arroyo_conn_id)
        return dsn_from_connection(conn)

    async def aget_store(self) -> AsyncEpochStore:
        """The async twin of :meth:`get_store`; never blocks the event loop."""
        dsn = await self.aget_dsn()
        store = await asyncio.to_thread(_shared_store, dsn, max_connections=self.max_connections,
                                        retry_seconds=self.retry_seconds, migrate=self.migrate)
        return AsyncEpochStore(store)
