"""The store by concern: ``EpochStore`` is the facade of its parts, and the async store is derived from it.

* Every public operation of every part is a method of the facade, and that method is the part's (same
  function underneath: same name, signature and docstring), so nothing can be added to a part and
  forgotten on the facade, nor the other way round.
* Each method of ``AsyncEpochStore`` but the three of its own is the sync method of that name, awaited
  in a worker thread; the triggers reach the store only through it.
* A request that finds the store's rows in the wrong state raises ``StateConflictError``, a
  ``ConfigurationError`` as before.
"""

from __future__ import annotations

import ast
import inspect
import threading
from pathlib import Path

import pytest

import airflow_arroyo
from airflow_arroyo.core.epochs import CheckpointPolicy
from airflow_arroyo.core.exceptions import ConfigurationError, StateConflictError
from airflow_arroyo.store import AsyncEpochStore, EpochStore
from airflow_arroyo.store._db import Concern
from tests.support import running

NOWHERE = "postgresql://nobody@127.0.0.1:1/none"  # never connected to: building a store makes no connection
PARTS = {name: type(part) for name, part in vars(EpochStore(NOWHERE)).items() if isinstance(part, Concern)}


def _public_functions(cls: type) -> dict[str, object]:
    """The functions of ``cls``'s own public methods (a static method's too)."""
    return {name: fn.__func__ if isinstance(fn, staticmethod) else fn for name, fn in vars(cls).items()
            if not name.startswith("_") and inspect.isfunction(getattr(fn, "__func__", fn))}


def test_the_store_has_one_part_per_concern() -> None:
    assert sorted(PARTS) == ["cleanup", "epochs", "gates", "objects", "pins", "pipelines", "schema", "shadows", "sinks",
                             "supervision", "ticks"]


@pytest.mark.parametrize("attr", sorted(PARTS))
def test_every_operation_of_a_part_is_the_facade_method_of_that_name(attr: str) -> None:
    part = PARTS[attr]
    functions = _public_functions(part)
    assert functions, part
    for name, fn in functions.items():
        facade = vars(EpochStore).get(name)
        assert facade is not None, f"{part.__name__}.{name} is not on EpochStore"
        if isinstance(facade, staticmethod):
            assert facade.__func__ is fn, name
        else:
            assert getattr(facade, "__wrapped__", None) is fn, f"EpochStore.{name} does not call {attr}.{name}"
            assert facade.__doc__ == fn.__doc__ and facade.__name__ == name  # type: ignore[attr-defined]


def test_every_delegate_of_the_facade_belongs_to_a_part() -> None:
    owned = {fn for part in PARTS.values() for fn in _public_functions(part).values()}
    delegates = {name: fn.__wrapped__ for name, fn in vars(EpochStore).items() if hasattr(fn, "__wrapped__")}
    assert len(delegates) > 50
    assert {name for name, fn in delegates.items() if fn not in owned} == set()


def test_a_facade_call_reaches_the_part_of_that_store() -> None:
    store = EpochStore(NOWHERE)

    class Probe:
        def get_pipeline(self, pipeline_id: str) -> str:
            return f"probe {pipeline_id}"

    store.pipelines = Probe()  # type: ignore[assignment]
    assert store.get_pipeline("p") == "probe p"


ASYNC_OWN = {"trigger_tick", "subscribe", "call"}


def test_the_async_store_is_the_sync_methods_awaited() -> None:
    derived = {name: fn for name, fn in vars(AsyncEpochStore).items()
               if inspect.iscoroutinefunction(fn) and not name.startswith("_") and name not in ASYNC_OWN}
    assert {"get_pipeline", "record_failure", "fail_run", "end_supervision", "expire_restart", "db_now"} <= set(derived)
    for name, fn in derived.items():
        assert fn.__wrapped__ is getattr(EpochStore, name), name
        assert fn.__doc__ == getattr(EpochStore, name).__doc__


async def test_an_async_call_runs_the_stores_own_method_in_a_worker_thread() -> None:
    class Probe(EpochStore):
        def restarts(self, pipeline_id: str, lineage: str | None = None, limit: int = 200) -> list[object]:
            return [threading.get_ident(), pipeline_id, lineage, limit]

    store = Probe(NOWHERE)
    thread, *args = await AsyncEpochStore(store).restarts("p", "l", limit=1)
    assert thread != threading.get_ident() and args == ["p", "l", 1]

    def procedure(sync: EpochStore, pipeline_id: str, *, mode: str) -> tuple[int, bool, str, str]:
        return threading.get_ident(), sync is store, pipeline_id, mode

    thread, same, pid, mode = await AsyncEpochStore(store).call(procedure, "p", mode="immediate")
    assert thread != threading.get_ident() and same and (pid, mode) == ("p", "immediate")


def test_the_triggers_reach_the_store_only_through_the_async_store() -> None:
    """No ``<store>.sync`` in a trigger: a store call from a trigger is an ``AsyncEpochStore`` method (or
    ``AsyncEpochStore.call`` for a blocking procedure over the store)."""
    triggers = Path(airflow_arroyo.__file__).resolve().parent / "triggers"
    found = [f"{path.name}:{node.lineno}" for path in sorted(triggers.glob("*.py"))
             for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Attribute) and node.attr == "sync"]
    assert not found, found


def test_a_state_conflict_has_a_type_of_its_own_that_is_still_a_configuration_error(store: EpochStore) -> None:
    running(store, "conflicts", stages=["a"])
    tick = store.trigger_tick("conflicts", CheckpointPolicy(interval=3600, timeout=3600), force=True)
    assert tick.started is not None
    epoch = tick.started.epoch  # in flight: not completed
    with pytest.raises(StateConflictError, match="is triggered, not completed"):
        store.pin_epoch("conflicts", epoch, "keep")
    with pytest.raises(StateConflictError, match="is triggered, not completed"):
        store.fork_pipeline("conflicts", epoch, "conflicts-b")
    with pytest.raises(StateConflictError, match="completed no final epoch"):
        store.pin_final_epoch("conflicts", "r1", "keep")
    with pytest.raises(StateConflictError, match="has no failure 1 recorded"):
        store.record_restart("conflicts", "r1", 1, "r1.restart1", None)
    with pytest.raises(ConfigurationError) as bad_input:  # bad input stays a plain ConfigurationError
        store.pin_epoch("conflicts", epoch, " ")
    assert not isinstance(bad_input.value, StateConflictError)
    assert issubclass(StateConflictError, ConfigurationError)
