"""What a file sink's commit costs as the sink's output grows: this tree's commit against an earlier revision's,
side by side on the same folders.

Each size is a sink folder of a fenced run (generation 1, every run the store registers is one) that already
committed ``N`` batches (one part file and one manifest each: made directly, not by Spark, since only names and
manifests matter to a commit). Then, alternating, the earlier revision's sink and this tree's commit one new
pending batch each (a part file and its ``_arroyo_batch.json``, as the pre-commit leaves them), ``--rounds``
times; each sink object commits twice before it is timed (this tree searches for a superseded run's files at a
run's first two commits). Prints the median commit time of each and their ratio, per size.

    python benchmarks/sink_commit_cost.py                       # sizes 1,000 10,000 50,000; baseline 3a1108a
    python benchmarks/sink_commit_cost.py --sizes 1000 --rounds 5 --baseline <rev>

The baseline is read from this repository's git history (``git show <rev>:airflow_arroyo/runtime/sinks/files.py``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

from airflow_arroyo.runtime.sinks.files import TransactionalFileSink
from airflow_arroyo.store import FencingToken

ROOT = Path(__file__).resolve().parent.parent
PART = b"PAR1" + b"\0" * 2048 + b"PAR1"  # a file's bytes do not matter to a commit: it moves them


def load_baseline(rev: str, where: Path) -> ModuleType:
    source = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:airflow_arroyo/runtime/sinks/files.py"],
                            check=True, capture_output=True, text=True).stdout
    path = where / "files_baseline.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("files_baseline", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["files_baseline"] = module
    spec.loader.exec_module(module)
    return module


def committed_folder(root: Path, batches: int) -> None:
    """A folder a generation-1 run has committed ``batches`` batches to since its takeover at batch -1."""
    meta = root / "_arroyo_sink"
    (meta / "committed").mkdir(parents=True)
    (meta / "pending").mkdir()
    (meta / "owner.json").write_text(json.dumps({"pipeline": "p", "stage": "out", "format": "parquet"}))
    for b in range(batches):
        name = f"{b:012d}-g1-part-00000.parquet"
        (root / name).write_bytes(PART)
        (meta / "committed" / f"{b:012d}-g1.json").write_text(json.dumps({"batch": b, "files": [name]}))
    (meta / "committed-g1.json").write_text(
        json.dumps({"through": batches - 1, "generation": 1, "base": -1}))


def pre_commit(root: Path, batch: int) -> None:
    folder = root / "_arroyo_sink" / "pending" / f"{batch}-g1"
    folder.mkdir(parents=True)
    (folder / "part-00000.parquet").write_bytes(PART)
    (folder / "_arroyo_batch.json").write_text(json.dumps({"rows": 1, "moved": False}))


def sink(cls: Any, root: Path) -> Any:
    s = cls("p", "out", "parquet", {"path": str(root)})
    s.token = FencingToken("p", "r1", 1)
    return s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000, 10_000, 50_000])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--baseline", default="3a1108a")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="sink-commit-") as tmp:
        baseline = load_baseline(args.baseline, Path(tmp))
        print(f"baseline {args.baseline} against this tree; median of {args.rounds} commits each, alternating")
        print(f"{'committed batches':>18} {'baseline (ms)':>14} {'this tree (ms)':>15} {'this / baseline':>16}")
        for size in args.sizes:
            root = Path(tmp) / f"out-{size}"
            committed_folder(root, size)
            sinks = {"baseline": sink(baseline.TransactionalFileSink, root), "this": sink(TransactionalFileSink, root)}
            times: dict[str, list[float]] = {name: [] for name in sinks}
            batch = size
            for r in range(args.rounds + 2):
                for name, s in sinks.items():
                    pre_commit(root, batch)
                    t0 = time.perf_counter()
                    s.commit_through(batch)
                    elapsed = time.perf_counter() - t0
                    if r >= 2:
                        times[name].append(elapsed)
                    batch += 1
            committed = sum(1 for _ in root.glob("*.parquet"))
            assert committed == batch, (committed, batch)
            old, new = (statistics.median(times[n]) * 1000 for n in ("baseline", "this"))
            print(f"{size:>18,} {old:>14.1f} {new:>15.1f} {new / old:>16.3f}")


if __name__ == "__main__":
    main()
