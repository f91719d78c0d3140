"""Kafka in -> Kafka out: the product (fused, exactly-once Kafka sink, epochs) against ONE plain Structured
Streaming query of the same logic writing with Spark's own Kafka sink (at-least-once), side by side.

The logic: JSON orders read with Spark's Kafka source, the first of each id kept (``dropDuplicates``: keyed
state), written as JSON to an output topic. Each side runs in a process of its own (a fresh Spark driver JVM,
``local[2]``) against the same loopback broker, on topics of its own, the sides alternating over ``--rounds``.

* **capacity**: ``--backlog`` orders are in the input topic before the side starts; the time from the side's
  launch (its JVM's start included: the product runs its first batch before its pipeline reads as running) to
  the last order visible in the output (for the product: to a ``read_committed`` consumer) gives orders/s.
* **latency**: orders are produced at ``--rate`` per second, each carrying its production time; for the
  orders produced in the ``--duration`` window after ``--warmup``, event -> visible latency p50/p99 (visible:
  read by a ``read_committed`` consumer of the output, which for the product is when the epoch covering it
  committed; for the plain query when Spark's sink wrote it).

The product side plays the checkpoint controller (an epoch every ``--interval`` seconds) and keeps its epoch
store in a throwaway PostgreSQL. Prints each run, then the ratios product/plain.

    python benchmarks/kafka_e2e.py                       # 2 rounds: about 6 minutes
    python benchmarks/kafka_e2e.py --rounds 3 --rate 2000 --interval 1

Results, with the command that produced them: ``benchmarks/results/kafka_e2e.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def logic(df: Any) -> Any:
    """Both sides: parse, keep the first of each id, shape for a Kafka sink."""
    parsed = df.selectExpr(
        "CAST(get_json_object(CAST(value AS STRING), '$.id') AS BIGINT) AS id",
        "get_json_object(CAST(value AS STRING), '$.key') AS key",
        "CAST(get_json_object(CAST(value AS STRING), '$.ts') AS BIGINT) AS ts")
    return parsed.dropDuplicates(["id"])


def to_kafka(df: Any) -> Any:
    return df.selectExpr("key", "to_json(struct(id, key, ts)) AS value")


def _source(spark: Any, servers: str, topic: str) -> Any:
    return (spark.readStream.format("kafka").option("kafka.bootstrap.servers", servers)
            .option("subscribe", topic).option("startingOffsets", "earliest").load())


def _session() -> Any:
    from pyspark.sql import SparkSession

    from airflow_arroyo.jvm import local_master_conf

    builder = SparkSession.builder.master("local[2]").appName("kafka-e2e").config("spark.ui.enabled", "false")
    confs = {"spark.sql.shuffle.partitions": "2", "spark.driver.memory": "2g",
             "spark.ui.showConsoleProgress": "false"}
    confs.update(local_master_conf(confs))
    for k, v in confs.items():
        builder = builder.config(k, v)
    return builder.getOrCreate()


def run_plain(servers: str, source: str, out: str, seconds: float) -> None:
    spark = _session()
    with tempfile.TemporaryDirectory() as ckpt:
        query = (to_kafka(logic(_source(spark, servers, source))).writeStream.format("kafka")
                 .option("kafka.bootstrap.servers", servers).option("topic", out)
                 .option("checkpointLocation", ckpt).outputMode("append").start())
        print("READY", flush=True)
        query.awaitTermination(seconds)
        query.stop()
    spark.stop()


def run_product(servers: str, source: str, out: str, seconds: float, dsn: str, interval: float) -> None:
    from airflow_arroyo.runtime.driver import PipelineDriver
    from airflow_arroyo.runtime.pipeline import Pipeline
    from airflow_arroyo.runtime.sinks.kafka import KafkaTarget
    from airflow_arroyo.store import EpochStore
    from airflow_arroyo.testing import CheckpointTicker, DriverThread, wait_for

    spark = _session()
    pid = f"bench-{uuid.uuid4().hex[:8]}"
    p = Pipeline(pid, chaining=True)
    src = p.source("orders", lambda s: _source(s, servers, source))
    p.stage("unique", logic, inputs=[src])
    p.sink("out", inputs=["unique"], transform=to_kafka, kafka=KafkaTarget(out, servers))
    store = EpochStore(dsn)
    store.migrate()
    with tempfile.TemporaryDirectory() as storage:
        driver = PipelineDriver(p, store, storage_uri=storage, spark=spark)
        thread = DriverThread(driver).start()
        wait_for(lambda: driver.started.is_set() or thread.error, timeout=300, what="the pipeline to start")
        print("READY", flush=True)
        with CheckpointTicker(store, pid, interval=interval, tick=0.05):
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline and thread.error is None:
                time.sleep(0.5)
        store.request_stop(pid, "immediate")
        thread.join(120)
    store.close()
    spark.stop()


class Side:
    """One side's run in a subprocess: started, READY awaited, stopped."""

    def __init__(self, side: str, servers: str, source: str, out: str, seconds: float, dsn: str,
                 interval: float) -> None:
        cmd = [sys.executable, __file__, "--side", side, "--servers", servers, "--source", source, "--out", out,
               "--seconds", str(seconds), "--interval", str(interval)]
        env = {**os.environ, "ARROYO_BENCH_DSN": dsn, "PYSPARK_PYTHON": sys.executable}
        self.log = open(Path(tempfile.gettempdir()) / f"kafka-e2e-{side}-{uuid.uuid4().hex[:6]}.log", "w")  # noqa: SIM115
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.log, env=env, cwd=REPO, text=True)

    def ready(self, timeout: float = 300.0) -> float:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if line.strip() == "READY":
                return time.monotonic()
            if not line and self.proc.poll() is not None:
                break
        raise RuntimeError(f"side did not start; see {self.log.name}")

    def stop(self) -> None:
        try:
            self.proc.wait(180)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)
        self.log.close()


def _follow(broker: Any, topic: str, until: Callable[[], bool], on_record: Callable[[dict[str, Any], float], None]
            ) -> None:
    from confluent_kafka import OFFSET_BEGINNING, TopicPartition

    consumer = broker.consumer(read_committed=True)
    consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in broker.partitions(topic)])
    try:
        while not until():
            for msg in consumer.consume(1000, 0.05):
                if msg.error() is None:
                    on_record(json.loads(msg.value()), time.time())
    finally:
        consumer.close()


def capacity(broker: Any, side: str, backlog: int, dsn: str, interval: float) -> dict[str, Any]:
    source, out = f"cap-in-{uuid.uuid4().hex[:6]}", f"cap-out-{uuid.uuid4().hex[:6]}"
    broker.create_topic(source, partitions=3)
    broker.create_topic(out, partitions=3)
    now = int(time.time() * 1000)
    broker.produce(source, [(f"k{i % 50}", json.dumps({"id": i, "key": f"k{i % 50}", "ts": now}))
                            for i in range(backlog)])
    seen: set[int] = set()
    launched = time.monotonic()  # the product's start runs its first batch before it says READY: time from launch
    run = Side(side, broker.bootstrap_servers, source, out, 600, dsn, interval)
    ready = run.ready() - launched
    _follow(broker, out, lambda: len(seen) >= backlog or time.monotonic() - launched > 540,
            lambda rec, _t: seen.add(rec["id"]))
    took = time.monotonic() - launched
    run.proc.terminate()
    run.stop()
    return {"side": side, "orders": len(seen), "ready_s": round(ready, 2), "seconds": round(took, 2),
            "orders_per_s": round(len(seen) / took)}


def latency(broker: Any, side: str, rate: int, warmup: float, duration: float, dsn: str,
            interval: float) -> dict[str, Any]:
    source, out = f"lat-in-{uuid.uuid4().hex[:6]}", f"lat-out-{uuid.uuid4().hex[:6]}"
    broker.create_topic(source, partitions=3)
    broker.create_topic(out, partitions=3)
    run = Side(side, broker.bootstrap_servers, source, out, warmup + duration + 60, dsn, interval)
    run.ready()
    t0 = time.time()
    window = (t0 + warmup, t0 + warmup + duration)
    produced = 0
    stop = threading.Event()

    def produce() -> None:
        nonlocal produced
        producer = broker.producer({"linger.ms": 5})
        i = 0
        while not stop.is_set() and time.time() < window[1]:
            wait = t0 + i / rate - time.time()
            if wait > 0:
                time.sleep(min(wait, 0.01))
                continue
            ts = int(time.time() * 1000)
            producer.produce(source, key=f"k{i % 50}", value=json.dumps({"id": i, "key": f"k{i % 50}", "ts": ts}))
            producer.poll(0)
            i += 1
        producer.flush(30)
        produced = i

    lat: list[float] = []
    in_window = 0
    thread = threading.Thread(target=produce)
    thread.start()

    def record(rec: dict[str, Any], at: float) -> None:
        nonlocal in_window
        if window[0] * 1000 <= rec["ts"] < window[1] * 1000:
            in_window += 1
            lat.append(at * 1000 - rec["ts"])

    _follow(broker, out, lambda: time.time() > window[1] + 20, record)
    stop.set()
    thread.join()
    run.proc.terminate()
    run.stop()
    lat.sort()
    q = statistics.quantiles(lat, n=100) if len(lat) > 1 else [float("nan")] * 99
    return {"side": side, "rate": rate, "visible": in_window, "throughput": round(in_window / duration),
            "p50_ms": round(q[49]), "p99_ms": round(q[98]), "produced": produced}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--backlog", type=int, default=200_000, help="orders in the capacity runs")
    parser.add_argument("--rate", type=int, default=1000, help="orders/s in the latency runs")
    parser.add_argument("--warmup", type=float, default=20.0)
    parser.add_argument("--duration", type=float, default=40.0)
    parser.add_argument("--interval", type=float, default=2.0, help="the product's seconds between epochs")
    parser.add_argument("--side", choices=["plain", "product"], help=argparse.SUPPRESS)
    parser.add_argument("--servers", help=argparse.SUPPRESS)
    parser.add_argument("--source", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--seconds", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.side == "plain":
        run_plain(args.servers, args.source, args.out, args.seconds)
        return 0
    if args.side == "product":
        run_product(args.servers, args.source, args.out, args.seconds, os.environ["ARROYO_BENCH_DSN"], args.interval)
        return 0

    from airflow_arroyo.devtools.kafka import KafkaBroker
    from airflow_arroyo.devtools.postgres import ThrowawayPostgres

    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as base, KafkaBroker(Path(base) / "kafka", heap="1g") as broker:
        pg_dir = Path(tempfile.mkdtemp(prefix="arroyo-pg-"))  # not below a 0700 folder: the server may run as postgres
        pg = ThrowawayPostgres(base_dir=pg_dir)
        pg.start()
        try:
            for r in range(args.rounds):
                order = ["plain", "product"] if r % 2 == 0 else ["product", "plain"]
                for side in order:
                    dsn = pg.create_database(f"bench_{uuid.uuid4().hex[:8]}")
                    results.append({"round": r, "kind": "capacity",
                                    **capacity(broker, side, args.backlog, dsn, args.interval)})
                    print(json.dumps(results[-1]), flush=True)
                for side in order:
                    dsn = pg.create_database(f"bench_{uuid.uuid4().hex[:8]}")
                    results.append({"round": r, "kind": "latency",
                                    **latency(broker, side, args.rate, args.warmup, args.duration, dsn,
                                              args.interval)})
                    print(json.dumps(results[-1]), flush=True)
        finally:
            pg.cleanup()
            shutil.rmtree(pg_dir, ignore_errors=True)

    def med(kind: str, side: str, key: str) -> float:
        return float(statistics.median(x[key] for x in results if x["kind"] == kind and x["side"] == side))

    print(f"\ncapacity (orders/s, median of {args.rounds}): plain {med('capacity', 'plain', 'orders_per_s'):.0f}, "
          f"product {med('capacity', 'product', 'orders_per_s'):.0f}, product/plain "
          f"{med('capacity', 'product', 'orders_per_s') / med('capacity', 'plain', 'orders_per_s'):.2f}")
    for key in ("p50_ms", "p99_ms", "throughput"):
        plain, product = med("latency", "plain", key), med("latency", "product", key)
        print(f"at {args.rate} orders/s, epochs every {args.interval:g} s: {key} plain {plain:.0f}, product "
              f"{product:.0f}, product/plain {product / plain:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
