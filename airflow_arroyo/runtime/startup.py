"""How long a run's start took, phase by phase.

The driver notes when each step of its start ended (the names :attr:`PipelineDriver.on_step` sees, seconds
since ``run()`` began: :attr:`PipelineDriver.step_times`); :func:`start_phases` turns them into the durations
of the phases a restore or a cold start goes through, so that a benchmark can set a restore's phases beside a
cold start's (``benchmarks/state_scale.py``) and a log line can say where a slow start spent its time.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["PHASES", "start_phases"]

#: the phases of a start, in order (a cold start has no check, rebuild or roll_forward)
PHASES = ("plan", "check", "rebuild", "roll_forward", "queries", "first_batch")

# the step that ends each phase
_ENDS = {"plan": "registered", "check": "verified", "rebuild": "committed", "roll_forward": "restored",
         "queries": "queries-started", "first_batch": "warm"}


def start_phases(steps: Mapping[str, float]) -> dict[str, float]:
    """Seconds each phase of a start took, from ``steps`` (step name -> seconds since the start when it ended).

    * ``plan``: Spark's analysis of the stages, the restore decision, registering the run;
    * ``check``: removing what a killed run left, every channel holds the epoch's barrier, every sink's cut;
    * ``rebuild``: every restored stage's checkpoint rebuilt from its objects (copied or hard-linked, each
      verified by size and SHA-256) and the restore's commit point;
    * ``roll_forward``: checkpoint pointers switched, channels cut at the barrier, sinks rolled back;
    * ``queries``: every stage's query built and started until it initialized its sources;
    * ``first_batch``: until every query completed its first micro-batch, where a restored stateful stage's
      state store loads its state.

    Only the phases whose end step is in ``steps`` are returned, each from the end of the one before."""
    out: dict[str, float] = {}
    previous = 0.0
    for phase in PHASES:
        end = steps.get(_ENDS[phase])
        if end is None:
            continue
        out[phase] = max(0.0, end - previous)
        previous = end
    return out
