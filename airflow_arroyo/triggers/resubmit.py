"""A supervised restart submitted from the triggerer: no worker slot, no visit to a worker.

The submit operator, when it defers to :class:`~airflow_arroyo.triggers.supervise.PipelineSupervisorTrigger`
with ``restart_in_triggerer``, hands the trigger a :class:`Resubmission`: the spark-submit command of a restart
(``--restore-from latest --takeover``) with the run id left as :data:`RUN_ID_SLOT`, and the environment entries the
operator sets on top of its own environment. On a restart the trigger fills the run id in, adds the epoch store's
DSN (read from the Airflow connection at that moment, into the process environment: never on the command line)
and starts spark-submit detached (:func:`launch`), as the operator would.

What a :class:`Resubmission` holds goes into the trigger's serialized arguments, which Airflow keeps in its
database: no secret may be in it. The DSN never is (the operator builds the command with none); an environment
entry or a command-line ``KEY=VALUE`` whose name looks like a secret (:data:`SECRET_NAME_PARTS`: Airflow's log
masker's ``password``, ``secret``, ``token``, ``api_key``, ... and ``dsn``, ``airflow_conn_``) makes
:func:`resubmission_of` refuse, and the restart then goes through the task as before (a worker slot). Such
values belong in the triggerer's own environment, like the worker's.

Local and client deploy modes only: there spark-submit is the driver, so the restarted driver runs on the
triggerer's host (hence opt-in). In cluster deploy modes the operator keeps the event path (what a cluster
submission needs, the application handle read from spark-submit's output and, on YARN, the DSN file it ships,
is not proven from the triggerer yet).
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from airflow_arroyo.core.epochs import PipelineState
from airflow_arroyo.core.exceptions import ArroyoError
from airflow_arroyo.core.processes import LocalProcess
from airflow_arroyo.operators.driver_log import start_writer
from airflow_arroyo.store import EpochStore
from airflow_arroyo.submit.deploy import ClusterApplication
from airflow_arroyo.triggers.pipeline import stop_run

__all__ = ["RUN_ID_SLOT", "SECRET_NAME_PARTS", "Resubmission", "end_failed_run", "launch", "log_path_of",
           "restart_attempt", "resubmission_of", "secret_names", "start_detached"]

#: Where the restart's run id goes in the command (its ``--run-id`` value).
RUN_ID_SLOT = "{arroyo_run_id}"
#: The DSN's environment variable: filled in at launch, never serialized.
DSN_ENV = "ARROYO_DSN"


@dataclass(frozen=True)
class Resubmission:
    """What the supervisor trigger needs to submit a restart itself; no secret (see the module's docstring)."""

    pipeline_id: str
    command: list[str]  # spark-submit ... --run-id RUN_ID_SLOT --restore-from latest --takeover ...
    env: dict[str, str]  # set on top of the triggerer's environment
    log_dir: str  # the driver logs' folder: <log_dir>/<pipeline_id>/<run>.log
    drop_env: list[str] = field(default_factory=list)  # removed from the triggerer's environment
    log_max_bytes: int = 64 * 1024 * 1024
    log_backups: int = 5

    def to_dict(self) -> dict[str, Any]:
        """The trigger argument."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> Resubmission | None:
        """From :meth:`to_dict` (None for none)."""
        return cls(**dict(data)) if data else None

    def command_for(self, run_id: str) -> list[str]:
        """The command of run ``run_id``."""
        return [run_id if part == RUN_ID_SLOT else part for part in self.command]


#: Names whose values are secrets: Airflow's log masker's default sensitive fields, and what holds a DSN or a
#: connection (a substring of the name, any case).
SECRET_NAME_PARTS = ("access_token", "api_key", "apikey", "authorization", "passphrase", "passwd", "password",
                     "private_key", "secret", "token", "keyfile_dict", "service_account", "credential", "dsn",
                     "airflow_conn_", "airflow_var_")


def _hidden(name: str) -> bool:
    lowered = name.lower()
    return any(part in lowered for part in SECRET_NAME_PARTS)


def secret_names(command: list[str], env: Mapping[str, str]) -> list[str]:
    """The names, in ``command``'s ``KEY=VALUE`` arguments (``--conf``, ``--arg``) and in ``env``, whose values look
    like secrets."""
    names = [k for k in env if _hidden(k)]
    for part in command:
        key, sep, _ = part.partition("=")
        if sep and _hidden(key):
            names.append(key)
    return names


def resubmission_of(pipeline_id: str, command: list[str], process_env: Mapping[str, str], base_env: Mapping[str, str],
                    *, run_id: str, log_dir: str, log_max_bytes: int, log_backups: int) -> Resubmission | str:
    """A :class:`Resubmission` from a restart's command (built for run ``run_id``) and process environment, against
    ``base_env`` (the operator's own environment: the triggerer has its own); or why not (a string): a value
    that looks like a secret would be serialized."""
    env = {k: v for k, v in process_env.items() if k != DSN_ENV and base_env.get(k) != v}
    drop = sorted(k for k in base_env if k not in process_env and k != DSN_ENV)
    if command.count(run_id) != 1:
        return f"the command names run {run_id!r} {command.count(run_id)} times, not once"
    secrets = secret_names(command, env)
    if secrets:
        return (f"{', '.join(sorted(set(secrets)))} would be kept in the trigger's arguments (Airflow's database); "
                "set them in the triggerer's environment instead, or leave restart_in_triggerer off")
    return Resubmission(pipeline_id, [RUN_ID_SLOT if part == run_id else part for part in command], env, log_dir,
                        drop, int(log_max_bytes), int(log_backups))


def log_path_of(log_dir: str, pipeline_id: str, run_id: str) -> Path:
    """``<log_dir>/<pipeline_id>/<run_id>.log``, the run id made a file name (as the submit operator names it)."""
    return Path(log_dir) / pipeline_id / f"{re.sub(r'[^A-Za-z0-9_.+-]', '_', run_id)}.log"


def start_detached(command: list[str], env: Mapping[str, str], log_path: Path, *, max_bytes: int,
                   backups: int) -> tuple[subprocess.Popen[bytes], subprocess.Popen[bytes]]:
    """Start ``command`` (spark-submit) in a session of its own, so that it outlives whoever started it, its output
    going to ``log_path`` through the size-rotating writer (:mod:`airflow_arroyo.operators.driver_log`); a
    ``<run>.pid`` file beside the log says which process it is (pid, start time, host). Returns spark-submit's and
    the writer's processes."""
    log_dir = log_path.parent
    log_dir.mkdir(parents=True, exist_ok=True)
    writer = start_writer(log_path, max_bytes=max_bytes, backups=backups, cwd=log_dir)
    assert writer.stdin is not None
    try:
        proc = subprocess.Popen(
            command, env=dict(env), stdin=subprocess.DEVNULL, stdout=writer.stdin, stderr=subprocess.STDOUT,
            start_new_session=True, close_fds=True, cwd=log_dir,  # Spark writes spark-warehouse/ etc. here
        )
    except BaseException:
        writer.kill()
        raise
    finally:
        writer.stdin.close()  # spark-submit holds the pipe now: the writer ends when its output does
    process = LocalProcess.of(proc.pid)
    (log_dir / f"{log_path.stem}.pid").write_text(f"{process.pid} {process.start_ticks or ''} {process.host}\n")
    return proc, writer


#: What this process started and does not wait for (reaped once they exit, so none lingers as a zombie).
_CHILDREN: list[subprocess.Popen[bytes]] = []


def launch(resubmission: Resubmission, run_id: str, dsn: str) -> tuple[LocalProcess, Path]:
    """Submit run ``run_id`` (blocking: a trigger calls it in a thread): the environment is this process's, without
    ``drop_env``, with ``env`` and the DSN; spark-submit starts detached. Returns its process and its log."""
    if not dsn:
        raise ArroyoError("the epoch store connection gave no DSN for the restart")
    env = {k: v for k, v in os.environ.items() if k not in resubmission.drop_env}
    env.update(resubmission.env)
    env[DSN_ENV] = dsn
    log_path = log_path_of(resubmission.log_dir, resubmission.pipeline_id, run_id)
    _CHILDREN[:] = [p for p in _CHILDREN if p.poll() is None]
    proc, writer = start_detached(resubmission.command_for(run_id), env, log_path,
                                  max_bytes=resubmission.log_max_bytes, backups=resubmission.log_backups)
    _CHILDREN.extend((proc, writer))
    return LocalProcess.of(proc.pid), log_path


def restart_attempt(lineage: str, run_id: str) -> int:
    """Which restart of ``lineage`` run ``run_id`` is: 0 for the lineage's first run, n for ``<lineage>.restart<n>``
    (-1 for a run of another lineage)."""
    if run_id == lineage:
        return 0
    rest = run_id[len(lineage):] if run_id.startswith(lineage) else ""
    return int(rest[8:]) if rest.startswith(".restart") and rest[8:].isdigit() else -1


def end_failed_run(store: EpochStore, pipeline_id: str, failed_run: str, process: LocalProcess | None,
                   cluster_app: ClusterApplication | None, cause: str, log: Any) -> None:
    """End what is left of a failed run (a hung driver, a half-dead process group, a restart still restoring) and
    record it failed, so that nothing waits on it or starts epochs for it (blocking: a trigger calls it in a
    thread). Before a restart, by the operator or the supervisor trigger."""
    stop_run(store, pipeline_id, failed_run, process, log=log, cluster_app=cluster_app)
    with contextlib.suppress(ArroyoError):  # it ended meanwhile, or another run took over: nothing to mark
        record = store.get_pipeline(pipeline_id)
        if record.run_id == failed_run and not record.state.terminal:
            store.set_pipeline_state(pipeline_id, PipelineState.FAILED, run_id=failed_run,
                                     failure_cause=f"supervisor: {cause}"[:4000])
