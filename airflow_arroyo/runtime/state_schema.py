"""State schema compatibility of an upgrade: whether a stateful stage's new code can load the state Spark
recorded in an epoch's snapshot, decided before the restore writes anything.

The evidence is what Spark itself checks when the restored query first loads its state, read from the snapshot's
checkpoint folder (:func:`read_operator_states`):

* ``state/<opId>/_metadata/metadata`` — the operator metadata (``v1`` then JSON): the operator's name
  (``stateStoreSave`` for an aggregation, ``dedupe`` for dropDuplicates, ...). Spark refuses a restore whose
  operator at that id is another one (``STREAMING_STATEFUL_OPERATOR_NOT_MATCH_IN_STATE_METADATA``);
* ``state/<opId>/0/_metadata/schema`` — the key and value schemas (``StateSchemaCompatibilityChecker``'s ``v2``
  file: ``writeUTF("v2")``, then for the key and the value schema a chunk count and each chunk ``writeUTF``).

The rule (:func:`schema_refusal`, pure) mirrors ``StateSchemaCompatibilityChecker.check``: identical schemas pass;
otherwise the key schema, then the value schema, must satisfy ``DataType.equalsIgnoreNameAndCompatibleNullability``
(new -> stored): the same number of fields with the same types in the same order, names may differ, and a field
may not become nullable where the stored one was not. The planner (``runtime/decisions.py`` ``plan_upgrade``)
gets the stored and the new schemas as plain data and refuses the stage by name.

Where the new schemas come from (:func:`new_operator_states`): the new stage's DataFrame, planned but not run.
Its analyzed plan, put through the session's optimizer as a started query would be, gives each stateful node in the
order Spark numbers their operator ids, the grouping keys, and the aggregation buffers Spark keeps as the value
(the optimizer matters: it prunes aggregates nothing reads and reorders them after the projection, and Spark's
state follows). This is cheap (no job, no files) and exact for aggregations and dropDuplicates, which is what
tests/runtime/test_state_schema_spark.py checks against Spark's own verdict on a real checkpoint. A dry run into a
scratch checkpoint would cover every operator but costs a query start and an input batch per stage, and needs
input to make Spark write its files; stages with other stateful operators (joins, arbitrary state) answer None and
are not checked. The driver (before its restore writes anything) and ``airflow-arroyo upgrade-plan
--check-state-schema`` gather this evidence the same way (``runtime/upgrade_evidence.py``); ``check_upgrade``
without it runs no Spark and does not check (docs/upgrading.md).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from airflow_arroyo.core.fs import FileSystem

__all__ = ["OperatorState", "new_operator_states", "own_operator_states", "parse_operator_states",
           "read_operator_states", "schema_refusal", "stage_refusal"]


@dataclass(frozen=True)
class OperatorState:
    """One stateful operator of a query's checkpoint: its id, Spark's name for it, and its state schemas (Spark's
    JSON form of a ``StructType``, as plain data; None where the file is not there)."""

    op_id: int
    operator: str
    key: Mapping[str, Any] | None = None
    value: Mapping[str, Any] | None = None


def _compatible(new: Any, stored: Any) -> bool:
    """``DataType.equalsIgnoreNameAndCompatibleNullability(new, stored)`` over Spark's JSON form of types."""
    if isinstance(new, Mapping) and isinstance(stored, Mapping) and new.get("type") == stored.get("type"):
        kind = new.get("type")
        if kind == "struct":
            a, b = new.get("fields", []), stored.get("fields", [])
            return len(a) == len(b) and all(
                (t.get("nullable", True) or not f.get("nullable", True)) and _compatible(f["type"], t["type"])
                for f, t in zip(a, b, strict=True))
        if kind == "array":
            return ((stored.get("containsNull", True) or not new.get("containsNull", True))
                    and _compatible(new["elementType"], stored["elementType"]))
        if kind == "map":
            return ((stored.get("valueContainsNull", True) or not new.get("valueContainsNull", True))
                    and _compatible(new["keyType"], stored["keyType"])
                    and _compatible(new["valueType"], stored["valueType"]))
    return bool(new == stored)


def _fields(schema: Mapping[str, Any] | None) -> str:
    if schema is None:
        return "(none)"
    return "(" + ", ".join(f"{f['name']}: {_type(f['type'])}{'' if f.get('nullable', True) else ' not null'}"
                           for f in schema.get("fields", [])) + ")"


def _type(t: Any) -> str:
    return t if isinstance(t, str) else json.dumps(t, sort_keys=True)


def schema_refusal(stored: OperatorState, new: OperatorState) -> str | None:
    """Why Spark would refuse ``new`` loading ``stored``'s state, or None (Spark's order: operator, key, value)."""
    if stored.operator != new.operator:
        return (f"state operator {stored.op_id} was {stored.operator!r} in the epoch and is {new.operator!r} in the "
                "new code")
    if stored.key is None or new.key is None or (stored.key == new.key and stored.value == new.value):
        return None  # no schema file to compare (Spark checks nothing either), or exactly the same
    if not _compatible(new.key, stored.key):
        return (f"state operator {stored.op_id} ({stored.operator}): key schema {_fields(stored.key)} in the epoch, "
                f"{_fields(new.key)} in the new code")
    if stored.value is not None and new.value is not None and not _compatible(new.value, stored.value):
        return (f"state operator {stored.op_id} ({stored.operator}): value schema {_fields(stored.value)} in the "
                f"epoch, {_fields(new.value)} in the new code")
    return None


def stage_refusal(stored: Sequence[OperatorState], new: Sequence[OperatorState]) -> str | None:
    """Why a stage's new query cannot load its snapshot's state, or None: each operator of the snapshot against the
    new query's operator of the same id (an operator the new query lacks is a changed query shape)."""
    by_id = {o.op_id: o for o in new}
    problems: list[str] = []
    for old in sorted(stored, key=lambda o: o.op_id):
        now = by_id.get(old.op_id)
        if now is None:
            problems.append(f"state operator {old.op_id} ({old.operator}) is not in the new code's query")
            continue
        why = schema_refusal(old, now)
        if why is not None:
            problems.append(why)
    extra = sorted(set(by_id) - {o.op_id for o in stored})
    if extra and stored:
        problems += [f"state operator {i} ({by_id[i].operator}) is new in the query, which Spark numbers by "
                     "position" for i in extra]
    return "; ".join(problems) or None


def _read_utf(data: bytes, at: int) -> tuple[str, int]:
    (n,) = struct.unpack_from(">H", data, at)
    return data[at + 2:at + 2 + n].decode("utf-8"), at + 2 + n


def _read_v2_schema(data: bytes) -> tuple[dict[str, Any], dict[str, Any]]:
    version, at = _read_utf(data, 0)
    if version != "v2":
        raise ValueError(f"state schema file version {version!r} (only v2 is read)")
    schemas: list[dict[str, Any]] = []
    for _ in range(2):
        (chunks,) = struct.unpack_from(">i", data, at)
        at += 4
        text = ""
        for _ in range(chunks):
            part, at = _read_utf(data, at)
            text += part
        schemas.append(json.loads(text))
    return schemas[0], schemas[1]


def parse_operator_states(files: Mapping[str, Callable[[], bytes]]) -> tuple[OperatorState, ...]:
    """The stateful operators of a checkpoint given as its files (path inside the checkpoint -> a reader), as a
    snapshot holds them: only ``state/<opId>/_metadata/metadata`` and ``state/<opId>/0/_metadata/schema`` are read."""
    ops: dict[int, OperatorState] = {}
    for path in files:
        parts = path.split("/")
        if len(parts) < 2 or parts[0] != "state" or not parts[1].isdigit():
            continue
        op_id = int(parts[1])
        op = ops.setdefault(op_id, OperatorState(op_id, "unknown"))
        if parts[2:] == ["_metadata", "metadata"]:
            lines = files[path]().decode("utf-8").splitlines()
            info = json.loads(lines[1]) if len(lines) > 1 else {}
            ops[op_id] = OperatorState(op_id, str(info.get("operatorInfo", {}).get("operatorName", "unknown")),
                                       op.key, op.value)
        elif parts[2:] == ["0", "_metadata", "schema"]:
            key, value = _read_v2_schema(files[path]())
            ops[op_id] = OperatorState(op_id, ops[op_id].operator, key, value)
    return tuple(ops[i] for i in sorted(ops))


def own_operator_states(frame: Any, inputs: Sequence[Any]) -> tuple[OperatorState, ...] | None:
    """The stateful operators of a stage that runs as its own query, from its composed DataFrame (everything from
    the sources up to it) and its inputs' composed DataFrames: its own operators come first in Spark's numbering
    (its nodes are above its inputs' in the plan), the rest belong to the stages upstream. None: not derived."""
    mine = new_operator_states(frame)
    upstream = [new_operator_states(f) for f in inputs]
    if mine is None or any(u is None for u in upstream):
        return None
    count = len(mine) - sum(len(u) for u in upstream if u is not None)
    return mine[:count] if count >= 0 else None


def read_operator_states(checkpoint: str | FileSystem) -> tuple[OperatorState, ...]:
    """The stateful operators of one query's checkpoint folder (a snapshot's or a dry run's), by operator id."""
    fs = FileSystem.of(checkpoint)
    if not fs.is_dir("state"):
        return ()
    out: list[OperatorState] = []
    for entry in fs.list_dir("state"):
        if not entry.name.isdigit():
            continue
        op = f"state/{entry.name}"
        name = "unknown"
        if fs.exists(f"{op}/_metadata/metadata"):
            lines = fs.read_bytes(f"{op}/_metadata/metadata").decode("utf-8").splitlines()
            info = json.loads(lines[1]) if len(lines) > 1 else {}
            name = str(info.get("operatorInfo", {}).get("operatorName", "unknown"))
        key = value = None
        if fs.exists(f"{op}/0/_metadata/schema"):
            key, value = _read_v2_schema(fs.read_bytes(f"{op}/0/_metadata/schema"))
        out.append(OperatorState(int(entry.name), name, key, value))
    return tuple(sorted(out, key=lambda o: o.op_id))


# Spark's operator names (OperatorStateMetadata) for the logical nodes this module derives schemas for
_OPERATORS = {"Aggregate": "stateStoreSave", "Deduplicate": "dedupe",
              "DeduplicateWithinWatermark": "dedupeWithinWatermark"}
# stateful nodes whose state schemas are not derived here: a query with one is not checked (None)
_UNDERIVED = {"Join", "FlatMapGroupsWithState", "TransformWithState", "FlatMapGroupsInPandasWithState",
              "TransformWithStateInPySpark", "SessionWindowing", "EventTimeWatermark"}
_DUMMY = {"type": "struct", "fields": [{"name": "__dummy__", "type": "void", "nullable": True, "metadata": {}}]}


def _java_list(seq: Any) -> list[Any]:
    it = seq.iterator()
    out = []
    while it.hasNext():
        out.append(it.next())
    return out


def _struct(exprs: list[Any], names: list[str]) -> dict[str, Any]:
    return {"type": "struct", "fields": [
        {"name": n, "type": json.loads(e.dataType().json()), "nullable": bool(e.nullable()), "metadata": {}}
        for e, n in zip(exprs, names, strict=True)]}


def _aggregates(expr: Any, into: list[Any]) -> None:
    if expr.nodeName() == "AggregateExpression":
        if all(not expr.semanticEquals(seen) for seen in into):  # Spark plans each distinct aggregate once
            into.append(expr)
        return
    for child in _java_list(expr.children()):
        _aggregates(child, into)


def new_operator_states(df: Any) -> tuple[OperatorState, ...] | None:
    """The stateful operators a streaming DataFrame's query would write, from its optimized plan, numbered as Spark
    numbers them (the plan's stateful nodes in pre-order); None where the plan has a stateful node this module does
    not derive (a join, arbitrary state, a session window): such a stage is not checked."""
    out: list[OperatorState] = []
    # optimized, not analyzed: the optimizer prunes aggregates nothing reads, and Spark keys state by what is left
    # (QueryExecution.optimizedPlan refuses a streaming plan outside a started query: the session's optimizer does not)
    analyzed = df._jdf.queryExecution().analyzed()
    stack = [df.sparkSession._jsparkSession.sessionState().optimizer().execute(analyzed)]
    while stack:
        node = stack.pop()
        name = node.nodeName()
        if node.isStreaming() and name in _UNDERIVED - {"EventTimeWatermark"}:
            return None
        if node.isStreaming() and name == "Aggregate":
            keys = _java_list(node.groupingExpressions())
            aggs: list[Any] = []
            for e in _java_list(node.aggregateExpressions()):
                _aggregates(e, aggs)
            buffer = [b for a in aggs for b in _java_list(a.aggregateFunction().aggBufferAttributes())]
            out.append(OperatorState(len(out), _OPERATORS[name], _struct(keys, [str(k.prettyName()) for k in keys]),
                                     _struct(buffer, [str(b.name()) for b in buffer])))
        elif node.isStreaming() and name in _OPERATORS:
            keys = _java_list(node.keys())
            out.append(OperatorState(len(out), _OPERATORS[name], _struct(keys, [str(k.name()) for k in keys]),
                                     _DUMMY))
        stack.extend(reversed(_java_list(node.children())))
    return tuple(out)
