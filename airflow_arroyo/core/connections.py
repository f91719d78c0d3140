"""Airflow connection -> PostgreSQL DSN, in one place and without Airflow.

The hook (:func:`airflow_arroyo.hooks.arroyo.dsn_from_connection`, from a ``Connection``) and the PostgreSQL
sink in a Spark driver (:meth:`airflow_arroyo.runtime.sinks.postgres.PostgresTarget.resolve_dsn`, from the
``AIRFLOW_CONN_<ID>`` variable Airflow exports, where Airflow is not installed) both build their DSN here, so a
connection's libpq options (``sslmode``, ``sslrootcert``, ``connect_timeout``...) reach the database on either
path. The DSN is a ``postgresql://`` URI (what the store's redaction and the CLI's checks read).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any
from urllib.parse import parse_qsl, quote, urlencode

import psycopg2
from psycopg2.extensions import parse_dsn

from airflow_arroyo.core.exceptions import ConfigurationError

__all__ = ["LIBPQ_EXTRAS", "UNSUPPORTED_EXTRAS", "dsn_from_env_value", "extra_of", "postgres_dsn"]

log = logging.getLogger(__name__)

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
# Extras of Airflow's Postgres connection that cannot be honoured here: refuse rather than ignore.
UNSUPPORTED_EXTRAS = frozenset({"iam", "aws_conn_id", "azure_conn_id", "redshift", "cluster-identifier"})


def extra_of(conn_id: str | None, conn_type: str | None, extra: str | Mapping[str, Any] | None) -> dict[str, Any]:
    """A connection's extra as a dict: its JSON text parsed (Airflow's form prefix ``extra__<type>__``
    dropped, empty fields left out). Raises :class:`ConfigurationError` for text that is not a JSON object."""
    if not extra:
        return {}
    if isinstance(extra, str):
        try:
            value = json.loads(extra)
        except ValueError as exc:
            raise ConfigurationError(
                f"the extra of connection {conn_id!r} is not valid JSON; write it as an object, "
                'e.g. {"sslmode": "require"}'
            ) from exc
    else:
        value = dict(extra)
    if not isinstance(value, dict):
        raise ConfigurationError(f"the extra of connection {conn_id!r} must be a JSON object")
    prefix = f"extra__{(conn_type or '').lower()}__"
    return {(k[len(prefix):] if k.startswith(prefix) else k): v for k, v in value.items() if v not in (None, "")}


def postgres_dsn(conn_id: str | None, *, host: str | None, port: int | str | None, schema: str | None,
                 login: str | None, password: str | None, extra: Mapping[str, Any]) -> str:
    """A ``postgresql://`` URI from a connection's fields, its libpq extras as query parameters."""
    bad = sorted(k for k in extra if k in UNSUPPORTED_EXTRAS)
    if bad:
        raise ConfigurationError(
            f"connection {conn_id!r} asks for {', '.join(bad)}, which airflow-arroyo does not support; give a "
            "login and password (or a client certificate via sslcert/sslkey) instead"
        )
    ignored = sorted(k for k in extra if k not in LIBPQ_EXTRAS)
    if ignored:
        log.info("connection %s: ignoring extra keys %s (not libpq connection parameters)", conn_id,
                 ", ".join(ignored))
    userinfo = ""
    if login:
        userinfo = quote(login, safe="")
        if password:
            userinfo += ":" + quote(password, safe="")
        userinfo += "@"
    host = host or ""
    if ":" in host and not host.startswith("["):  # an IPv6 literal (a zone id's % escaped)
        host = f"[{quote(host, safe=':')}]"
    elif not host.startswith("["):  # a Unix socket folder is a path: libpq reads it percent-encoded
        host = quote(host, safe="")
    port_part = f":{int(port)}" if port else ""
    database = quote(schema or "", safe="")
    params = {k: _libpq_value(v) for k, v in sorted(extra.items()) if k in LIBPQ_EXTRAS and v is not None}
    query = f"?{urlencode(params, quote_via=quote)}" if params else ""  # libpq reads "+" as itself, not a space
    return f"postgresql://{userinfo}{host}{port_part}/{database}{query}"


def dsn_from_env_value(value: str, var: str) -> str:
    """The DSN of an ``AIRFLOW_CONN_<ID>`` value in either form Airflow exports: the connection's JSON (``host``,
    ``port``, ``schema``, ``login``, ``password``, ``extra``), built by :func:`postgres_dsn` like an Airflow
    ``Connection``; or a URI (scheme ``postgres``, ``postgresql`` or ``arroyo``), kept as written (libpq reads its
    hosts, socket paths and query parameters itself) but for Airflow's ``__extra__`` parameter, whose JSON
    becomes query parameters. Either is checked with libpq's own parser."""
    value = value.strip()
    if value.startswith("{"):
        try:
            c = json.loads(value)
        except ValueError as exc:
            raise ConfigurationError(f"{var} is not valid JSON: {exc}") from exc
        if not isinstance(c, dict):
            raise ConfigurationError(f"{var} must be a postgresql://... URI or the connection's JSON object")
        extra = extra_of(var, c.get("conn_type"), c.get("extra"))
        dsn = postgres_dsn(var, host=c.get("host"), port=c.get("port"), schema=c.get("schema"),
                           login=c.get("login"), password=c.get("password"), extra=extra)
    else:
        dsn = _uri_dsn(value, var)
    try:
        parse_dsn(dsn)
    except psycopg2.ProgrammingError as exc:
        raise ConfigurationError(f"{var} is not a connection libpq can use: {exc}".strip()) from None
    return dsn


def _uri_dsn(value: str, var: str) -> str:
    scheme, sep, rest = value.partition("://")
    if not sep or scheme.lower() not in ("postgres", "postgresql", "arroyo"):
        raise ConfigurationError(f"{var} must be a postgresql://... URI or the connection's JSON")
    head, qmark, query = rest.partition("?")
    pairs = parse_qsl(query, keep_blank_values=True)
    if not any(key == "__extra__" for key, _ in pairs):
        return f"postgresql://{rest}"
    extra: dict[str, Any] = {}
    for key, item in pairs:
        if key == "__extra__":
            extra.update(extra_of(var, None, item))
        else:
            extra[key] = item
    bad = sorted(k for k in extra if k in UNSUPPORTED_EXTRAS)
    if bad:
        raise ConfigurationError(f"connection {var} asks for {', '.join(bad)}, which airflow-arroyo does not "
                                 "support; give a login and password (or a client certificate) instead")
    params = {k: _libpq_value(v) for k, v in extra.items() if k not in UNSUPPORTED_EXTRAS}
    return f"postgresql://{head}?{urlencode(params, quote_via=quote)}" if params else f"postgresql://{head}"


def _libpq_value(value: Any) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)
