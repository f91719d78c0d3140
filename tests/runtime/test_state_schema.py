"""State schema compatibility of an upgrade (``runtime/state_schema.py``), without Spark: the rule mirrors Spark's
``StateStoreSchemaCompatibilityChecker`` (operator, then key, then value; names may differ, types and order may
not, nullability only narrows), ``plan_upgrade`` refuses the stage by name with it, and the reader parses Spark's
``v2`` schema file and operator metadata as Spark writes them."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest

from airflow_arroyo.runtime.decisions import StageAction, plan_upgrade
from airflow_arroyo.runtime.state_schema import OperatorState, read_operator_states, schema_refusal, stage_refusal


def struct_of(*fields: tuple[str, Any, bool]) -> dict[str, Any]:
    return {"type": "struct", "fields": [{"name": n, "type": t, "nullable": null, "metadata": {}}
                                         for n, t, null in fields]}


KEY = struct_of(("k", "long", True))
VALUE = struct_of(("count", "long", False), ("sum", "long", True))


def agg(key: dict[str, Any] = KEY, value: dict[str, Any] = VALUE, op: str = "stateStoreSave") -> OperatorState:
    return OperatorState(0, op, key, value)


@pytest.mark.parametrize(("new", "refused_because"), [
    (agg(), None),
    (agg(key=struct_of(("key_renamed", "long", True))), None),  # names may differ
    (agg(value=struct_of(("n", "long", False), ("total", "long", True))), None),
    (agg(value=struct_of(("count", "long", False), ("sum", "long", False))), None),  # narrower nullability
    (agg(value=struct_of(("count", "long", True), ("sum", "long", True))), "value schema"),  # widened: refused
    (agg(key=struct_of(("k", "string", True))), "key schema"),
    (agg(key=struct_of(("k", "long", True), ("j", "long", True))), "key schema"),
    (agg(value=struct_of(("count", "long", False))), "value schema"),
    (agg(value=struct_of(("sum", "long", True), ("count", "long", False))), "value schema"),  # order matters
    (agg(op="dedupe"), "was 'stateStoreSave' in the epoch and is 'dedupe'"),
])
def test_the_rule_mirrors_sparks_check(new: OperatorState, refused_because: str | None) -> None:
    why = schema_refusal(agg(), new)
    if refused_because is None:
        assert why is None
    else:
        assert why is not None and refused_because in why


def test_nested_types_follow_the_same_rule() -> None:
    arr = {"type": "array", "elementType": "long", "containsNull": False}
    wide = {"type": "array", "elementType": "long", "containsNull": True}
    stored = agg(value=struct_of(("xs", arr, True)))
    assert schema_refusal(stored, agg(value=struct_of(("ys", arr, True)))) is None
    assert schema_refusal(stored, agg(value=struct_of(("xs", wide, True)))) is not None
    m = {"type": "map", "keyType": "string", "valueType": "long", "valueContainsNull": True}
    assert schema_refusal(agg(value=struct_of(("m", m, True))),
                          agg(value=struct_of(("m", {**m, "valueType": "int"}, True)))) is not None


def test_a_stage_is_checked_operator_by_operator() -> None:
    assert stage_refusal([agg()], [agg()]) is None
    assert stage_refusal([], [agg()]) is None  # a stage without state before: nothing to load
    gone = stage_refusal([agg()], [])
    assert gone is not None and "not in the new code's query" in gone
    more = stage_refusal([agg()], [agg(), OperatorState(1, "dedupe", KEY, VALUE)])
    assert more is not None and "state operator 1 (dedupe) is new" in more


def test_plan_upgrade_refuses_a_changed_key_by_name_and_restores_a_compatible_change() -> None:
    changed = agg(key=struct_of(("k", "long", True), ("region", "string", True)))
    plan = plan_upgrade(7, ["src", "totals", "out"], {s: s for s in ("src", "totals", "out")},
                        state_schemas={"totals": ([agg()], [changed]), "src": ([], [])})
    rows = {r.stage: r for r in plan.stages}
    assert not plan.restores
    assert rows["totals"].action is StageAction.INCOMPATIBLE and rows["totals"].refused
    assert "state operator 0 (stateStoreSave): key schema (k: long) in the epoch, (k: long, region: string)" \
        in rows["totals"].reason
    assert "allow_dropped_state=['totals']" in rows["totals"].reason
    assert rows["src"].action is StageAction.RESTORED and rows["out"].action is StageAction.RESTORED
    renamed_cols = agg(value=struct_of(("n", "long", False), ("total", "long", True)))
    ok = plan_upgrade(7, ["src", "totals", "out"], {s: s for s in ("src", "totals", "out")},
                      state_schemas={"totals": ([agg()], [renamed_cols])})
    assert ok.restores and {r.stage: r.action for r in ok.stages}["totals"] is StageAction.RESTORED


def _utf(text: str) -> bytes:
    raw = text.encode("utf-8")
    return struct.pack(">H", len(raw)) + raw


def write_spark_checkpoint(root: Path, op_id: int, operator: str, key: dict[str, Any], value: dict[str, Any]) -> None:
    """The two files as Spark 4 writes them (OperatorStateMetadataV1's writer, SchemaV2Writer)."""
    meta = root / "state" / str(op_id) / "_metadata"
    meta.mkdir(parents=True)
    (meta / "metadata").write_text("v1\n" + json.dumps({
        "operatorInfo": {"operatorId": op_id, "operatorName": operator},
        "stateStoreInfo": [{"storeName": "default", "numColsPrefixKey": 0, "numPartitions": 4}]}))
    schema = root / "state" / str(op_id) / "0" / "_metadata"
    schema.mkdir(parents=True)
    body = _utf("v2")
    for s in (key, value):
        text = json.dumps(s, separators=(",", ":"))
        chunks = [text[i:i + 7] for i in range(0, len(text), 7)]  # several chunks, as a long schema is written
        body += struct.pack(">i", len(chunks)) + b"".join(_utf(c) for c in chunks)
    (schema / "schema").write_bytes(body)


def test_the_reader_parses_sparks_files(tmp_path: Path) -> None:
    write_spark_checkpoint(tmp_path, 0, "stateStoreSave", KEY, VALUE)
    write_spark_checkpoint(tmp_path, 1, "dedupe", KEY, struct_of(("__dummy__", "void", True)))
    (tmp_path / "offsets").mkdir()
    assert read_operator_states(str(tmp_path)) == (
        OperatorState(0, "stateStoreSave", KEY, VALUE),
        OperatorState(1, "dedupe", KEY, struct_of(("__dummy__", "void", True))))
    assert read_operator_states(str(tmp_path / "offsets")) == ()
