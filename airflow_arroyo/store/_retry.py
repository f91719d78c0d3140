"""One retry policy for the epoch store: transient failures retried with bounded backoff, the rest raised.

Transient: lost or refused connections (the server restarted, a network blip), serialization
failures and deadlocks, admin/crash shutdown, too many connections. Everything else is permanent.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

import psycopg2
from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    stop_after_delay,
    wait_exponential_jitter,
)

from airflow_arroyo.core.exceptions import StoreError, TransientStoreError

log = logging.getLogger(__name__)

T = TypeVar("T")

# SQLSTATE classes/codes that are worth another try.
_TRANSIENT_CODES = frozenset(
    {
        "40001",  # serialization_failure
        "40P01",  # deadlock_detected
        "55P03",  # lock_not_available
        "57P01",  # admin_shutdown
        "57P02",  # crash_shutdown
        "57P03",  # cannot_connect_now
        "53300",  # too_many_connections
        "53400",  # configuration_limit_exceeded
    }
)


# Connection-time failures carry no SQLSTATE in psycopg2; these texts mark the permanent ones
# (wrong database, user or password, bad options) so that a typo fails at once, not after a minute.
_PERMANENT_CONNECT_TEXTS = (
    "does not exist",
    "authentication failed",
    "no password supplied",
    "password authentication",
    "no pg_hba.conf entry",
    "invalid dsn",
    "invalid connection option",
    "could not translate host name",
)


def is_transient(exc: BaseException) -> bool:
    """Is ``exc`` worth retrying? The single place that decides."""
    if isinstance(exc, psycopg2.InterfaceError):  # connection already closed
        return True
    if isinstance(exc, psycopg2.Error):
        code = exc.pgcode
        if code is None:
            # No SQLSTATE: the connection broke (server gone, reset, refused) or could not be made.
            text = str(exc).lower()
            # libpq's "invalid <option> value ..." / "invalid port number": a setting, not an outage
            if text.lstrip().startswith("invalid ") or any(t in text for t in _PERMANENT_CONNECT_TEXTS):
                return False
            return isinstance(exc, psycopg2.OperationalError)
        return code in _TRANSIENT_CODES or code.startswith("08")
    return isinstance(exc, ConnectionError)


def _log_retry(state: RetryCallState) -> None:
    # One line at warning per failing call: a refused connection retries many times in its window, and
    # each later attempt says nothing new (the final failure is raised with its text).
    exc = state.outcome.exception() if state.outcome else None
    level = logging.WARNING if state.attempt_number == 1 else logging.DEBUG
    what = f"{type(exc).__name__}: {_first_line(exc)}" if exc else "unknown error"
    log.log(level, "epoch store: transient error (attempt %s), retrying: %s", state.attempt_number, what)


def retrying(max_seconds: float = 60.0, max_attempts: int = 30) -> Retrying:
    return Retrying(
        retry=retry_if_exception(is_transient),
        wait=wait_exponential_jitter(multiplier=0.05, max=2.0, jitter=0.05),
        stop=stop_after_delay(max_seconds) | stop_after_attempt(max_attempts),
        before_sleep=_log_retry,
        reraise=True,
    )


def call_with_retry(fn: Callable[[], T], *, max_seconds: float = 60.0) -> T:
    """Run ``fn`` under the policy; translate the final failure into a typed store error."""
    try:
        result: T = retrying(max_seconds)(fn)
        return result
    except psycopg2.Error as exc:
        if is_transient(exc):
            raise TransientStoreError(
                f"epoch store unreachable after retrying for up to {max_seconds}s: {type(exc).__name__}: "
                f"{_first_line(exc)}; check that PostgreSQL is up and the connection settings are right"
            ) from exc
        code = f" {exc.pgcode}" if exc.pgcode else ""
        raise StoreError(f"epoch store error{code}: {_first_line(exc)}") from exc


def _first_line(exc: BaseException) -> str:
    text: Any = str(exc).strip()
    return text.splitlines()[0] if text else f"{type(exc).__name__} (no message)"
