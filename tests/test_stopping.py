"""airflow_arroyo.core.stopping's wait, against a store that answers a scripted sequence of records (the store is
ours; the real one is exercised through the CLI and the operator in tests/controlplane and tests/airflow)."""

from __future__ import annotations

from typing import Any

from airflow_arroyo.core.epochs import PipelineState
from airflow_arroyo.core.stopping import wait_until_ended
from airflow_arroyo.store.records import PipelineRecord


class _Answers:
    """get_pipeline answers the records in turn, then the last one for ever."""

    def __init__(self, *records: PipelineRecord) -> None:
        self.records = list(records)

    def get_pipeline(self, _pipeline_id: str) -> PipelineRecord:
        return self.records.pop(0) if len(self.records) > 1 else self.records[0]


def _run(run_id: str, state: PipelineState = PipelineState.RUNNING, **kwargs: Any) -> PipelineRecord:
    return PipelineRecord("p", state, run_id=run_id, **kwargs)


def test_a_run_registered_meanwhile_means_ours_ended() -> None:
    ours = _run("r1", stop_requested="graceful")
    end = wait_until_ended(_Answers(_run("r1", PipelineState.STOPPING), _run("r2")), ours, 5, poll=0.01)  # type: ignore[arg-type]
    assert (end.ended, end.superseded_by, end.record.run_id) == (True, "r2", "r1")


def test_the_run_ends_or_the_wait_does() -> None:
    end = wait_until_ended(_Answers(_run("r1", PipelineState.STOPPED)), _run("r1"), 5, poll=0.01)  # type: ignore[arg-type]
    assert (end.ended, end.superseded_by, end.record.state) == (True, None, PipelineState.STOPPED)
    still = wait_until_ended(_Answers(_run("r1", PipelineState.STOPPING)), _run("r1"), 0.05, poll=0.01)  # type: ignore[arg-type]
    assert (still.ended, still.record.state) == (False, PipelineState.STOPPING)
