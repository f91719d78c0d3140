"""What the driver says when things go wrong (issue 16, "Errors"): a stage that raises while the pipeline is
built and a missing source folder name the stage and keep the exception's type and traceback; Spark's causes
lead with the user's Python error; a database without the schema says to migrate (exit 2); a live run is found
before Spark starts, with the stale-heartbeat takeover rule."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from airflow_arroyo.core.epochs import PipelineState
from airflow_arroyo.core.exceptions import ConcurrencyConflict, PipelineFailedError, SchemaMissingError, StageBuildError
from airflow_arroyo.runtime.driver import CAUSE_LIMIT, PipelineDriver, _user_error_first, check_registrable
from airflow_arroyo.runtime.pipeline import Pipeline
from airflow_arroyo.runtime.stage import brief_java_error
from airflow_arroyo.store import EpochStore
from airflow_arroyo.testing import generator_source
from tests.support import sql

# What Spark 4.2 reports (StreamingQueryException's message, Java stack frames cut) when the foreachBatch
# function of a query raises KeyError('min_paid'), and when a Python UDF raises: captured from real runs.
FOREACH_BATCH_MESSAGE = '''\
An exception was raised by the Python Proxy. Return Message: Traceback (most recent call last):
  File "/venv/lib/python3.11/site-packages/py4j/clientserver.py", line 644, in _call_proxy
    return_value = getattr(self.pool[obj_id], method)(*params)
                   ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
  File "/venv/lib/python3.11/site-packages/pyspark/sql/utils.py", line 166, in call
    raise e
  File "/venv/lib/python3.11/site-packages/pyspark/sql/utils.py", line 163, in call
    self.func(DataFrame(jdf, wrapped_session_jdf), batch_id)
  File "/jobs/orders.py", line 20, in write_orders
    raise KeyError("min_paid")
KeyError: 'min_paid'

=== Streaming Query ===
Identifier: [id = 5f8df718-405a-4ed0-bf2e-3ad98a28e7b1, runId = f5eff639-8e4a-4354-a24a-25edb5c5bace]
Current State: ACTIVE
'''
UDF_MESSAGE = '''[PYTHON_EXCEPTION] An exception was thrown from the Python worker: Traceback (most recent call last):
  File "/jobs/orders.py", line 8, in boom
    raise ValueError("row 3 is cursed")
ValueError: row 3 is cursed
 SQLSTATE: 38000
	at org.apache.spark.api.python.BasePythonRunner$ReaderIterator.handlePythonException(PythonRunner.scala:665)
	at java.base/java.lang.Thread.run(Thread.java:840)
Caused by: py4j.Py4JException: An exception was raised by the Python Proxy.
=== Streaming Query ===
Identifier: [id = 10c3ba17]
'''

# What Spark 4.2 reports when a fused source stage (a JSON file source under FAILFAST, a Parquet sink) reads a
# malformed record: the foreachBatch proxy's Python traceback, py4j's Java error, then the Spark error classes.
MALFORMED_RECORD_MESSAGE = '''\
An exception was raised by the Python Proxy. Return Message: Traceback (most recent call last):
  File "/venv/lib/python3.11/site-packages/py4j/clientserver.py", line 644, in _call_proxy
    return_value = getattr(self.pool[obj_id], method)(*params)
                   ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
  File "/venv/lib/python3.11/site-packages/pyspark/sql/utils.py", line 166, in call
    raise e
  File "/venv/lib/python3.11/site-packages/pyspark/sql/utils.py", line 163, in call
    self.func(DataFrame(jdf, wrapped_session_jdf), batch_id)
  File "/srv/app/airflow_arroyo/runtime/stage.py", line 318, in _foreach_batch
    self._write(df, batch_id)
  File "/srv/app/airflow_arroyo/runtime/stage.py", line 340, in _write
    self.sink.write_batch(df, batch_id)  # pre-commit; the driver commits it with its epoch
    ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
  File "/srv/app/airflow_arroyo/runtime/sinks/files.py", line 208, in write_batch
    observed.write.format(self.format).options(**self.options).mode("overwrite").save(target)
  File "/venv/lib/python3.11/site-packages/pyspark/sql/readwriter.py", line 1835, in save
    self._jwrite.save(path)
  File "/venv/lib/python3.11/site-packages/py4j/java_gateway.py", line 1362, in __call__
    return_value = get_return_value(
                   ^^^^^^^^^^^^^^^^^
  File "/venv/lib/python3.11/site-packages/pyspark/errors/exceptions/captured.py", line 251, in deco
    return f(*a, **kw)
           ^^^^^^^^^^^
  File "/venv/lib/python3.11/site-packages/py4j/protocol.py", line 327, in get_return_value
    raise Py4JJavaError(
py4j.protocol.Py4JJavaError: An error occurred while calling o104.save.
: org.apache.spark.SparkException: [FAILED_READ_FILE.NO_HINT] Encountered error while reading file file:///data/in/a.json.  SQLSTATE: KD001
\tat org.apache.spark.sql.errors.QueryExecutionErrors$.cannotReadFilesError(QueryExecutionErrors.scala:856)
\tat org.apache.spark.sql.execution.datasources.FileScanRDD$$anon$1.nextIterator(FileScanRDD.scala:142)
Caused by: org.apache.spark.SparkException: [MALFORMED_RECORD_IN_PARSING.WITHOUT_SUGGESTION] Malformed records are detected in record parsing: [null,null].
Parse Mode: FAILFAST. To process malformed records as null result, try setting the option 'mode' as 'PERMISSIVE'.  SQLSTATE: 22023
Caused by: com.fasterxml.jackson.core.JsonParseException: Unrecognized token 'oops': was expecting (JSON String, Number (or 'NaN'/'+INF'/'-INF'), Array, Object or token 'null', 'true' or 'false')
 at [Source: UNKNOWN; line: 1, column: 19]
\tat com.fasterxml.jackson.core.JsonParser._constructError(JsonParser.java:2567)
\t... 32 more
=== Streaming Query ===
Identifier: orders-pipeline.orders~out [id = 5c36e3a7-a72e-4d79-aeb8-a6d4d6eac206, runId = 70362376-6782-4e14-8f00-b2e8c3d4da65]
Current Committed Offsets: {}
Current Available Offsets: {FileStreamSource[file:/data/in]: {"logOffset":0}}

Current State: ACTIVE
Thread State: RUNNABLE

Logical Plan:
~WriteToMicroBatchDataSourceV1 ForeachBatchSink, 5c36e3a7-a72e-4d79-aeb8-a6d4d6eac206, [queryName=orders-pipeline.orders~out, checkpointLocation=file:///data/storage/orders-pipeline/stages/orders~out/checkpoint], Append
+- ~StreamingExecutionRelation FileStreamSource[file:/data/in], [id#2L, paid#3], name=<Unassigned>
'''  # noqa: E501 - Spark's lines as captured


@pytest.mark.parametrize(("message", "lead"), [
    (FOREACH_BATCH_MESSAGE,
     ["KeyError: 'min_paid'",
      '  raised at File "/jobs/orders.py", line 20, in write_orders: raise KeyError("min_paid")']),
    (UDF_MESSAGE, ["ValueError: row 3 is cursed",
                   '  raised at File "/jobs/orders.py", line 8, in boom: raise ValueError("row 3 is cursed")']),
])
def test_spark_causes_lead_with_the_users_python_error(message: str, lead: list[str]) -> None:
    cause = _user_error_first(message)
    assert cause.splitlines()[:3] == [*lead, ""]
    body = message.split("=== Streaming Query ===")[0].splitlines()[0]
    assert body in cause  # the whole message follows the lead
    assert "\tat org.apache" not in cause  # Java stack frames dropped
    assert cause.index("=== Streaming Query ===") > cause.index(body)


def test_a_java_only_message_is_kept_as_it_is_without_stack_frames() -> None:
    text = "org.apache.spark.SparkException: Job aborted\n\tat org.apache.spark.Foo.bar(Foo.scala:1)\nCaused by: x"
    assert _user_error_first(text) == "org.apache.spark.SparkException: Job aborted\nCaused by: x"


def test_a_spark_error_class_leads_a_cause_before_the_proxys_traceback() -> None:
    """Issue 30, finding 2: the deepest Spark error class and its whole message lead; py4j's and pyspark's own
    frames are trimmed; a long message is cut in its trace, never in the user's error."""
    cause = _user_error_first(MALFORMED_RECORD_MESSAGE)
    assert cause.splitlines()[:2] == [
        "[MALFORMED_RECORD_IN_PARSING.WITHOUT_SUGGESTION] Malformed records are detected in record parsing: "
        "[null,null].",
        "Parse Mode: FAILFAST. To process malformed records as null result, try setting the option 'mode' as "
        "'PERMISSIVE'.  SQLSTATE: 22023",
    ]
    assert "[FAILED_READ_FILE.NO_HINT] Encountered error while reading file file:///data/in/a.json" in cause
    assert "Unrecognized token 'oops'" in cause
    assert "site-packages/py4j/clientserver.py" not in cause and "^^^^" not in cause  # library frames trimmed
    assert 'File "/srv/app/airflow_arroyo/runtime/sinks/files.py", line 208, in write_batch' in cause
    long = MALFORMED_RECORD_MESSAGE + "+- Project [id#2L]\n" * 400  # a large logical plan
    cut = _user_error_first(long)
    assert len(cut) <= CAUSE_LIMIT and cut.endswith("... (cut)")
    assert cut.splitlines()[:2] == cause.splitlines()[:2]


@pytest.mark.spark
def test_a_stage_raising_while_built_is_named_with_its_error_type_and_traceback(
        store: EpochStore, spark: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    settings: dict[str, int] = {}

    def keep_paid(df: Any) -> Any:
        return df.where(df.value >= settings["min_paid"])  # the user's bug: a missing setting

    pid = f"build-{uuid.uuid4().hex[:6]}"
    p = Pipeline(pid)
    src = p.source("orders", lambda s: generator_source(s, seed=3, total_rows=10, rows_per_batch=10))
    p.stage("paid", keep_paid, inputs=[src])
    with caplog.at_level(logging.ERROR, logger="airflow_arroyo.runtime.driver"), \
            pytest.raises(StageBuildError) as err:
        PipelineDriver(p, store, storage_uri=str(tmp_path), spark=spark).run()
    assert err.value.stage == "paid" and isinstance(err.value.error, KeyError)
    cause = store.get_pipeline(pid).failure_cause or ""
    assert store.get_pipeline(pid).state is PipelineState.FAILED
    # the log's messages, not caplog.text: whether a JSON formatter (escaping the quotes) is on the captured
    # handler depends on what ran before in the session
    logged = "\n".join(r.getMessage() for r in caplog.records if r.name == "airflow_arroyo.runtime.driver")
    for where in (str(err.value), cause, logged):
        assert "stage 'paid' could not be built: KeyError: 'min_paid'" in where
        assert "Traceback (most recent call last)" in where and "in keep_paid" in where
        assert 'settings["min_paid"]' in where


@pytest.mark.spark
def test_a_missing_source_folder_names_the_stage(store: EpochStore, spark: Any, tmp_path: Path) -> None:
    missing = tmp_path / "incoming"
    pid = f"nofolder-{uuid.uuid4().hex[:6]}"
    p = Pipeline(pid)
    src = p.source("orders", lambda s: s.readStream.schema("id BIGINT, paid DOUBLE").json(str(missing)))
    p.stage("paid", lambda df: df.where("paid > 0"), inputs=[src])
    with pytest.raises(StageBuildError, match=r"stage 'orders' could not be built: AnalysisException: "
                                              r"\[PATH_NOT_FOUND\] Path does not exist: .*incoming"):
        PipelineDriver(p, store, storage_uri=str(tmp_path / "storage"), spark=spark).run()
    assert "stage 'orders' could not be built" in (store.get_pipeline(pid).failure_cause or "")


@pytest.mark.spark
def test_a_malformed_record_under_failfast_is_the_cause_of_its_fused_stage(
        store: EpochStore, spark: Any, tmp_path: Path) -> None:
    inbox = tmp_path / "incoming"
    inbox.mkdir()
    (inbox / "a.json").write_text('{"id": 1, "paid": 2.0}\n{"id": 2, "paid": oops}\n')
    pid = f"malformed-{uuid.uuid4().hex[:6]}"
    p = Pipeline(pid)
    src = p.source("orders", lambda s: s.readStream.schema("id BIGINT, paid DOUBLE").option("mode", "FAILFAST")
                   .json(str(inbox)))
    p.sink("out", [src], format="parquet", options={"path": str(tmp_path / "out")})
    with pytest.raises(PipelineFailedError):
        PipelineDriver(p, store, storage_uri=str(tmp_path / "storage"), spark=spark).run()
    cause = store.get_pipeline(pid).failure_cause or ""
    assert cause.startswith("stage 'orders~out' (fused: orders, out) failed: [MALFORMED_RECORD_IN_PARSING"), cause[:600]
    assert "Parse Mode: FAILFAST" in cause.splitlines()[1]
    assert "Unrecognized token 'oops'" in cause and len(cause) <= CAUSE_LIMIT


def test_the_driver_on_a_database_without_the_schema_says_to_migrate(pg_dsn: str, tmp_path: Path) -> None:
    store = EpochStore(pg_dsn)
    try:
        with pytest.raises(SchemaMissingError, match="has no airflow-arroyo schema: run `airflow-arroyo migrate`"):
            p = Pipeline("p")
            p.source("s", lambda spark: spark)
            PipelineDriver(p, store, storage_uri=str(tmp_path)).run()
    finally:
        store.close()


def test_a_live_run_is_refused_and_a_stale_one_taken_over(store: EpochStore) -> None:
    assert check_registrable(store, "fresh") is False  # never registered
    store.register_pipeline("live", stages=["s"], run_id="r1")
    with pytest.raises(ConcurrencyConflict, match=r"pipeline 'live' is registered \(run 'r1', last heartbeat "
                                                  r"\d+s ago\): another driver runs it.*--takeover"):
        check_registrable(store, "live")
    assert check_registrable(store, "live", takeover=True) is True
    sql(store, "UPDATE arroyo_pipelines SET heartbeat_at = clock_timestamp() - interval '31 seconds'"
               " WHERE pipeline_id = 'live'")
    assert check_registrable(store, "live", stale_after=30) is True  # presumed dead: taken over
    with pytest.raises(ConcurrencyConflict):
        check_registrable(store, "live", stale_after=60)
    store.set_pipeline_state("live", PipelineState.FAILED)
    assert check_registrable(store, "live") is False


def driver_cli(dsn: str, storage: Path, pipeline_id: str) -> subprocess.CompletedProcess[str]:
    """The driver's command line with a Spark that cannot start (SPARK_HOME points nowhere): an error found
    after Spark was asked for would be a launch failure, not the message the test expects."""
    env = {**os.environ, "ARROYO_DSN": dsn, "SPARK_HOME": str(storage / "no-spark-here")}
    return subprocess.run(
        [sys.executable, "-m", "airflow_arroyo.runtime.driver", "--pipeline", "airflow_arroyo.examples.pipelines:demo",
         "--arg", f"pipeline_id={pipeline_id}", "--storage-uri", str(storage), "--master", "local[1]"],
        capture_output=True, text=True, env=env, timeout=120, cwd=str(Path(__file__).resolve().parents[2]))


def test_the_command_line_refuses_before_spark_starts(pg_dsn: str, tmp_path: Path) -> None:
    """Exit 2 and what to run on a database without the schema; exit 1 naming the live run when another
    driver holds the pipeline; both before Spark is started."""
    bare = driver_cli(pg_dsn, tmp_path, "orders")
    assert bare.returncode == 2, bare.stderr[-2000:]
    assert "has no airflow-arroyo schema: run `airflow-arroyo migrate`" in bare.stderr
    assert "does not exist" not in bare.stderr
    store = EpochStore(pg_dsn)
    try:
        store.migrate()
        store.register_pipeline("orders", stages=["left"], run_id="alive")
        live = driver_cli(pg_dsn, tmp_path, "orders")
    finally:
        store.close()
    assert live.returncode == 1, live.stderr[-2000:]
    assert "pipeline 'orders' is registered (run 'alive'" in live.stderr and "--takeover" in live.stderr


# Spark's StreamExecution.PROXY_ERROR: how it tells a foreachBatch failure caused by the query's own stop
_SPARK_PROXY_ERROR = re.compile(
    r"py4j.protocol.Py4JJavaError: An error occurred while calling((.|\r\n|\r|\n)*)"
    r"(java.lang.InterruptedException|java.io.InterruptedIOException|java.nio.channels.ClosedByInterruptException)")


def test_a_java_error_goes_back_to_spark_brief_and_still_reads_as_an_interruption() -> None:
    stack = "".join(f"\tat org.apache.spark.Frame{i}.run(Frame.scala:{i})\n" for i in range(20_000))
    interrupted = Exception(f"An error occurred while calling o219230.save.\n: java.lang.InterruptedException\n{stack}")
    brief = brief_java_error(interrupted)
    assert brief == ("py4j.protocol.Py4JJavaError: An error occurred while calling o219230.save.\n"
                     ": java.lang.InterruptedException")
    assert _SPARK_PROXY_ERROR.search(brief)
    failed = Exception(f"An error occurred while calling z:java.lang.Long.parseLong.\n"
                       f": java.lang.NumberFormatException: For input string: \"{'x' * 50_000}\"\n{stack}")
    brief = brief_java_error(failed)
    assert len(brief) == 1000 and "NumberFormatException" in brief and not _SPARK_PROXY_ERROR.search(brief)
    # an interruption among the causes of a long error stays in the brief
    deep = Exception(f"An error occurred while calling o7.save.\n: org.apache.spark.SparkException: {'y' * 5_000}\n"
                     f"{stack}Caused by: java.io.InterruptedIOException: interrupted\n{stack}")
    brief = brief_java_error(deep)
    assert len(brief) <= 1000 and brief.endswith("Caused by: java.io.InterruptedIOException: interrupted")
    assert _SPARK_PROXY_ERROR.search(brief)

