"""Every form of an Airflow connection becomes a DSN libpq reads as the connection meant (checked with libpq's
own parser, psycopg2's parse_dsn): socket folders, IPv6 hosts with a zone, several hosts, spaces, any libpq
query parameter, Airflow's __extra__ JSON."""

from __future__ import annotations

import json

import pytest
from psycopg2.extensions import parse_dsn

from airflow_arroyo.core.connections import dsn_from_env_value, postgres_dsn
from airflow_arroyo.core.exceptions import ConfigurationError


@pytest.mark.parametrize(("uri", "expected"), [
    ("postgresql://u:p@%2Fvar%2Frun%2Fpostgresql/db", {"host": "/var/run/postgresql", "dbname": "db"}),
    ("postgres://u:p@[fe80::1%25eth0]:5432/db", {"host": "fe80::1%eth0", "port": "5432"}),
    ("postgresql://u@h1:5432,h2:5433/db?target_session_attrs=read-write",
     {"host": "h1,h2", "port": "5432,5433", "target_session_attrs": "read-write"}),
    ("postgresql:///arroyo?host=/var/run/postgresql&user=arroyo", {"host": "/var/run/postgresql", "user": "arroyo"}),
    ("arroyo://u:p%40ss@db/w?application_name=my%20app&client_encoding=utf8",
     {"password": "p@ss", "application_name": "my app", "client_encoding": "utf8"}),
    ("postgresql://u@db/w?__extra__=" + json.dumps({"sslmode": "require", "options": "-c search_path=x"}),
     {"sslmode": "require", "options": "-c search_path=x", "dbname": "w"}),
])
def test_an_environment_uri_means_to_libpq_what_it_says(uri: str, expected: dict[str, str]) -> None:
    parsed = parse_dsn(dsn_from_env_value(uri, "AIRFLOW_CONN_X"))
    assert {k: parsed.get(k) for k in expected} == expected


@pytest.mark.parametrize("host", ["/var/run/postgresql", "fe80::1%eth0", "::1", "db.example"])
def test_fields_become_a_dsn_with_every_value_intact(host: str) -> None:
    extra = {"application_name": "my app", "options": "-c search_path=x", "sslmode": "require"}
    parsed = parse_dsn(postgres_dsn("c", host=host, port=5433, schema="d b", login="u:1", password="p w+@",
                                    extra=extra))
    assert parsed == {"host": host, "port": "5433", "dbname": "d b", "user": "u:1", "password": "p w+@", **extra}


def test_the_json_form_and_its_refusals() -> None:
    value = json.dumps({"conn_type": "postgres", "host": "db", "login": "u", "schema": "w",
                        "extra": {"sslmode": "verify-full", "not_libpq": 1}})
    assert parse_dsn(dsn_from_env_value(value, "V")) == {"host": "db", "user": "u", "dbname": "w",
                                                         "sslmode": "verify-full"}
    with pytest.raises(ConfigurationError, match="asks for iam"):
        dsn_from_env_value("postgresql://u@db/w?__extra__=" + json.dumps({"iam": True}), "V")
    with pytest.raises(ConfigurationError, match="must be a postgresql"):
        dsn_from_env_value("mysql://u@db/w", "V")
    with pytest.raises(ConfigurationError, match="not a connection libpq can use"):
        dsn_from_env_value("postgresql://u@db/w?no_such_option=1", "V")
