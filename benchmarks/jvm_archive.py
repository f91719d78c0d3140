"""A Spark driver's start with and without the test suite's class-data-sharing archive, side by side.

Each round starts two driver processes one after the other, in alternating order: a session as the provider
builds it on ``local[2]`` (``airflow_arroyo.jvm.master_conf``), then one small aggregation; one with the JVM options
the suite runs with (``--java-options``, default C1 and the serial collector, as ``scripts/dev.sh test``), one with
those and the archive (``airflow_arroyo.devtools.jvm_archive``, trained first if missing). Prints, per variant, the
median seconds to a started session and to the first query's result, and the archive's ratios.

    python benchmarks/jvm_archive.py                 # 5 rounds
    python benchmarks/jvm_archive.py --rounds 3 --java-options ""
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from _spark import SUITE_JAVA_OPTIONS

from airflow_arroyo.devtools import jvm_archive

_CHILD = """
import json, time
t0 = time.perf_counter()
from pyspark.sql import SparkSession
from airflow_arroyo.jvm import master_conf
builder = SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false")
for k, v in master_conf("local[2]").items():
    builder = builder.config(k, v)
spark = builder.getOrCreate()
t1 = time.perf_counter()
spark.range(1000).selectExpr("id % 10 AS k").groupBy("k").count().collect()
t2 = time.perf_counter()
spark.stop()
print(json.dumps({"session": t1 - t0, "first_query": t2 - t0}))
"""


def start_once(java_options: str) -> dict[str, float]:
    env = {**os.environ, "JDK_JAVA_OPTIONS": java_options, "PYSPARK_PYTHON": sys.executable}
    done = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, check=True)
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--java-options", default=SUITE_JAVA_OPTIONS)
    args = parser.parse_args()
    archive = jvm_archive.ensure(args.java_options)
    if archive is None:
        print("the archive could not be trained", file=sys.stderr)
        return 1
    variants = {"without": args.java_options, "archive": f"{args.java_options} {jvm_archive.use_options(archive)}"}
    times: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
    for r in range(args.rounds):
        order = list(variants) if r % 2 == 0 else list(reversed(variants))
        for name in order:
            times[name].append(start_once(variants[name]))
            print(f"round {r + 1} {name}: {times[name][-1]}", flush=True)
    print(f"\nJVM options: {args.java_options or '(none)'}; {args.rounds} rounds, medians")
    print(f"{'':10} {'session s':>10} {'first query s':>14}")
    med = {name: {k: statistics.median(t[k] for t in runs) for k in ("session", "first_query")}
           for name, runs in times.items()}
    for name, m in med.items():
        print(f"{name:10} {m['session']:10.2f} {m['first_query']:14.2f}")
    print(f"{'ratio':10} {med['archive']['session'] / med['without']['session']:10.2f} "
          f"{med['archive']['first_query'] / med['without']['first_query']:14.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
