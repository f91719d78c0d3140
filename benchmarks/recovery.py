"""Recovery under Airflow: SIGKILL a supervised driver, how long until the pipeline completes an epoch again?

Everything real, on one machine: a throwaway PostgreSQL, ``airflow standalone`` (scheduler, triggerer,
dag-processor, api-server, LocalExecutor with ``--parallelism`` slots) from :mod:`airflow_arroyo.devtools.embedded`,
and the example DAG ``example_streaming_pipeline``: the demo pipeline (two paced generators, a stream-stream join,
the report channel, an exactly-once Parquet sink whose commits schedule ``example_committed_report``, a DAG run per
commit) submitted with spark-submit in local mode, supervised in the triggerer (fixed-delay, ``--delay`` s), an
epoch every ``--interval`` s from the checkpoint trigger.

``--kills`` times: once the current run has completed ``--epochs-before`` epochs, wait a random part of an interval
(``--seed``), SIGKILL the run's spark-submit process group (the driver JVM and its Python driver), then follow the
epoch store until the restarted run has completed ``--epochs-after`` epochs. Per kill, from the kill (this host's
clock, the database's timestamps: the same clock here):

* ``noticed``: the supervisor recorded the failure (``arroyo_restarts.failed_at``);
* ``resubmitted``: the restart was recorded, right after its spark-submit started (``restarted_at``); the part
  after ``noticed + delay`` is the resubmission's own lag (with the event path: the task's wait for a worker slot
  and its start in it);
* ``running``: the new run went ``running`` (polled every 0.2 s);
* ``first epoch``: the new run's first completed epoch ended: **kill to the next completed epoch**;
* ``restart -> first epoch``: from ``resubmitted`` to that end, against ``later epoch``, the median duration
  (triggered to ended) of the run's later completed epochs.

Prints a line of JSON per kill, then the p50 and max over the kills; ``--results FILE`` also writes them as
Markdown with the command that produced them (``benchmarks/results/recovery.md``).

    python benchmarks/recovery.py                                   # 10 kills, ~15-25 minutes on 2 busy cores
    python benchmarks/recovery.py --kills 3 --interval 3            # shorter
    python benchmarks/recovery.py --results benchmarks/results/recovery.md
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import random
import shlex
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from airflow_arroyo.core.epochs import EpochState, PipelineState
from airflow_arroyo.core.exceptions import UnknownPipelineError
from airflow_arroyo.core.processes import LocalProcess
from airflow_arroyo.devtools.embedded import EXAMPLE_DAG, PIPELINE_ID, EmbeddedAirflow, EmbeddedSettings
from airflow_arroyo.operators.pipeline import driver_log_path
from airflow_arroyo.store import EpochRecord, EpochStore, PipelineRecord, RestartRecord

FIGURES = ("noticed", "resubmitted", "running", "first_epoch", "restart_to_first_epoch", "later_epoch")


def _say(message: str) -> None:
    print(f"[recovery] {message}", flush=True)


class Follower:
    """Reads the demo pipeline's record, epochs and restarts from the epoch store."""

    def __init__(self, dsn: str) -> None:
        self.store = EpochStore(dsn, max_connections=2, retry_seconds=30.0)

    def pipeline(self) -> PipelineRecord | None:
        try:
            return self.store.get_pipeline(PIPELINE_ID)
        except UnknownPipelineError:
            return None

    def completed(self, run_id: str) -> list[EpochRecord]:
        """The run's completed epochs, oldest first."""
        return sorted((e for e in self.store.list_epochs(PIPELINE_ID, limit=200)
                       if e.run_id == run_id and e.state is EpochState.COMPLETED), key=lambda e: e.epoch)

    def restart(self, attempt: int) -> RestartRecord | None:
        return next((r for r in self.store.restarts(PIPELINE_ID) if r.attempt == attempt), None)

    def wait(self, condition: Any, what: str, timeout: float, airflow: EmbeddedAirflow) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            value = condition()
            if value:
                return value
            if airflow.process is not None and airflow.process.poll() is not None:
                raise RuntimeError(f"airflow standalone exited; see {airflow.log_path}")
            record = self.pipeline()
            if record is not None and record.supervision in ("gave_up", "ended"):
                raise RuntimeError(f"the supervision ended ({record.supervision}) while waiting for {what}: "
                                   f"{record.failure_cause}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out after {timeout:g}s waiting for {what}")
            time.sleep(0.2)

    def close(self) -> None:
        self.store.close()


def _spark_submit(home: Path, run_id: str) -> LocalProcess:
    """The run's spark-submit, from the pid file the submit operator wrote beside its log (pid, start time, host)."""
    pid_file = driver_log_path(PIPELINE_ID, run_id, str(home / "logs" / "arroyo")).with_suffix(".pid")
    pid, ticks, host = pid_file.read_text().split()
    return LocalProcess(int(pid), host, int(ticks) if ticks.isdigit() else None)


def _since(t0: float, at: dt.datetime | None) -> float | None:
    return None if at is None else round(at.timestamp() - t0, 2)


def one_kill(k: int, follow: Follower, airflow: EmbeddedAirflow, args: argparse.Namespace,
             rng: random.Random) -> dict[str, Any]:
    """Kill the current run once it completed --epochs-before epochs; follow its restart."""
    record = follow.wait(lambda: (p := follow.pipeline()) is not None and p.state is PipelineState.RUNNING and p,
                         "a running run", args.timeout, airflow)
    run = str(record.run_id)
    follow.wait(lambda: len(follow.completed(run)) >= args.epochs_before, f"{args.epochs_before} epochs of {run}",
                args.timeout, airflow)
    time.sleep(rng.uniform(0, args.interval))  # a random moment of the epoch cycle, not a wait for anything
    process = _spark_submit(airflow.home, run)
    t_kill = time.time()
    if not process.signal_group(signal.SIGKILL):
        raise RuntimeError(f"run {run}: its spark-submit process group {process.pid} is gone already")
    _say(f"kill {k}: SIGKILLed run {run} (process group {process.pid})")
    restart = follow.wait(lambda: (r := follow.restart(k)) is not None and r.new_run_id is not None and r,
                          f"restart {k}", args.timeout, airflow)
    new_run = str(restart.new_run_id)
    t_running = follow.wait(lambda: (p := follow.pipeline()) is not None and p.run_id == new_run
                            and p.state is PipelineState.RUNNING and time.time(), f"run {new_run} running",
                            args.timeout, airflow)
    epochs = follow.wait(lambda: (e := follow.completed(new_run)) and len(e) >= args.epochs_after and e,
                         f"{args.epochs_after} epochs of {new_run}", args.timeout, airflow)
    first = epochs[0]
    later = [e.duration_s for e in epochs[1:] if e.duration_s is not None]
    resubmitted = _since(t_kill, restart.restarted_at)
    first_end = _since(t_kill, first.ended_at)
    result = {
        "kill": k, "run": run, "new_run": new_run, "restored_epoch": restart.restored_epoch,
        "noticed": _since(t_kill, restart.failed_at), "delay": restart.delay_s, "resubmitted": resubmitted,
        "running": round(t_running - t_kill, 2), "first_epoch": first_end,
        "first_epoch_duration": first.duration_s,
        "restart_to_first_epoch": (None if first_end is None or resubmitted is None
                                   else round(first_end - resubmitted, 2)),
        "later_epoch": round(statistics.median(later), 2) if later else None,
        "cause": restart.cause.splitlines()[0][:160],
    }
    print(json.dumps(result), flush=True)
    return result


def summary(results: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for key in FIGURES:
        values = [r[key] for r in results if r.get(key) is not None]
        if values:
            out[key] = {"p50": round(statistics.median(values), 1), "max": round(max(values), 1)}
    return out


def markdown(results: list[dict[str, Any]], command: str, started: str, load: str) -> str:
    rows = summary(results)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).resolve().parents[1]).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True,
                           cwd=Path(__file__).resolve().parents[1]).stdout.strip()
    lines = [
        "# Recovery under Airflow (`benchmarks/recovery.py`)",
        "",
        f"Command: `{command}`",
        "",
        f"Run {started} at commit `{commit}`{' with uncommitted changes in the tree' if dirty else ''}, 2 cores, "
        f"load average at the start / end: {load}. Seconds from the SIGKILL (p50 and max over {len(results)} kills; "
        "see the benchmark's docstring for what each figure is).",
        "",
        "| figure | p50 | max |",
        "|---|---|---|",
        *[f"| {key.replace('_', ' ')} | {v['p50']} | {v['max']} |" for key, v in rows.items()],
        "",
        "Per kill:",
        "",
        "| kill | noticed | resubmitted | running | first epoch | restart -> first epoch | later epoch | cause |",
        "|---|---|---|---|---|---|---|---|",
        *[f"| {r['kill']} | {r['noticed']} | {r['resubmitted']} | {r['running']} | {r['first_epoch']} | "
          f"{r['restart_to_first_epoch']} | {r['later_epoch']} | {r['cause'].replace('|', '/')} |" for r in results],
        "",
    ]
    return "\n".join(lines)


def _load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    rng = random.Random(args.seed)
    strategy = {"type": "fixed-delay", "attempts": args.kills + 5, "delay": args.delay}
    settings = EmbeddedSettings(parallelism=args.parallelism, retention_schedule="*/5 * * * *")
    results: list[dict[str, Any]] = []
    with EmbeddedAirflow(settings) as airflow:
        follow = Follower(airflow.store_dsn)
        try:
            dag_run = airflow.trigger(EXAMPLE_DAG, conf={
                "interval": args.interval, "epochs": 100_000, "minutes": 600, "rows": 100_000_000,
                "rows_per_batch": args.rows_per_batch, "trigger_interval": 1.0,
                "restart_strategy": json.dumps(strategy)})
            _say(f"triggered {EXAMPLE_DAG} run {dag_run}; Airflow at {airflow.base_url} (home {airflow.home})")
            for k in range(1, args.kills + 1):
                results.append(one_kill(k, follow, airflow, args, rng))
        finally:
            follow.close()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--interval", type=float, default=3.0, help="seconds between checkpoint epochs")
    parser.add_argument("--delay", type=float, default=2.0, help="the restart strategy's delay (fixed-delay)")
    parser.add_argument("--epochs-before", type=int, default=2, help="completed epochs of a run before its kill")
    parser.add_argument("--epochs-after", type=int, default=3, help="completed epochs of a restart followed")
    parser.add_argument("--rows-per-batch", type=int, default=500, help="rows per source micro-batch (1 a second)")
    parser.add_argument("--parallelism", type=int, default=4, help="Airflow's task slots (LocalExecutor)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for any one step")
    parser.add_argument("--seed", type=int, default=30)
    parser.add_argument("--results", type=Path, default=None, help="also write the results here (Markdown)")
    args = parser.parse_args(argv)
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    command = " ".join(["python", "benchmarks/recovery.py", *map(shlex.quote, sys.argv[1:] if argv is None else argv)])
    started, load_before = dt.datetime.now().strftime("%Y-%m-%d %H:%M"), _load()
    results = run(args)
    print(json.dumps({"summary": summary(results)}), flush=True)
    if args.results is not None:
        args.results.parent.mkdir(parents=True, exist_ok=True)
        args.results.write_text(markdown(results, command, started, f"{load_before} / {_load()}"))
        _say(f"wrote {args.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
