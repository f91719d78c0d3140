"""Fixtures of the runtime tests: a module-scoped epoch store, and a real S3 API (moto's server) on loopback."""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from airflow_arroyo.store import EpochStore


@pytest.fixture(scope="module")
def module_store(migrated_db: Callable[[str], str], request: pytest.FixtureRequest) -> Iterator[EpochStore]:
    """An epoch store in a database of its own, shared by one test module."""
    store = EpochStore(migrated_db(request.module.__name__.rsplit(".", 1)[-1].removeprefix("test_")[:20]))
    yield store
    store.close()


class S3Server:
    """moto's S3 API over HTTP on loopback, and the settings a user would give to reach it."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        # The AWS SDK settings pyarrow and boto3 read (docs/runtime.md, "Object storage"); a subprocess
        # (the driver, its JVM and Python workers) gets them through its environment.
        self.env = {
            "AWS_ENDPOINT_URL": endpoint,
            "AWS_ACCESS_KEY_ID": "arroyo-test",
            "AWS_SECRET_ACCESS_KEY": "arroyo-test-secret",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    def new_bucket(self) -> str:
        """A fresh, empty bucket; returns its ``s3://`` URI."""
        import boto3

        name = f"arroyo-{uuid.uuid4().hex[:12]}"
        boto3.client("s3", endpoint_url=self.endpoint).create_bucket(Bucket=name)
        return f"s3://{name}"

    def keys(self, uri: str) -> dict[str, int]:
        """Every object below ``s3://bucket/prefix``: key -> size (what is really on the server; pyarrow's
        empty ``folder/`` marker objects left out)."""
        import boto3

        bucket, _, prefix = uri.removeprefix("s3://").partition("/")
        pages = boto3.client("s3", endpoint_url=self.endpoint).get_paginator("list_objects_v2")
        return {o["Key"]: int(o["Size"]) for page in pages.paginate(Bucket=bucket, Prefix=prefix)
                for o in page.get("Contents", []) if not o["Key"].endswith("/")}


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """One moto S3 server for the session (``ThreadedMotoServer`` on 127.0.0.1, a free port), with the AWS
    settings in this process's environment while it runs."""
    moto_server = pytest.importorskip("moto.server")
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one log line per request otherwise
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    s3 = S3Server(f"http://{host}:{port}")
    saved = {k: os.environ.get(k) for k in s3.env}
    os.environ.update(s3.env)
    try:
        yield s3
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.stop()


@pytest.fixture
def bucket(s3_server: S3Server) -> str:
    """A fresh bucket on the session's S3 server (``s3://arroyo-...``)."""
    return s3_server.new_bucket()


@contextmanager
def s3a_on(spark: Any, s3_server: S3Server, bucket: str) -> Iterator[Any]:
    """The shared session's S3A reaching ``bucket`` on the moto server (the bucket's own settings,
    ``fs.s3a.bucket.<name>.*``, removed afterwards: the session is shared); yields its Hadoop configuration."""
    from airflow_arroyo.jvm import s3a_conf

    name = bucket.removeprefix("s3://")
    hadoop_conf = spark.sparkContext._jsc.hadoopConfiguration()
    # what the provider derives from the AWS SDK's environment, as the bucket's own settings; the credentials,
    # which the provider leaves to S3A's credentials chain, given here because the session outlives the fixture
    derived = s3a_conf(environ=s3_server.env)
    settings = {key.removeprefix("spark.hadoop.fs.s3a."): value for key, value in derived.items()}
    settings |= {"access.key": s3_server.env["AWS_ACCESS_KEY_ID"], "secret.key": s3_server.env["AWS_SECRET_ACCESS_KEY"]}
    for key, value in settings.items():
        hadoop_conf.set(f"fs.s3a.bucket.{name}.{key}", value)
    try:
        yield hadoop_conf
    finally:
        for key in settings:
            hadoop_conf.unset(f"fs.s3a.bucket.{name}.{key}")
