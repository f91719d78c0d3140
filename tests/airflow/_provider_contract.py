"""Run in a fresh interpreter by test_spark_provider_contract.py: exercise every function of
airflow_arroyo.submit.provider against the apache-spark provider found first (argv[1], when given, is a
folder holding another release of it, installed with ``--target``), and print one JSON object: the provider's
version and, per member, "ok" or what broke."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import inspect
import json
import os
import sys
import threading
import traceback
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

_PROVIDER = "airflow.providers.apache.spark"


class _Release(importlib.abc.MetaPathFinder):
    """Find the provider's package in ``folder`` (its submodules then follow its ``__path__``)."""

    def __init__(self, folder: str) -> None:
        self.folder = os.path.join(folder, "airflow", "providers", "apache")

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        return importlib.machinery.PathFinder.find_spec(name, [self.folder]) if name == _PROVIDER else None


class _ResourceManager(BaseHTTPRequestHandler):
    """YARN's ResourceManager REST API, the two calls the provider makes: an application's state, and its kill."""

    kills: list[str] = []

    def do_GET(self) -> None:
        body = json.dumps({"app": {"state": "RUNNING", "finalStatus": "UNDEFINED", "diagnostics": "queued long"}})
        self._reply(body)

    def do_PUT(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        payload = json.loads(self.rfile.read(length) or b"{}")
        self.kills.append(f"{self.path} {payload.get('state')}")
        self._reply(json.dumps({"state": "KILLED"}))

    def _reply(self, body: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *args: Any) -> None:
        pass


def main() -> None:
    if len(sys.argv) > 1:
        sys.meta_path.insert(0, _Release(sys.argv[1]))
    server = ThreadingHTTPServer(("127.0.0.1", 0), _ResourceManager)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    rm = f"http://127.0.0.1:{server.server_address[1]}"
    os.environ["AIRFLOW_CONN_SPARK_CONTRACT_YARN"] = json.dumps(
        {"conn_type": "spark", "host": "yarn", "extra": {"deploy-mode": "cluster",
                                                        "yarn_resourcemanager_webapp_address": rm}})
    os.environ["AIRFLOW_CONN_SPARK_CONTRACT_LOCAL"] = json.dumps({"conn_type": "spark", "host": "local[1]"})
    os.environ["AIRFLOW_CONN_SPARK_CONTRACT_K8S"] = json.dumps(
        {"conn_type": "spark", "host": "k8s://https://127.0.0.1:1", "extra": {"deploy-mode": "cluster",
                                                                              "namespace": "spark"}})

    import airflow.providers.apache.spark as spark_provider
    from airflow.providers.apache.spark.hooks.spark_submit import SparkSubmitHook

    from airflow_arroyo.submit import provider

    def yarn_hook(**kwargs: Any) -> SparkSubmitHook:
        return SparkSubmitHook(conn_id="spark_contract_yarn", **kwargs)

    def check_connection() -> None:
        conn = provider.connection(yarn_hook())
        assert (conn["master"], conn["deploy_mode"]) == ("yarn", "cluster"), conn

    def check_conf_and_command() -> None:
        hook = yarn_hook(conf={"spark.a": "1"}, jars="x.jar", driver_class_path="cp.jar", files="f1",
                         env_vars={"A_VAR": 7})
        assert provider.take_conf_arguments(hook) == {"spark.jars": "x.jar", "spark.driver.extraClassPath": "cp.jar"}
        provider.spark_conf(hook)["spark.b"] = "2"
        provider.add_files(hook, ["secret#alias"])
        command = provider.build_command(hook, "app.py")
        # YARN: the user's env_vars travel in the command (the application master's env) and spark-submit's
        assert provider.env_vars(hook) == {"A_VAR": "7"} and "spark.yarn.appMasterEnv.A_VAR=7" in command, command
        local = SparkSubmitHook(conn_id="spark_contract_local", env_vars={"A_VAR": 7})
        provider.build_command(local, "app.py")
        assert provider.env_vars(local) == {"A_VAR": "7"}
        assert command[-1] == "app.py" and "--jars" not in command and "--driver-class-path" not in command, command
        assert {"spark.a=1", "spark.b=2"} <= set(command) and command[command.index("--files") + 1] == "f1,secret#alias"
        assert command[command.index("--master") + 1] == "yarn", command

    def check_parse_yarn() -> None:
        found = provider.parse_submit_output(yarn_hook(), [
            "INFO Client: Submitting application application_1700000000000_0042 to ResourceManager"])
        assert found.yarn_application_id == "application_1700000000000_0042", found

    def check_parse_kubernetes() -> None:
        found = provider.parse_submit_output(SparkSubmitHook(conn_id="spark_contract_k8s"), [
            "INFO LoggingPodStatusWatcherImpl: State changed, new state:",
            "\t pod name: orders-3f2a1b-driver",
            "\t labels: spark-app-selector -> spark-0123abcd, spark-role -> driver"])
        assert (found.kubernetes_driver_pod, found.kubernetes_application_id) == (
            "orders-3f2a1b-driver", "spark-0123abcd"), found

    def check_tracking_and_yarn_api() -> None:
        hook = provider.tracking_hook("spark_contract_yarn", yarn=True, rm_api=True,
                                      application_id="application_1_0007", driver_pod=None, namespace=None)
        assert provider.tracks_yarn_via_rm_api(hook)
        state, final, diagnostics = provider.yarn_status(hook, "application_1_0007")
        # releases before 6.3 do not read the diagnostics
        assert (state, final) == ("RUNNING", "UNDEFINED") and diagnostics in ("queued long", ""), diagnostics
        provider.kill_yarn_application(hook, "application_1_0007")
        assert _ResourceManager.kills == ["/ws/v1/cluster/apps/application_1_0007/state KILLED"], _ResourceManager.kills
        k8s = provider.tracking_hook("spark_contract_k8s", yarn=False, rm_api=False, application_id="spark-1",
                                     driver_pod="p-driver", namespace="other")
        assert not provider.tracks_yarn_via_rm_api(k8s) and provider.connection(k8s)["namespace"] == "other"

    def check_delete_driver_pod() -> None:
        # deleting needs a Kubernetes API; the contract is the member the adapter calls, taking no argument
        assert list(inspect.signature(SparkSubmitHook._delete_driver_pod).parameters) == ["self"]

    checks: dict[str, Callable[[], None]] = {
        "connection": check_connection, "conf_and_command": check_conf_and_command,
        "parse_submit_output[yarn]": check_parse_yarn, "parse_submit_output[kubernetes]": check_parse_kubernetes,
        "tracking_hook+yarn_status+kill_yarn_application": check_tracking_and_yarn_api,
        "delete_driver_pod": check_delete_driver_pod,
    }
    results: dict[str, str] = {}
    for name, check in checks.items():
        try:
            check()
            results[name] = "ok"
        except Exception:  # noqa: BLE001 - reported by name to the test
            results[name] = traceback.format_exc(limit=3)
    server.shutdown()
    print(json.dumps({"version": spark_provider.__version__, "file": spark_provider.__file__, "results": results}))


if __name__ == "__main__":
    main()
