"""Supervision: restart strategies and the pure decisions over a supervised pipeline's failures.

Nothing in this module does I/O (like :mod:`airflow_arroyo.core.epochs`). The supervisor trigger
(:class:`~airflow_arroyo.triggers.supervise.PipelineSupervisorTrigger`) notices a failure, the
store records it (``arroyo_restarts``), and :func:`decide_restart` says, from the strategy and the
failures recorded so far, whether to restart and after how long. Flink's strategies, same
meaning (docs/airflow.md, "Supervision")::

    {"type": "fixed-delay", "attempts": 3, "delay": 10}
    {"type": "exponential-delay", "initial": 1, "max": 300, "multiplier": 2, "reset_after": 3600,
     "jitter": 0.1, "attempts": null}
    {"type": "failure-rate", "max_failures": 3, "interval": 300, "delay": 10}
    {"type": "none"}

A supervised chain of runs is one *lineage*: its first run's id; a restart's run id is
``<lineage>.restart<attempt>`` (:func:`restart_run_id`). Who asks "is this my run?" asks
:func:`in_lineage`, and "will this failed run come back?" asks :func:`restart_pending`; both read a
:class:`~airflow_arroyo.store.records.PipelineRecord`'s ``supervision`` / ``supervised_run``.
"""

from __future__ import annotations

import ast
import enum
import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any, Protocol, TypeVar

from airflow_arroyo.core.exceptions import ConfigurationError

__all__ = [
    "ExponentialDelay",
    "FailureRate",
    "FixedDelay",
    "NoRestart",
    "PastFailure",
    "RestartDecision",
    "RestartStrategy",
    "SupervisionState",
    "decide_restart",
    "in_lineage",
    "is_run_of",
    "lineage_of",
    "parse_strategy",
    "restart_due",
    "restart_pending",
    "restart_run_id",
    "strategy_text",
    "unrestorable_latest",
]

#: Longest backoff any strategy may ask for (a week): beyond it, give up instead.
MAX_DELAY_S = 7 * 24 * 3600.0


class SupervisionState(enum.StrEnum):
    """``arroyo_pipelines.supervision``: what the supervisor of the current lineage is doing."""
    WATCHING = "watching"  # the run is up (or starting); a failure will be decided on
    RESTARTING = "restarting"  # a failure was recorded and a restart is due
    GAVE_UP = "gave_up"  # the strategy gave up: the failed run stays failed
    ENDED = "ended"  # the pipeline stopped, or the supervisor was told to let go


@dataclass(frozen=True)
class PastFailure:
    """One failure of a lineage, as recorded: when it was noticed, and when the restart after it
    was submitted (None: no restart, or not yet)."""
    failed_at: datetime
    restarted_at: datetime | None = None


@dataclass(frozen=True)
class RestartDecision:
    """Restart after ``delay`` seconds, or give up (``reason`` says why, for the task log)."""
    restart: bool
    delay: float
    reason: str


class RestartStrategy(Protocol):
    """A restart strategy: its ``type`` name, its settings, and its decision."""

    @property
    def type(self) -> str:
        """The strategy's name, as a DAG author writes it (``"fixed-delay"``)."""
        ...

    def decide(self, failures: Sequence[PastFailure], now: datetime, salt: str) -> RestartDecision:
        """Restart or give up after the newest of ``failures`` (oldest first), at ``now`` (the store's clock);
        ``salt`` (the lineage) seeds what is random in the decision, so that deciding again repeats it."""
        ...

    def to_dict(self) -> dict[str, Any]:
        """The strategy's type and settings, as ``parse_strategy`` reads them back (stored, shown, logged)."""
        ...


def _seconds(value: object, what: str, *, allow_zero: bool = True) -> float:
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        number = math.nan
    if isinstance(value, bool) or not math.isfinite(number) or number < 0 or (number == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigurationError(f"restart strategy: {what} must be a number of seconds {bound}, got {value!r}")
    if number > MAX_DELAY_S:
        raise ConfigurationError(f"restart strategy: {what} must be at most {MAX_DELAY_S:g} s (a week), got {value!r}")
    return number


def _ascii_digits(text: str) -> bool:
    return text.isascii() and text.isdecimal()


def _count(value: object, what: str, *, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)) or not _ascii_digits(str(value).strip()):
        raise ConfigurationError(f"restart strategy: {what} must be a whole number >= {minimum}, got {value!r}")
    number = int(str(value).strip())
    if number < minimum:
        raise ConfigurationError(f"restart strategy: {what} must be a whole number >= {minimum}, got {value!r}")
    return number


@dataclass(frozen=True)
class NoRestart:
    """Never restart: the first failure fails the task (supervision still reports it)."""
    type: str = "none"

    def decide(self, failures: Sequence[PastFailure], now: datetime,  # noqa: ARG002 - the protocol's signature
               salt: str) -> RestartDecision:  # noqa: ARG002 - the protocol's signature
        """Give up, always."""
        return RestartDecision(False, 0.0, "the restart strategy is 'none'")

    def to_dict(self) -> dict[str, Any]:
        """``{"type": "none"}``."""
        return {"type": self.type}


@dataclass(frozen=True)
class FixedDelay:
    """Flink's fixed-delay: restart up to ``attempts`` times in all, ``delay`` seconds after each failure."""
    attempts: int = 3
    delay: float = 10.0
    type: str = "fixed-delay"

    def __post_init__(self) -> None:
        object.__setattr__(self, "attempts", _count(self.attempts, "attempts"))
        object.__setattr__(self, "delay", _seconds(self.delay, "delay"))

    def decide(self, failures: Sequence[PastFailure], now: datetime,  # noqa: ARG002 - the protocol's signature
               salt: str) -> RestartDecision:  # noqa: ARG002 - the protocol's signature
        """Restart after ``delay`` while the lineage failed at most ``attempts`` + 1 times, then give up."""
        if len(failures) > self.attempts:
            return RestartDecision(False, 0.0, f"{len(failures)} failures, more than the {self.attempts} restart(s) "
                                               "fixed-delay allows")
        return RestartDecision(True, self.delay, f"restart {len(failures)} of {self.attempts} (fixed-delay)")

    def to_dict(self) -> dict[str, Any]:
        """The type and every setting."""
        return asdict(self)


@dataclass(frozen=True)
class ExponentialDelay:
    """Flink's exponential-delay: the k-th failure since the backoff was last reset waits
    ``min(initial * multiplier**(k-1), max)`` seconds, +- ``jitter`` of it. A run that stayed up
    ``reset_after`` seconds resets the backoff (and the attempt count). ``attempts``: restarts allowed
    before a reset (None: unbounded, Flink's default)."""
    initial: float = 1.0
    max: float = 300.0
    multiplier: float = 2.0
    reset_after: float = 3600.0
    jitter: float = 0.1
    attempts: int | None = None
    type: str = "exponential-delay"

    def __post_init__(self) -> None:
        object.__setattr__(self, "initial", _seconds(self.initial, "initial", allow_zero=False))
        object.__setattr__(self, "max", _seconds(self.max, "max", allow_zero=False))
        object.__setattr__(self, "reset_after", _seconds(self.reset_after, "reset_after", allow_zero=False))
        try:
            multiplier, jitter = float(self.multiplier), float(self.jitter)
        except (TypeError, ValueError):
            multiplier = jitter = math.nan
        if not (math.isfinite(multiplier) and multiplier >= 1):
            raise ConfigurationError(f"restart strategy: multiplier must be a number >= 1, got {self.multiplier!r}")
        if not (math.isfinite(jitter) and 0 <= jitter <= 1):
            raise ConfigurationError(
                f"restart strategy: jitter must be a fraction between 0 and 1, got {self.jitter!r}")
        object.__setattr__(self, "multiplier", multiplier)
        object.__setattr__(self, "jitter", jitter)
        if self.max < self.initial:
            raise ConfigurationError(f"restart strategy: max ({self.max:g} s) is below initial ({self.initial:g} s)")
        if self.attempts is not None:
            object.__setattr__(self, "attempts", _count(self.attempts, "attempts"))

    def decide(self, failures: Sequence[PastFailure], now: datetime,  # noqa: ARG002 - the protocol's signature
               salt: str) -> RestartDecision:
        """Back off exponentially over the failures since the last reset; give up beyond ``attempts`` of them."""
        # Failures since the last reset: walk back while the run before each failure was up for less
        # than reset_after (from the restart before it to it).
        streak = 1
        for earlier, later in zip(reversed(failures[:-1]), reversed(failures[1:]), strict=True):
            up_since = earlier.restarted_at
            if up_since is None or (later.failed_at - up_since).total_seconds() >= self.reset_after:
                break
            streak += 1
        if self.attempts is not None and streak > self.attempts:
            return RestartDecision(False, 0.0, f"{streak} failures in a row (none up {self.reset_after:g} s), more "
                                               f"than the {self.attempts} restart(s) exponential-delay allows")
        base = min(self.initial * self.multiplier ** min(streak - 1, 1000), self.max)
        # Deterministic jitter in [-jitter, +jitter] of the backoff, from the lineage and attempt: the
        # same failure gets the same delay when a restarted triggerer decides again.
        unit = int.from_bytes(hashlib.sha256(f"{salt}:{len(failures)}".encode()).digest()[:8], "big") / 2**64
        delay = min(max(base * (1 + self.jitter * (2 * unit - 1)), 0.0), self.max)
        return RestartDecision(True, delay, f"failure {streak} in a row: backoff {delay:.1f} s (exponential-delay)")

    def to_dict(self) -> dict[str, Any]:
        """The type and every setting."""
        return asdict(self)


@dataclass(frozen=True)
class FailureRate:
    """Flink's failure-rate: restart ``delay`` seconds after a failure unless more than
    ``max_failures`` failures happened within the last ``interval`` seconds (this one included)."""
    max_failures: int = 3
    interval: float = 300.0
    delay: float = 10.0
    type: str = "failure-rate"

    def __post_init__(self) -> None:
        object.__setattr__(self, "max_failures", _count(self.max_failures, "max_failures", minimum=1))
        object.__setattr__(self, "interval", _seconds(self.interval, "interval", allow_zero=False))
        object.__setattr__(self, "delay", _seconds(self.delay, "delay"))

    def decide(self, failures: Sequence[PastFailure], now: datetime,
               salt: str) -> RestartDecision:  # noqa: ARG002 - the protocol's signature
        """Restart after ``delay`` unless more than ``max_failures`` failures fell within ``interval`` of ``now``."""
        recent = sum(1 for f in failures if (now - f.failed_at).total_seconds() <= self.interval)
        if recent > self.max_failures:
            return RestartDecision(False, 0.0, f"{recent} failures within {self.interval:g} s, more than the "
                                               f"{self.max_failures} failure-rate allows")
        return RestartDecision(True, self.delay, f"{recent} of {self.max_failures} failures within "
                                                 f"{self.interval:g} s (failure-rate)")

    def to_dict(self) -> dict[str, Any]:
        """The type and every setting."""
        return asdict(self)


_STRATEGIES: dict[str, type[Any]] = {
    "none": NoRestart, "fixed-delay": FixedDelay, "exponential-delay": ExponentialDelay, "failure-rate": FailureRate,
}


def parse_strategy(value: RestartStrategy | Mapping[str, Any] | str | None) -> RestartStrategy | None:
    """A strategy from what a DAG author wrote: a strategy object, a dict with ``type`` and its settings
    (templated values arrive as strings; a whole templated dict as its JSON or repr), a bare type name
    (its defaults), or None / "" / "none"... (``"none"`` is supervision that never restarts)."""
    if value is None or value == "":
        return None
    if isinstance(value, (NoRestart, FixedDelay, ExponentialDelay, FailureRate)):
        return value
    settings: dict[str, Any]
    if isinstance(value, str) and value.strip().startswith("{"):  # a rendered template: JSON or a dict's repr
        text = value.strip()
        try:
            value = json.loads(text)
        except ValueError:
            try:
                value = ast.literal_eval(text)
            except (ValueError, SyntaxError):
                raise ConfigurationError(f"restart_strategy {text!r} is neither JSON nor a dict") from None
    if isinstance(value, str):
        settings = {"type": value}
    elif isinstance(value, Mapping):
        settings = dict(value)
    else:
        raise ConfigurationError(f"restart_strategy must be a dict such as {{'type': 'fixed-delay', 'attempts': 3, "
                                 f"'delay': 10}} or a strategy name, got {value!r}")
    kind = str(settings.pop("type", "")).strip().lower().replace("_", "-")
    cls = _STRATEGIES.get(kind)
    if cls is None:
        raise ConfigurationError(f"restart strategy type {kind!r} is unknown; use one of {', '.join(_STRATEGIES)}")
    allowed = {name for name in cls.__dataclass_fields__ if name != "type"}
    unknown = sorted(set(settings) - allowed)
    if unknown:
        raise ConfigurationError(f"restart strategy {kind!r} has no setting {', '.join(map(repr, unknown))}; "
                                 f"its settings are {', '.join(sorted(allowed)) or 'none'}")
    if kind == "exponential-delay" and settings.get("attempts") in ("", "None", "none", "null"):
        settings["attempts"] = None
    strategy: RestartStrategy = cls(**settings)
    return strategy


def decide_restart(strategy: RestartStrategy, failures: Sequence[PastFailure], now: datetime,
                   *, lineage: str = "", stop_requested: bool = False) -> RestartDecision:
    """Restart or give up after the newest of ``failures`` (oldest first; the newest is the one just
    noticed). A run that failed while a stop was requested is not restarted: the stop wins."""
    if not failures:
        raise ValueError("decide_restart needs the failure to decide on")
    if stop_requested:
        return RestartDecision(False, 0.0, "a stop was requested: a run that fails while stopping is not restarted")
    return strategy.decide(failures, now, lineage)


def unrestorable_latest(epoch: int, reason: str) -> RestartDecision:
    """The decision when the latest completed epoch, which a restart restores, was proved unrestorable: give
    up, whatever the strategy says (every restart would fail the same way), naming the epoch and the way out."""
    return RestartDecision(False, 0.0, (
        f"not restarted: the latest completed epoch {epoch}, which a restart restores, cannot be restored "
        f"({reason}); restore an earlier epoch with restore_from=<n> (airflow-arroyo epochs lists them)"))


def restart_run_id(lineage: str, attempt: int) -> str:
    """The run id of restart ``attempt`` of a lineage."""
    return f"{lineage}.restart{attempt}"


def is_run_of(run_id: str, lineage: str | None) -> bool:
    """Whether ``run_id`` is ``lineage``'s first run or one of its restarts."""
    if not lineage:
        return False
    rest = run_id[len(lineage):]
    return run_id.startswith(lineage) and (rest == "" or (rest.startswith(".restart") and _ascii_digits(rest[8:])))


class _Supervised(Protocol):
    @property
    def run_id(self) -> str | None: ...

    @property
    def supervised_run(self) -> str | None: ...

    @property
    def supervision(self) -> str | None: ...


def lineage_of(record: _Supervised) -> str | None:
    """The lineage of the pipeline's current run: its supervised lineage if the run belongs to it,
    else the run itself."""
    if record.run_id is not None and is_run_of(record.run_id, record.supervised_run):
        return record.supervised_run
    return record.run_id


def in_lineage(record: _Supervised, run_id: str | None) -> bool:
    """Whether the pipeline's current run is ``run_id`` or a restart of it (its supervised lineage)."""
    if run_id is None:
        return True
    return record.run_id is not None and is_run_of(record.run_id, run_id)


def restart_pending(record: _Supervised) -> bool:
    """Whether a supervisor is watching the current run: if it failed, it is coming back (until the
    supervisor records that it gave up)."""
    return record.supervision in (SupervisionState.WATCHING.value, SupervisionState.RESTARTING.value)


class _Restart(Protocol):
    @property
    def lineage(self) -> str: ...

    @property
    def new_run_id(self) -> str | None: ...

    @property
    def gave_up(self) -> bool: ...


_R = TypeVar("_R", bound=_Restart)


def restart_due(record: _Supervised, restarts: Sequence[_R]) -> _R | None:
    """Of a pipeline's recorded failures (``restarts``, newest first, e.g. ``EpochStore.restarts``), the one
    whose restart is due: the newest of the supervised lineage while its supervisor is restarting it (not
    resubmitted yet). None when no restart is due."""
    if record.supervision != SupervisionState.RESTARTING.value:
        return None
    newest = next((r for r in restarts if r.lineage == record.supervised_run), None)
    if newest is None or newest.new_run_id is not None or newest.gave_up:
        return None
    return newest


def _span(seconds: float) -> str:
    """``10`` -> ``"10s"``, ``300`` -> ``"5m"``, ``3600`` -> ``"1h"``, ``90`` -> ``"90s"``."""
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds / size:g}{unit}"
    return f"{seconds:g}s"


def _restarts(n: int) -> str:
    return f"{n} restart" if n == 1 else f"{n} restarts"


def strategy_text(strategy: Mapping[str, Any] | None) -> str:
    """A restart strategy as recorded (``arroyo_pipelines.restart_strategy``, a strategy's dict) in words,
    for the UI and the CLI: ``{"type": "fixed-delay", "attempts": 3, "delay": 10}`` -> ``"fixed-delay:
    up to 3 restarts, 10s after each failure"``. A dict this release cannot read is shown as its settings."""
    if not strategy:
        return "-"
    try:
        parsed = parse_strategy(strategy)
    except (ConfigurationError, TypeError, ValueError):
        parsed = None
    if isinstance(parsed, NoRestart):
        return "none: never restart"
    if isinstance(parsed, FixedDelay):
        return f"fixed-delay: up to {_restarts(parsed.attempts)}, {_span(parsed.delay)} after each failure"
    if isinstance(parsed, FailureRate):
        return (f"failure-rate: restart {_span(parsed.delay)} after a failure unless more than "
                f"{parsed.max_failures} failures within {_span(parsed.interval)}")
    if isinstance(parsed, ExponentialDelay):
        limit = "no limit on restarts" if parsed.attempts is None else f"up to {_restarts(parsed.attempts)} in a row"
        return (f"exponential-delay: backoff {_span(parsed.initial)}, x{parsed.multiplier:g} after each failure, "
                f"at most {_span(parsed.max)} (+-{parsed.jitter:.0%} jitter), reset once a run stays up "
                f"{_span(parsed.reset_after)}; {limit}")
    settings = ", ".join(f"{k}={v}" for k, v in sorted(strategy.items()) if k != "type")
    return f"{strategy.get('type', '?')}" + (f": {settings}" if settings else "")
