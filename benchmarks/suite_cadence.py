"""What the default cadence of a query that reads Spark sources costs the test suite's slowest tests, side by side.

Two copies of the checkout's committed tree (``git archive HEAD``) that differ only in
``airflow_arroyo.runtime.stage.DEFAULT_TRIGGER_INTERVAL``; each round runs the chosen tests once from each copy,
in alternating order (``PYTHONPATH`` and the working folder point at the copy, so the tests and the drivers they
start run its code), with the suite's JVM options. Prints each test's seconds per cadence and round (pytest's own
``call`` duration) and, per test and in total, the ratio of the second cadence to the first.

    python benchmarks/suite_cadence.py                                  # 0.1 against 0.5, two rounds
    python benchmarks/suite_cadence.py --cadences 0.1 0.5 --rounds 1 --tests tests/runtime/test_kafka_pipeline.py
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _spark import SUITE_JAVA_OPTIONS

ROOT = Path(__file__).resolve().parent.parent
TESTS = [
    "tests/runtime/test_exactly_once.py::test_sigkill_with_everything_on_s3_is_exactly_once",
    "tests/runtime/test_fencing_takeover.py::test_a_live_superseded_driver_cannot_write_and_the_output_stays_exact",
]
_DEFAULT = re.compile(r"^DEFAULT_TRIGGER_INTERVAL = [0-9.]+$", re.MULTILINE)
_DURATION = re.compile(r"^\s*([0-9.]+)s call\s+(\S+)$", re.MULTILINE)


def copy_with_cadence(target: Path, cadence: float) -> None:
    """The committed tree in ``target``, its sources' default cadence set to ``cadence``."""
    target.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "HEAD"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(target)], input=archive, check=True)
    stage = target / "airflow_arroyo" / "runtime" / "stage.py"
    text, found = _DEFAULT.subn(f"DEFAULT_TRIGGER_INTERVAL = {cadence!r}", stage.read_text())
    if found != 1:
        raise SystemExit(f"no single DEFAULT_TRIGGER_INTERVAL line in {stage}")
    stage.write_text(text)


def run_tests(copy: Path, tests: list[str]) -> dict[str, float]:
    """The call duration pytest reports per test id, run from ``copy``."""
    env = {**os.environ, "PYTHONPATH": str(copy), "PYSPARK_PYTHON": sys.executable,
           "PYSPARK_DRIVER_PYTHON": sys.executable, "JDK_JAVA_OPTIONS": SUITE_JAVA_OPTIONS,
           "ARROYO_JVM_CACHE": os.environ.get("ARROYO_JVM_CACHE", str(ROOT / ".cache" / "jvm"))}
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--durations=0",
                           "--durations-min=1", *tests], cwd=copy, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"the tests failed in {copy}:\n{done.stdout[-4000:]}")
    return {test: float(seconds) for seconds, test in _DURATION.findall(done.stdout)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cadences", nargs=2, type=float, default=[0.1, 0.5], metavar=("FIRST", "SECOND"))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tests", nargs="+", default=TESTS)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="arroyo-cadence-") as tmp:
        copies = {c: Path(tmp) / f"cadence-{c:g}" for c in args.cadences}
        for cadence, copy in copies.items():
            copy_with_cadence(copy, cadence)
        seconds: dict[float, dict[str, list[float]]] = {c: {} for c in args.cadences}
        for r in range(args.rounds):
            order = args.cadences if r % 2 == 0 else args.cadences[::-1]
            for cadence in order:
                for test, s in run_tests(copies[cadence], args.tests).items():
                    seconds[cadence].setdefault(test, []).append(s)
                    print(f"round {r + 1}, sources every {cadence:g}s: {s:7.1f}s  {test}", flush=True)
    first, second = args.cadences
    print(f"\nmedians over {args.rounds} rounds (seconds), sources every {first:g}s against {second:g}s:")
    totals = [0.0, 0.0]
    for test in sorted(seconds[first]):
        a, b = statistics.median(seconds[first][test]), statistics.median(seconds[second].get(test, [0.0]))
        totals[0] += a
        totals[1] += b
        print(f"  {a:7.1f} {b:7.1f}  {b / a:5.2f}x  {test}")
    print(f"  {totals[0]:7.1f} {totals[1]:7.1f}  {totals[1] / totals[0]:5.2f}x  all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
