"""Every use of the apache-spark provider's private ``SparkSubmitHook`` members, and only here.

The provider builds spark-submit's command, parses its output for the cluster application and tracks and kills
that application, but exposes none of it publicly: ``SparkSubmitHook.submit`` runs spark-submit itself and
blocks until it exits, which a long-running pipeline cannot do. So the submit operator and the supervisor use
its internals, through these functions. ``tests/airflow/test_spark_provider_contract.py`` checks each one
against the lowest provider version ``pyproject.toml`` allows and against the installed one; a provider release
that changes one fails there, by name, not in a pipeline.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from airflow.providers.apache.spark.hooks.spark_submit import SparkSubmitHook

__all__ = [
    "CONF_ARGUMENTS",
    "SubmittedApplication",
    "add_files",
    "build_command",
    "connection",
    "delete_driver_pod",
    "env_vars",
    "kill_yarn_application",
    "parse_submit_output",
    "spark_conf",
    "take_conf_arguments",
    "tracking_hook",
    "tracks_yarn_via_rm_api",
    "yarn_status",
]

#: Hook arguments spark-submit takes over a ``--conf`` of the same setting (hook attribute, conf key): the hook
#: writes them after the confs, so they are moved into the conf, which a submit plan may then extend.
CONF_ARGUMENTS = (("_driver_class_path", "spark.driver.extraClassPath"), ("_jars", "spark.jars"))


def connection(hook: SparkSubmitHook) -> dict[str, Any]:
    """The hook's resolved Spark connection (``master``, ``deploy_mode``, ``namespace``, ...)."""
    return hook._connection


def spark_conf(hook: SparkSubmitHook) -> dict[str, Any]:
    """The ``--conf`` settings the command will carry (mutable: the submit plan adds to it)."""
    return hook._conf


def take_conf_arguments(hook: SparkSubmitHook) -> dict[str, str]:
    """Remove :data:`CONF_ARGUMENTS` from the hook and return them as conf settings."""
    taken: dict[str, str] = {}
    for attribute, key in CONF_ARGUMENTS:
        value = getattr(hook, attribute)
        if value:
            taken[key] = value
            setattr(hook, attribute, None)
    return taken


def add_files(hook: SparkSubmitHook, files: Sequence[str]) -> None:
    """Append to ``--files``."""
    hook._files = ",".join([*filter(None, [hook._files]), *files])


def env_vars(hook: SparkSubmitHook) -> dict[str, str]:
    """The user's ``env_vars`` of the hook, as strings."""
    return {k: str(v) for k, v in (hook._env or {}).items()}


def build_command(hook: SparkSubmitHook, application: str) -> list[str]:
    """The provider's own spark-submit command (the one ``SparkSubmitHook.submit`` runs); it also decides how
    the user's ``env_vars`` travel (process environment, or ``--conf`` for YARN and Kubernetes)."""
    return list(hook._build_spark_submit_command(application))


@dataclass(frozen=True)
class SubmittedApplication:
    """What the provider's parser found in spark-submit's output."""

    yarn_application_id: str | None
    kubernetes_application_id: str | None
    kubernetes_driver_pod: str | None


def parse_submit_output(hook: SparkSubmitHook, lines: Iterable[str]) -> SubmittedApplication:
    """Feed spark-submit's output to the provider's log parser (which also logs each line to the task log)."""
    hook._process_spark_submit_log(iter(lines))
    return SubmittedApplication(hook._yarn_application_id, hook._kubernetes_application_id,
                                hook._kubernetes_driver_pod)


def tracking_hook(spark_conn_id: str, *, yarn: bool, rm_api: bool, application_id: str | None,
                  driver_pod: str | None, namespace: str | None) -> SparkSubmitHook:
    """A hook that tracks an application submitted earlier (by another process), as the one that submitted it
    would: the YARN application id, or the Kubernetes driver pod and namespace."""
    from airflow.providers.apache.spark.hooks.spark_submit import SparkSubmitHook

    hook = SparkSubmitHook(conn_id=spark_conn_id, yarn_track_via_rm_api=yarn and rm_api,
                           track_driver_via_k8s_api=not yarn)
    hook._yarn_application_id = application_id if yarn else None
    hook._kubernetes_driver_pod = driver_pod
    hook._kubernetes_application_id = None if yarn else application_id
    if namespace:
        hook._connection["namespace"] = namespace
    return hook


def yarn_status(hook: SparkSubmitHook, application_id: str) -> tuple[str, str, str]:
    """(state, final status, diagnostics) from the ResourceManager's REST API; ``RuntimeError`` when unreachable.
    Releases before 6.3 of the provider answer without the diagnostics ("")."""
    answer = tuple(hook._query_yarn_application_status(application_id))
    state, final, diagnostics = (*answer, "")[:3] if len(answer) == 2 else answer[:3]
    return str(state), str(final), str(diagnostics or "")


def tracks_yarn_via_rm_api(hook: SparkSubmitHook) -> bool:
    """Whether the hook reaches YARN through the ResourceManager's REST API (else the ``yarn`` CLI)."""
    return bool(hook._yarn_track_via_rm_api)


def kill_yarn_application(hook: SparkSubmitHook, application_id: str) -> None:
    """Kill through the ResourceManager's REST API."""
    hook._kill_yarn_application(application_id)


def delete_driver_pod(hook: SparkSubmitHook) -> None:
    """Delete the tracked Kubernetes driver pod."""
    hook._delete_driver_pod()
