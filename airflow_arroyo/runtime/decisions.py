"""The driver's decisions, as pure functions over facts it has already read (no Spark, no store, no I/O).

Like :func:`airflow_arroyo.core.epochs.decide_trigger`, each rule lives here once and is tested by enumerating
facts -> decision (``tests/runtime/test_driver_decisions.py``); :class:`~airflow_arroyo.runtime.driver.
PipelineDriver` reads the facts, asks, and applies the answer (the restore facts come from
:mod:`airflow_arroyo.core.restores`, where ``airflow-arroyo restore`` reads them too):

* :func:`plan_restore` — before anything is written: a fresh start, a start over (``'latest'`` with no
  completed epoch) or the restore of one epoch; or :class:`ConfigurationError` naming the problem and the fix;
* :func:`decide_stop` — every turn of the loop: keep running, stop now, or the next step of a graceful stop
  with a final epoch (start it, wait for it, retry it, finish with it, or give up on it);
* :func:`epoch_to_commit` and :func:`sinks_to_commit` — when an epoch ends: which completed epoch's cuts the
  exactly-once sinks commit, which commits to make (in the sinks' order) and how far they may forget;
  :func:`epochs_still_to_commit`, which seen epochs the driver keeps for later commits.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from airflow_arroyo.core.epochs import EpochState
from airflow_arroyo.core.exceptions import (
    ConfigurationError,
    StateConflictError,
    UnknownEpochError,
    UnrestorableEpochError,
)
from airflow_arroyo.runtime.state_schema import OperatorState, stage_refusal

__all__ = [
    "FINAL_EPOCH_ATTEMPTS",
    "EpochFacts",
    "RestoreAction",
    "RestoreFacts",
    "RestoreFrom",
    "RestorePlan",
    "SinkCommit",
    "SinkCommitPlan",
    "StageAction",
    "StageUpgrade",
    "StopAction",
    "StopDecision",
    "StopFacts",
    "StopMode",
    "UpgradePlan",
    "decide_stop",
    "epoch_to_commit",
    "epochs_still_to_commit",
    "plan_restore",
    "plan_stages",
    "plan_upgrade",
    "sink_cuts",
    "sinks_to_commit",
]

RestoreFrom = str | int | None  # None (fresh start), "latest", or an epoch number

# A graceful stop starts at most this many final epochs before it stops without one.
FINAL_EPOCH_ATTEMPTS = 3

_PICK_COMPLETED = "restore from a completed epoch (restore_from='latest' picks the newest one)"


# --------------------------------------------------------------------------- restore


@dataclass(frozen=True)
class EpochFacts:
    """What a restore needs to know of one epoch."""

    epoch: int
    state: EpochState
    stages: tuple[str, ...]
    unrestorable: str | None = None  # why a restore proved it can never be restored


@dataclass(frozen=True)
class RestoreFacts:
    """What a run's restore is decided on (:func:`airflow_arroyo.core.restores.read_restore_facts`; the driver writes
    nothing before the decision).

    ``epoch`` is the candidate: for ``'latest'`` the latest completed epoch, for ``N`` epoch ``N``; None when
    there is none (or the pipeline is unknown). ``has_state`` is read for a fresh start only (``requested`` is
    None); ``location`` is where that state lives, for the message.
    """

    pipeline_id: str
    requested: RestoreFrom
    stages: tuple[str, ...] | None  # the new run's stages; None: not known to the caller (the CLI), not checked
    pipeline_known: bool = False
    epoch: EpochFacts | None = None
    has_state: bool = False
    location: str = ""
    fork_of: str | None = None  # a fork's first run: the pipeline whose epoch (the fork point) it restores
    # the oldest commit gate without a pass (airflow_arroyo.core.gates): (epoch, sink, state); no restore at or after it
    held_by: tuple[int, str, str] | None = None
    # an upgrade (plan_upgrade): the epoch's stages whose state the new code may drop, and old -> new stage names
    allow_dropped_state: tuple[str, ...] = ()
    renamed: tuple[tuple[str, str], ...] = ()
    # stage identities (a stage's uid, else its name) where they differ from the name: the new graph's, and the
    # epoch's stages' as their pipeline's last run registered them
    identities: tuple[tuple[str, str], ...] = ()
    epoch_identities: tuple[tuple[str, str], ...] = ()
    # the new code's source stages (logical names): a fused query of the epoch splits only where its source is known
    sources: tuple[str, ...] | None = None
    # the evidence of state compatibility, where read: new stage -> (the snapshot's stateful operators, the new code's)
    state_schemas: tuple[tuple[str, tuple[tuple[OperatorState, ...], tuple[OperatorState, ...]]], ...] = ()


class RestoreAction(enum.StrEnum):
    """What a run does before it starts its queries."""

    FRESH = "fresh"  # nothing to restore and nothing there: start from the beginning
    START_OVER = "start_over"  # 'latest' without a completed epoch: empty checkpoints and channels, then start
    RESTORE = "restore"  # restore ``epoch``


@dataclass(frozen=True)
class RestorePlan:
    """The answer of :func:`plan_restore`: the action, and the epoch to restore for ``RESTORE``."""

    action: RestoreAction
    epoch: int | None = None
    reason: str = ""
    upgrade: UpgradePlan | None = None  # RESTORE with the new graph's stages known: what each stage becomes


def plan_restore(facts: RestoreFacts) -> RestorePlan:
    """What to restore, or :class:`ConfigurationError` (raised before anything is written; exit status 2).

    * ``None`` — a fresh start, refused when the storage holds state of an earlier run (the user must say
      whether to resume from it or delete it: the driver never guesses);
    * ``'latest'`` — the latest completed epoch; with none (or an unknown pipeline), a start over;
    * ``N`` — epoch ``N``, which must exist and be ``completed``.

    The epoch restored must hold a snapshot of every stage of the graph, and no earlier restore may have proved
    it unrestorable (:class:`UnrestorableEpochError`: trying again would fail the same way).
    """
    pid, rf = facts.pipeline_id, facts.requested
    if rf is None:
        if facts.has_state:
            raise ConfigurationError(
                f"pipeline {pid!r} has state of an earlier run under {facts.location}; start with "
                "restore_from='latest' (or an epoch number) to resume from a completed epoch, or delete that "
                "folder to start over"
            )
        return RestorePlan(RestoreAction.FRESH, reason="fresh start")
    epoch = facts.epoch
    if facts.fork_of is not None and epoch is not None:
        _check_fork_point(pid, facts.fork_of, epoch)
    if rf == "latest":
        if epoch is None or not facts.pipeline_known:
            return RestorePlan(RestoreAction.START_OVER, reason="no completed epoch to restore from")
    elif not isinstance(rf, int) or isinstance(rf, bool):
        raise ConfigurationError(f"restore_from must be 'latest', an epoch number or None, got {rf!r}")
    elif not facts.pipeline_known:
        raise ConfigurationError(f"pipeline {pid!r} has no epoch {rf} to restore from")
    elif epoch is None:
        raise ConfigurationError(f"{UnknownEpochError(pid, rf)}; {_PICK_COMPLETED}")
    elif epoch.state is not EpochState.COMPLETED:
        why = (" (a restore of an older epoch cut the channels right after that one)"
               if epoch.state is EpochState.SUPERSEDED else "")
        raise ConfigurationError(f"epoch {rf} of pipeline {pid!r} is {epoch.state}, not completed{why}; "
                                 f"{_PICK_COMPLETED}")
    if facts.held_by is not None and epoch.epoch >= facts.held_by[0]:
        held, sink, state = facts.held_by
        raise StateConflictError(
            f"epoch {epoch.epoch} of pipeline {pid!r} cannot be restored: the gate of sink {sink!r} for epoch {held} "
            f"is {state}, and a restore commits the output of the epochs it keeps. Record a pass first (airflow-arroyo "
            f"gate pass {pid} --sink {sink} --epoch {held}) or restore an epoch before {held} (restore_from='latest' "
            "picks the newest one)")
    if epoch.unrestorable is not None:
        raise UnrestorableEpochError(
            f"epoch {epoch.epoch} of pipeline {pid!r} cannot be restored (found by an earlier restore, which "
            f"changed nothing: {epoch.unrestorable}); restore an earlier completed epoch with restore_from=<n> "
            "(airflow-arroyo epochs lists them), or start over in a new storage folder",
            epoch=epoch.epoch, stage="", problems=(epoch.unrestorable,))
    reason = f"epoch {epoch.epoch} ({rf})"
    if facts.stages is None:  # the caller does not have the code (the CLI): the driver plans the upgrade
        return RestorePlan(RestoreAction.RESTORE, epoch.epoch, reason=reason)
    upgrade = plan_stages(facts, epoch)
    if not upgrade.restores:
        refused = "; ".join(f"stage {r.stage!r} {r.action.value}: {r.reason}" for r in upgrade.refused)
        raise ConfigurationError(
            f"epoch {epoch.epoch} of pipeline {pid!r} does not restore into this code's graph (its stages: "
            f"{', '.join(epoch.stages)}): {refused} (airflow-arroyo upgrade-plan prints the whole plan)")
    return RestorePlan(RestoreAction.RESTORE, epoch.epoch, reason=reason, upgrade=upgrade)


def plan_stages(facts: RestoreFacts, epoch: EpochFacts) -> UpgradePlan:
    """What each stage of the new graph (``facts.stages``, with ``facts.identities``) becomes in a restore of
    ``epoch`` (:func:`plan_upgrade` over identities, with ``facts``'s ``allow_dropped_state`` and ``renamed``); each
    restored row's ``snapshot`` is the epoch's stage *name* whose snapshot it takes. The driver and
    ``airflow-arroyo upgrade-plan`` both plan here."""
    ids, held_ids = dict(facts.identities), dict(facts.epoch_identities)
    upgrade = plan_upgrade(epoch.epoch, [held_ids.get(s, s) for s in epoch.stages],
                           {s: ids.get(s, s) for s in facts.stages or ()},
                           allow_dropped_state=facts.allow_dropped_state, renamed=dict(facts.renamed),
                           sources=facts.sources, state_schemas=dict(facts.state_schemas))
    name_of = {held_ids.get(s, s): s for s in epoch.stages}  # the plan speaks identities; snapshots are by name
    return dataclasses.replace(upgrade, stages=tuple(
        dataclasses.replace(r, snapshot=name_of.get(r.snapshot, r.snapshot)) if r.snapshot else r
        for r in upgrade.stages))


def _check_fork_point(pid: str, source: str, point: EpochFacts) -> None:
    """A fork's first run restores its fork point or nothing: the way out of a bad one is another fork."""
    again = (f"fork {source} again from a completed epoch (airflow-arroyo fork {source} --epoch N --to NEW; "
             f"airflow-arroyo epochs {source} lists them)")
    if point.state is not EpochState.COMPLETED:
        raise ConfigurationError(f"the fork point of {pid!r}, epoch {point.epoch} of {source!r}, is {point.state}: "
                                 f"the fork cannot start; {again}")
    if point.unrestorable is not None:
        raise UnrestorableEpochError(
            f"the fork point of {pid!r}, epoch {point.epoch} of {source!r}, cannot be restored (found by an earlier "
            f"restore, which changed nothing: {point.unrestorable}); {again}",
            epoch=point.epoch, stage="", problems=(point.unrestorable,))


# --------------------------------------------------------------------------- upgrade plan


class StageAction(enum.StrEnum):
    """What a restore does with one stage when the code changed since the epoch (:func:`plan_upgrade`)."""

    RESTORED = "restored"  # same identity, snapshot in the epoch: its state is restored
    NEW = "new"  # no snapshot in the epoch: starts with empty state
    REMOVED = "removed"  # in the epoch, not in the graph: its state is dropped (allowed by name only)
    INCOMPATIBLE = "incompatible"  # cannot take its snapshot: refused
    ACROSS_FUSION = "restored-across-fusion"  # its state from a query of another fusion (a split): restored


@dataclass(frozen=True)
class StageUpgrade:
    """One row of an :class:`UpgradePlan`: the new graph's stage (or the epoch's, for a removed one)."""

    stage: str
    action: StageAction
    reason: str
    snapshot: str | None = None  # the epoch's stage whose snapshot it restores (differs from ``stage`` on a rename)
    refused: bool = False


@dataclass(frozen=True)
class UpgradePlan:
    """The answer of :func:`plan_upgrade`: a row per stage, and whether the restore may go ahead."""

    epoch: int
    stages: tuple[StageUpgrade, ...]
    # what a dry run planned against (airflow_arroyo.core.upgrades.check_upgrade): the physical queries, name ->
    # members (None: the logical stages, the driver decides the fusion when it starts), why, and the stages whose
    # state schemas were compared (None: not checked)
    queries: tuple[tuple[str, tuple[str, ...]], ...] | None = None
    fusion: str = ""
    state_schema_checked: tuple[str, ...] | None = None

    @property
    def refused(self) -> tuple[StageUpgrade, ...]:
        """The rows that stop the restore."""
        return tuple(s for s in self.stages if s.refused)

    @property
    def restores(self) -> bool:
        """Whether the restore may go ahead."""
        return not self.refused

    def snapshot_of(self) -> dict[str, str]:
        """New stage -> the epoch's stage whose snapshot it restores (restored stages only)."""
        return {s.stage: s.snapshot for s in self.stages
                if s.action in (StageAction.RESTORED, StageAction.ACROSS_FUSION) and s.snapshot is not None}

    def across_fusion(self) -> dict[str, str]:
        """New stage -> the epoch's fused query it is split from (``restored-across-fusion`` rows)."""
        return {s.stage: s.snapshot for s in self.stages
                if s.action is StageAction.ACROSS_FUSION and s.snapshot is not None}


def plan_upgrade(epoch: int, epoch_stages: Iterable[str], graph: Mapping[str, str], *,
                 allow_dropped_state: Iterable[str] = (), renamed: Mapping[str, str] | None = None,
                 epoch_fusion: Iterable[Iterable[str]] | None = None,
                 graph_fusion: Iterable[Iterable[str]] | None = None,
                 sources: Iterable[str] | None = None,
                 state_schemas: Mapping[str, tuple[Sequence[OperatorState], Sequence[OperatorState]]] | None = None,
                 ) -> UpgradePlan:
    """Each stage of the new code's graph against epoch ``epoch``: restored, new, removed or incompatible.

    ``state_schemas`` is the evidence of state compatibility where it was read: new stage name -> (the stateful
    operators Spark recorded in the snapshot it restores, those the new code's query writes); a stage whose state
    Spark would refuse to load (``runtime/state_schema.py`` ``stage_refusal``) is incompatible, before anything
    is written.

    ``graph`` maps each new stage's name to its identity (its ``uid``, else its name); ``epoch_stages`` are the
    identities the epoch holds snapshots of. ``renamed`` maps an epoch's identity to the new stage (by name or
    identity) that takes its snapshot, as Flink maps state by operator uid: a rename is never guessed. A stage in
    the epoch and not in the graph is refused unless ``allow_dropped_state`` names it (Flink's
    ``allowNonRestoredState``, but per stage). ``epoch_fusion`` / ``graph_fusion`` are the fused groups (the epoch's
    stage identities, the new graph's stage names, run as one Spark query) when known: a restored stage whose
    group changed is incompatible, since its Spark checkpoint belongs to another query's plan.

    A fused query of the epoch (named ``a~b~c``) whose members the new code runs as other queries is split
    (``restored-across-fusion``) when ``sources`` (the new code's source stages) names exactly one of its members and
    the new code runs every member; any other change of fusion is refused by name (docs/upgrading.md's matrix).
    """
    renamed = dict(renamed or {})
    held = list(dict.fromkeys(epoch_stages))
    dropped = set(allow_dropped_state)
    by_identity = _check_upgrade_input(epoch, held, graph, dropped, renamed)
    source_of: dict[str, str] = {}  # new stage name -> the epoch identity whose snapshot it takes
    for name, ident in graph.items():
        if ident in held and ident not in renamed:
            source_of[name] = ident
    for old, new in renamed.items():
        name = new if new in graph else by_identity[new]
        if name in source_of:
            raise ConfigurationError(f"stage {name!r} would take the snapshots of both {source_of[name]!r} and "
                                     f"{old!r}; a stage restores one snapshot")
        source_of[name] = old
    groups_then = _groups(epoch_fusion)
    groups_now = _groups(graph_fusion)
    across, across_taken = _across_fusion(epoch, held, graph, source_of, dropped, sources)
    rows: list[StageUpgrade] = []
    for name, ident in graph.items():
        snap = source_of.get(name)
        if snap is None and name in across:
            held_by, why, split = across[name]
            rows.append(StageUpgrade(name, StageAction.ACROSS_FUSION if split else StageAction.INCOMPATIBLE, why,
                                     snapshot=held_by, refused=not split))
            continue
        if snap is None:
            rows.append(StageUpgrade(name, StageAction.NEW, f"no snapshot in epoch {epoch}: starts with empty "
                                     "state, its channels read from the epoch's cut"))
            continue
        then = groups_then.get(snap)
        now = {source_of.get(member, graph[member]) for member in groups_now.get(name, ())} or None
        if then is not None and now is not None and then != now:
            rows.append(StageUpgrade(
                name, StageAction.INCOMPATIBLE,
                f"fusion changed: epoch {epoch} ran it in the query of {', '.join(sorted(then))}, the new code in "
                f"that of {', '.join(sorted(now))}; restore with the same fusion (what a change of fusion can "
                "carry: docs/upgrading.md, 'Across a change of fusion')",
                snapshot=snap, refused=True))
            continue
        shapes = (state_schemas or {}).get(name)
        why_not = stage_refusal(*shapes) if shapes is not None else None
        if why_not is not None:
            rows.append(StageUpgrade(
                name, StageAction.INCOMPATIBLE,
                f"state changed shape since epoch {epoch}: {why_not}; drop its state by name "
                f"(allow_dropped_state=[{snap!r}] with the stage under a new uid) or keep the old state's shape",
                snapshot=snap, refused=True))
            continue
        how = f"renamed from {snap!r}" if snap != ident else "same identity"
        rows.append(StageUpgrade(name, StageAction.RESTORED, f"{how}, snapshot in epoch {epoch}", snapshot=snap))
    taken = set(source_of.values()) | across_taken
    for ident in held:
        if ident in taken:
            continue
        if ident in dropped:
            rows.append(StageUpgrade(ident, StageAction.REMOVED, "not in the new graph; its state is dropped "
                                     "(allow_dropped_state)"))
        else:
            rows.append(StageUpgrade(
                ident, StageAction.REMOVED,
                f"not in the new graph but epoch {epoch} holds its state; drop it with "
                f"allow_dropped_state=[{ident!r}], or map it to its new name with renamed={{{ident!r}: 'NEW'}}",
                refused=True))
    return UpgradePlan(epoch, tuple(rows))


def _check_upgrade_input(epoch: int, held: list[str], graph: Mapping[str, str], dropped: set[str],
                         renamed: Mapping[str, str]) -> dict[str, str]:
    """Refuse options naming no stage (a typo must not drop or move state); answer identity -> new stage name."""
    by_identity: dict[str, str] = {}
    for name, ident in graph.items():
        if ident in by_identity:
            raise ConfigurationError(f"stages {by_identity[ident]!r} and {name!r} have the same identity "
                                     f"{ident!r}; give each stage its own uid")
        by_identity[ident] = name
    for old, new in renamed.items():
        if old not in held:
            raise ConfigurationError(f"renamed names {old!r}, which epoch {epoch} has no snapshot of (its stages: "
                                     f"{', '.join(held) or 'none'}); map an epoch's stage to a new one, old=new")
        if new not in graph and new not in by_identity:
            raise ConfigurationError(f"renamed maps {old!r} to {new!r}, which is no stage of the new graph "
                                     f"(its stages: {', '.join(graph)})")
    unknown = sorted(dropped - set(held))
    if unknown:
        raise ConfigurationError(f"allow_dropped_state names {', '.join(unknown)}, which epoch {epoch} has no "
                                 f"snapshot of (its stages: {', '.join(held) or 'none'}); name only stages to drop")
    return by_identity


# plan.SEPARATOR: a fused query's stage name is its members' names joined by it (importing plan here would pull
# the graph's modules into this pure core; tests/runtime/test_upgrade_plan.py checks they agree)
FUSED_SEPARATOR = "~"


def _members(name: str) -> tuple[str, ...]:
    return tuple(name.split(FUSED_SEPARATOR))


def _across_fusion(epoch: int, held: list[str], graph: Mapping[str, str], source_of: Mapping[str, str],
                   dropped: set[str], sources: Iterable[str] | None,
                   ) -> tuple[dict[str, tuple[str, str, bool]], set[str]]:
    """New stages whose state the epoch holds in a query of another fusion (docs/upgrading.md, "Across a change
    of fusion"): new stage -> (the epoch's stage holding its state, why, whether the restore splits it (else
    refused, the reason naming the way through)), and the epoch's stages these rows account for. An epoch's stage
    named in ``allow_dropped_state`` is not looked at: its state is dropped and its members start new, as asked."""
    taken = set(source_of.values())
    loose = {name: ident for name, ident in graph.items() if name not in source_of}  # would start empty
    free = [h for h in held if h not in taken and h not in dropped]
    out: dict[str, tuple[str, str, bool]] = {}
    accounted: set[str] = set()
    way = ("restore with the epoch's fusion (the same chaining and chain=False boundaries as the code that took "
           "it), or drop that state by name with allow_dropped_state=[{drop}] (its stages start empty)")
    for h in free:  # split: the epoch ran these stages as one query
        parts = _members(h)
        if len(parts) < 2:
            continue
        takers = [name for name, ident in loose.items()
                  if name not in out and ({name, ident} | set(_members(name))) & set(parts)]
        why_not = _split_refusal(parts, takers, sources)
        if why_not is None:
            for name in takers:
                out[name] = (h, f"split from epoch {epoch}'s query {h!r} (fusion changed): its checkpoint is "
                                "rebuilt for this query (state with the stateful stage, offsets with the source's "
                                "stage, new channels from the cut)", True)
            accounted.add(h)
            continue
        for name in takers:
            alone = len(_members(name)) == 1
            out[name] = (h, (
                f"fusion changed: epoch {epoch} ran {', '.join(parts)} as one Spark query {h!r}, the new code runs "
                f"{name!r} {'as its own query' if alone else 'as another query'}. Spark's checkpoint of {h!r} "
                "allows the split (its one stateful stage keeps its state/<operator id>, the source's offsets go "
                "with the stage that reads the source, the new channels start empty at the cut: a fused query "
                "cuts at one micro-batch boundary) but this version's restore does not rebuild it into other "
                f"queries' checkpoints here: {why_not}; {way.format(drop=repr(h))}"), False)
            accounted.add(h)
    for name in loose:  # merge: the new code fuses stages the epoch ran as their own queries
        parts = _members(name)
        were = [h for h in free if h in parts and h not in accounted]
        if len(parts) < 2 or not were:
            continue
        if name in out:  # regrouped: it also takes stages the epoch ran as their own queries
            held_by, why, _ = out[name]
            out[name] = (held_by, f"{why}; it also fuses {', '.join(were)}, which epoch {epoch} ran as their own "
                                  "queries", False)
            accounted.update(were)
            continue
        merge_not = _merge_refusal(parts, were, sources)
        if merge_not is None:
            out[name] = (parts[-1], f"merged from epoch {epoch}'s queries {', '.join(were)} (fusion changed): one "
                                    "checkpoint from theirs, renumbered to one batch numbering", True)
            accounted.update(were)
            continue
        out[name] = (were[0], (
            f"fusion changed: epoch {epoch} ran {', '.join(were)} as separate Spark queries joined by channels, "
            f"the new code fuses {', '.join(parts)} into one query {name!r}. Spark's checkpoints allow the merge "
            "only by renumbering: nothing is in flight in an aligned channel at a completed epoch's cut and the "
            "query holds one stateful stage, but each query numbered its own micro-batches and its state "
            "versions follow them; the restore renumbers them only for stages that each ran as their own query, "
            f"with one source among them: {merge_not}; {way.format(drop=', '.join(repr(w) for w in were))}"), False)
        accounted.update(were)
    return out, accounted


def _merge_refusal(parts: tuple[str, ...], were: list[str], sources: Iterable[str] | None) -> str | None:
    """Why the epoch's queries ``were`` cannot merge into the new query of ``parts`` (None: they can)."""
    if sources is None:
        return "the new code's source stages are not known to this plan"
    if set(were) != set(parts):
        return f"{', '.join(p for p in parts if p not in were)} did not run as its own query in that epoch"
    read = [p for p in parts if p in set(sources)]
    if len(read) != 1:
        return f"the new query would read {len(read)} sources ({', '.join(read) or 'none known'})"
    return None


def _split_refusal(parts: tuple[str, ...], takers: list[str], sources: Iterable[str] | None) -> str | None:
    """Why the epoch's query of ``parts`` cannot be split into the new stages ``takers`` (None: it can)."""
    if sources is None:
        return "the new code's source stages are not known to this plan"
    covered = {m for name in takers for m in _members(name)}
    if not covered <= set(parts):
        return f"{', '.join(sorted(covered - set(parts)))} would join it from outside that query"
    if covered != set(parts):
        return f"{', '.join(p for p in parts if p not in covered)} of that query is not in the new code"
    read = [p for p in parts if p in set(sources)]
    if len(read) != 1:
        return (f"that query read {len(read)} sources ({', '.join(read) or 'none known'}), and its offset log holds "
                "one line per source in the fused plan's order")
    return None


def _groups(fusion: Iterable[Iterable[str]] | None) -> dict[str, frozenset[str]]:
    """Stage identity -> the identities of the query it runs in."""
    out: dict[str, frozenset[str]] = {}
    for group in fusion or ():
        members = frozenset(group)
        for m in members:
            out[m] = members
    return out


# --------------------------------------------------------------------------- graceful stop


class StopMode(enum.StrEnum):
    """How a stop was asked for: with a final epoch (``graceful``) or at once (``immediate``)."""

    GRACEFUL = "graceful"
    IMMEDIATE = "immediate"


@dataclass(frozen=True)
class StopFacts:
    """One turn of the driver's loop, as far as stopping goes.

    ``final_epoch`` is the final epoch this stop started and still waits for (None: none yet, or the last
    one was given up); ``final_state`` its state read this turn (read only while stopping gracefully);
    ``final_attempts`` how many final epochs this stop started; ``final_deadline`` when the final epoch in
    flight times out (its start plus the driver's ``final_epoch_timeout``); times are monotonic seconds.
    """

    mode: StopMode | None = None
    stopping: bool = False  # the pipeline was marked `stopping` already
    final_epoch: int | None = None
    final_state: EpochState | None = None
    final_attempts: int = 0
    final_deadline: float = 0.0
    now: float = 0.0


class StopAction(enum.StrEnum):
    """The next step of the driver about a stop."""

    RUN = "run"  # no stop requested: keep running
    STOP = "stop"  # stop the queries and end the run now (with ``epoch`` as the final epoch, if any)
    START_FINAL = "start_final"  # try to start the final epoch (a force tick marked final)
    WAIT_FINAL = "wait_final"  # the final epoch is in flight: wait for it
    FINISH = "finish"  # the final epoch completed: commit the sinks, then end the run with it
    RETRY_FINAL = "retry_final"  # the final epoch ended without completing or timed out: forget it, start another
    GIVE_UP = "give_up"  # the last allowed final epoch (``epoch``) did not complete: end without one (``cause``)


@dataclass(frozen=True)
class StopDecision:
    """The answer of :func:`decide_stop`: the action, and the final epoch it concerns, if any."""

    action: StopAction
    epoch: int | None = None
    mark_stopping: bool = False  # first: set the pipeline's state to `stopping`
    fail_epoch: bool = False  # RETRY_FINAL of an epoch still in flight (timed out): fail it first
    cause: str | None = None  # GIVE_UP: the run's failure cause
    reason: str = ""


def decide_stop(facts: StopFacts) -> StopDecision:
    """The driver's stop, Flink's stop-with-savepoint: the whole rule, in one place.

    ``immediate`` stops at once. ``graceful`` marks the pipeline `stopping` (once), starts a final epoch, waits
    for it until ``final_deadline``, and ends the run with it when it completes. One that fails, expires
    or times out (a timed-out one is failed first, so that it stops blocking) is tried again, up to
    :data:`FINAL_EPOCH_ATTEMPTS` final epochs; then the run ends without one, the cause naming the last.
    """
    f = facts
    if f.mode is None:
        return StopDecision(StopAction.RUN, reason="no stop requested")
    if f.mode is StopMode.IMMEDIATE:
        return StopDecision(StopAction.STOP, epoch=f.final_epoch, reason="immediate stop")
    mark = not f.stopping
    if f.final_epoch is None:
        return StopDecision(StopAction.START_FINAL, mark_stopping=mark, reason="graceful stop: taking a final epoch")
    state = f.final_state
    if state is EpochState.COMPLETED:
        return StopDecision(StopAction.FINISH, epoch=f.final_epoch, mark_stopping=mark,
                            reason=f"final epoch {f.final_epoch} completed")
    timed_out = f.now > f.final_deadline
    if state is EpochState.TRIGGERED and not timed_out:
        return StopDecision(StopAction.WAIT_FINAL, epoch=f.final_epoch, mark_stopping=mark,
                            reason=f"final epoch {f.final_epoch} in flight")
    if f.final_attempts >= FINAL_EPOCH_ATTEMPTS:
        return StopDecision(StopAction.GIVE_UP, epoch=f.final_epoch, mark_stopping=mark,
                            cause=f"final epoch {f.final_epoch} {state}",
                            reason=f"final epoch {state} {f.final_attempts} times; stopping without it")
    return StopDecision(StopAction.RETRY_FINAL, epoch=f.final_epoch, mark_stopping=mark,
                        fail_epoch=state is EpochState.TRIGGERED,  # timed out: fail it, or it blocks the next one
                        reason=f"final epoch {state}{' (timed out)' if timed_out else ''}; trying again")


# --------------------------------------------------------------------------- exactly-once sinks


def epoch_to_commit(committed: int, seen: Iterable[int], states: Mapping[int, EpochState]) -> int | None:
    """The epoch whose cuts the exactly-once sinks commit now: the newest completed epoch this run took part in
    (``seen``) after ``committed``, the one they are committed through. Never an epoch of an earlier run (e.g.
    one whose storage was deleted for a fresh start: its cut batch ids are not this run's). ``states`` holds
    the state of each seen epoch after ``committed`` (an epoch missing there is not known to be completed)."""
    done = [e for e in seen if e > committed and states.get(e) is EpochState.COMPLETED]
    return max(done) if done else None


def epochs_still_to_commit(committed: int, seen: Iterable[int], states: Mapping[int, EpochState]) -> list[int]:
    """The epochs of ``seen`` a later :func:`epoch_to_commit` may still choose: after ``committed`` and not ended
    otherwise than completed (``states``; one missing there is in flight). What a driver keeps between commits,
    so that it holds the epochs since its last commit, not every epoch of the run."""
    open_states = (EpochState.TRIGGERED, EpochState.COMPLETED)
    return [e for e in seen if e > committed and states.get(e, EpochState.TRIGGERED) in open_states]


def sink_cuts(pipeline_id: str, epoch: int, sinks: Iterable[str],
              ack_details: Mapping[str, Mapping[str, Any] | None]) -> dict[str, int]:
    """Each exactly-once sink's cut batch in ``epoch``, from its stage's acknowledgement (``ack_details``: stage
    -> the ack's details); :class:`ConfigurationError` when one is missing (that epoch cannot be restored or
    committed with that sink)."""
    out: dict[str, int] = {}
    for name in sinks:
        batch = (ack_details.get(name) or {}).get("batch_id")
        if batch is None:
            raise ConfigurationError(
                f"epoch {epoch} of pipeline {pipeline_id!r} has no cut batch of sink {name!r}; it cannot be "
                "restored with that sink: choose another epoch"
            )
        out[name] = int(batch)
    return out


@dataclass(frozen=True)
class SinkCommit:
    """One commit to make: ``sink`` commits its micro-batches through ``batch``."""

    sink: str
    batch: int  # through this micro-batch


@dataclass(frozen=True)
class SinkCommitPlan:
    """Commit each sink through its cut in ``epoch`` (in this order), then let each forget what only a restore
    behind the oldest completed epoch could need (``trims``, after every commit)."""

    epoch: int
    commits: tuple[SinkCommit, ...]
    trims: tuple[SinkCommit, ...] = ()


def sinks_to_commit(epoch: int, cuts: Mapping[str, int], oldest_completed: int | None = None,
                    oldest_cuts: Mapping[str, int] | None = None) -> SinkCommitPlan:
    """The commits for ``epoch`` (:func:`epoch_to_commit`): every sink through its cut batch in ``epoch``, in the
    sinks' order (``cuts``'s order); then, when an oldest completed epoch is known, trims of every sink through
    its cut there (``oldest_cuts``; the same as ``cuts`` when it is ``epoch``): no restore goes behind it."""
    commits = tuple(SinkCommit(name, batch) for name, batch in cuts.items())
    if oldest_completed is None:
        return SinkCommitPlan(epoch, commits)
    floors = cuts if oldest_completed == epoch else (oldest_cuts or {})
    missing = [name for name in cuts if name not in floors]
    if missing:
        raise ValueError(f"no cut of sink(s) {', '.join(missing)} in the oldest completed epoch {oldest_completed}")
    return SinkCommitPlan(epoch, commits, tuple(SinkCommit(name, floors[name]) for name in cuts))
