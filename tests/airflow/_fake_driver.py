"""A stand-in pipeline driver that speaks the driver's protocol with the epoch store, without Spark.

Used by the operator/sensor tests as the spark-submit application (spark-submit runs it like the
real driver) or as a plain process. Same arguments as ``airflow_arroyo/runtime/driver.py``:
``--pipeline module:<pipeline_id> --run-id X [--restore-from ...] [--storage-uri ...] [--takeover]``; the DSN comes
from ``ARROYO_DSN``. Behaviour knobs (environment):

* ``FAKE_EXIT_BEFORE_REGISTER=msg``: print msg and exit 3 before registering.
* ``FAKE_EPOCH_INTERVAL=s``: trigger an epoch every s seconds itself (as the checkpoint trigger
  would) and acknowledge it from every stage.
* ``FAKE_HOLD_EPOCHS=1``: never acknowledge an epoch (one started stays in flight, as in a slow snapshot).
* ``FAKE_FAIL_AFTER_EPOCHS=n``: after n completed epochs, mark the pipeline failed
  (cause ``FAKE_FAIL_CAUSE``) and exit 1.
* ``FAKE_SINK_URI=uri``: record a commit of a file sink ``sink`` at that URI for every completed
  epoch (epoch n commits batch n with n rows, 100 * n bytes), as the real driver does after moving files.
* ``FAKE_STAGES=a,b``: the stages it registers and acknowledges epochs from (default ``STAGES``), as new code
  with renamed stages would.

``--rename``, ``--allow-dropped-state`` and ``--rescale`` (an upgrade's restore) are not acted on, only recorded in
the registered ``config`` (lists of the values given), so a test can read what a run was given.

It stops on ``request_stop``: graceful takes a final epoch first.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from airflow_arroyo.core.epochs import CheckpointPolicy, PipelineState
from airflow_arroyo.store import EpochStore

STAGES = ["source", "sink"]


def _commit_sink(store: EpochStore, pipeline_id: str, epoch: int, run_id: str) -> None:
    uri = os.environ.get("FAKE_SINK_URI")
    if uri:
        store.record_sink_commit(pipeline_id, epoch, "sink", uri=uri, batch_id=epoch, files=1, rows=epoch,
                                 bytes_committed=100 * epoch, run_id=run_id)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pipeline", required=True)
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--restore-from")
    parser.add_argument("--storage-uri")
    parser.add_argument("--takeover", action="store_true")
    for upgrade_option in ("--rename", "--allow-dropped-state", "--rescale"):
        parser.add_argument(upgrade_option, action="append", default=[])
    args, _ = parser.parse_known_args()
    stages = os.environ.get("FAKE_STAGES", "").split(",") if os.environ.get("FAKE_STAGES") else STAGES
    pipeline_id = args.pipeline.rsplit(":", 1)[-1]
    if os.environ.get("FAKE_EXIT_BEFORE_REGISTER"):
        print(os.environ["FAKE_EXIT_BEFORE_REGISTER"], flush=True)
        return 3
    store = EpochStore(os.environ["ARROYO_DSN"], max_connections=2)
    store.migrate()
    store.register_pipeline(pipeline_id, stages=stages, run_id=args.run_id, storage_uri=args.storage_uri,
                            config={"restore_from": args.restore_from, "pid": os.getpid(), "rename": args.rename,
                                    "allow_dropped_state": args.allow_dropped_state, "rescale": args.rescale},
                            takeover=args.takeover)
    store.heartbeat(pipeline_id, args.run_id, spark_app_id=f"local-fake-{os.getpid()}",
                    spark_ui_url="http://127.0.0.1:4040")
    store.set_pipeline_state(pipeline_id, PipelineState.RUNNING, run_id=args.run_id)
    print(f"fake driver: {pipeline_id} run {args.run_id} running (restore_from={args.restore_from})", flush=True)
    interval = float(os.environ.get("FAKE_EPOCH_INTERVAL", "0") or 0)
    fail_after = int(os.environ.get("FAKE_FAIL_AFTER_EPOCHS", "0") or 0)
    policy = CheckpointPolicy(interval=interval) if interval > 0 else None
    completed = 0
    while True:
        pipe = store.get_pipeline(pipeline_id)
        if pipe.run_id != args.run_id:
            return 2
        in_flight = store.in_flight_epoch(pipeline_id)
        if in_flight is not None and not os.environ.get("FAKE_HOLD_EPOCHS"):
            for stage in stages:
                store.ack_epoch(pipeline_id, in_flight.epoch, stage, cursors={}, bytes_new=10, bytes_total=100)
            _commit_sink(store, pipeline_id, in_flight.epoch, args.run_id)
            completed += 1
            if fail_after and completed >= fail_after:
                store.set_pipeline_state(pipeline_id, PipelineState.FAILED, run_id=args.run_id,
                                         failure_cause=os.environ.get("FAKE_FAIL_CAUSE", "fake failure"))
                return 1
            continue
        if pipe.stop_requested:
            if pipe.stop_requested == "graceful":
                tick = store.trigger_tick(pipeline_id, CheckpointPolicy(interval=1.0), triggered_by="final",
                                          force=True, is_final=True)
                if tick.started is not None:
                    for stage in stages:
                        store.ack_epoch(pipeline_id, tick.started.epoch, stage)
                    _commit_sink(store, pipeline_id, tick.started.epoch, args.run_id)
            if pipe.state is PipelineState.RUNNING:
                store.set_pipeline_state(pipeline_id, PipelineState.STOPPING, run_id=args.run_id)
            store.set_pipeline_state(pipeline_id, PipelineState.STOPPED, run_id=args.run_id)
            print(f"fake driver: {pipeline_id} stopped ({pipe.stop_requested})", flush=True)
            return 0
        if policy is not None:
            store.trigger_tick(pipeline_id, policy, triggered_by="fake-driver")
        store.heartbeat(pipeline_id, args.run_id)
        time.sleep(0.1)


if __name__ == "__main__":
    sys.exit(main())
