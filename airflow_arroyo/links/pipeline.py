"""Operator extra links: the pipeline's checkpoint page in the Airflow UI, and the Spark UI.

Both read what the operator pushed to XCom (``pipeline_id``, ``spark_ui_url``), so a link shows the
pipeline and run of *that* task instance; the pipeline id falls back to the operator's attribute.
Airflow 3 resolves the links in the worker when the task finishes and stores the URLs in XCom, so
the API server needs nothing of this package to show them.

The checkpoint page is the Arroyo plugin's page framed by Airflow's UI
(``/plugin/arroyo/arroyo/pipelines/<pipeline_id>``: Airflow's navigation stays around it), absolute
when ``[api] base_url`` is set, relative to the Airflow UI otherwise.

Usage::

    class MyOperator(BaseOperator):
        operator_extra_links = (ArroyoPipelineLink(), SparkUILink())

        def execute(self, context):
            context["ti"].xcom_push(key=XCOM_PIPELINE_ID, value="orders")
            context["ti"].xcom_push(key=XCOM_SPARK_UI_URL, value="http://driver:4040")
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
from urllib.parse import quote, urlsplit

from airflow.sdk import BaseOperatorLink

if TYPE_CHECKING:
    from airflow.sdk import BaseOperator
    from airflow.sdk.types import TaskInstanceKey

__all__ = [
    "XCOM_PIPELINE_ID",
    "XCOM_SPARK_UI_URL",
    "ArroyoPipelineLink",
    "SparkUILink",
    "pipeline_page_url",
]

XCOM_PIPELINE_ID = "pipeline_id"
XCOM_SPARK_UI_URL = "spark_ui_url"

#: Where the UI plugin mounts its app, and the pipeline page under it.
UI_MOUNT = "/arroyo"
#: The plugin's entry in Airflow's navigation (``external_views`` ``url_route``): Airflow's UI frames
#: the app at ``/plugin/arroyo`` and follows a sub-path, ``/plugin/arroyo/<path in the frame>``.
UI_ROUTE = "arroyo"


def pipeline_page_url(pipeline_id: str, base_url: str | None = None, *, framed: bool = True) -> str:
    """The checkpoint page of a pipeline (relative when no base URL is known).

    ``framed`` (the default): inside Airflow's UI, with its navigation around it
    (``<base>/plugin/arroyo/<base path>/arroyo/pipelines/<id>``); otherwise the plugin's own page.
    """
    if base_url is None:
        from airflow.sdk import conf

        base_url = conf.get("api", "base_url", fallback=None)
    root = (base_url or "").rstrip("/")
    page = f"{UI_MOUNT}/pipelines/{quote(pipeline_id, safe='')}"
    if not framed:
        return f"{root}{page}"
    return f"{root}/plugin/{UI_ROUTE}{urlsplit(root).path}{page}"


def _xcom(ti_key: TaskInstanceKey, key: str) -> Any:
    from airflow.sdk.execution_time.xcom import XCom  # the configured XCom backend

    return XCom.get_value(ti_key=ti_key, key=key)


class ArroyoPipelineLink(BaseOperatorLink):
    """"Arroyo checkpoints": the pipeline's page (epochs, acknowledgements, cleanup runs)."""

    name = "Arroyo checkpoints"

    def get_link(self, operator: BaseOperator, *, ti_key: TaskInstanceKey) -> str:
        """Airflow: the pipeline's checkpoint page in the Airflow UI ("" when the id is unknown)."""
        pipeline_id = _xcom(ti_key, XCOM_PIPELINE_ID) or getattr(operator, "pipeline_id", None)
        if not pipeline_id or not isinstance(pipeline_id, str) or "{{" in pipeline_id:
            return ""
        return pipeline_page_url(pipeline_id)


class SparkUILink(BaseOperatorLink):
    """"Spark UI": the web UI of the pipeline's Spark application, as its driver reported it."""

    name = "Spark UI"

    def get_link(self, operator: BaseOperator, *, ti_key: TaskInstanceKey) -> str:  # noqa: ARG002 - Airflow's signature
        """Airflow: the Spark UI the operator recorded ("" when none)."""
        url = _xcom(ti_key, XCOM_SPARK_UI_URL)
        return url if isinstance(url, str) else ""
