"""What a transfer to Python leaves in the driver's JVM with Python workers over a Unix domain socket, with and
without :class:`airflow_arroyo.jvm.SocketPathPruner`, side by side in one JVM.

With ``spark.python.unix.domain.socket.enabled`` (which the provider turns on for local and standalone
masters), Spark registers the socket file of every transfer it serves to Python (``toArrow()``, ``collect()``:
a stage's micro-batch collected to the driver is one) with ``File.deleteOnExit()`` and deletes the file when
the transfer ends; the JDK keeps every registered path until the JVM exits. Per round, two sides of
``--transfers`` calls of ``spark.range(1).toArrow()`` each, in alternating order:

* **kept**: nothing prunes; then one prune shows what the list held (jcmd's class histogram before and after);
* **pruned**: the driver's rule, a prune every ``--every`` transfers (the driver prunes after every heartbeat).

Prints per round and side the delete-on-exit list's growth per transfer and the live heap's change over the
side (jcmd's class histogram, which collects garbage first), and for the kept side how many of the list's set
entries (``LinkedHashMap$Entry`` instances) the one prune freed per path; then the medians, the ratio pruned /
kept of the list's growth, and what a path holds by the JVM's object layout (the set's entry and the
``String``, their sizes from the histogram, and the path's bytes: Spark's socket folder, here the JVM's
temporary folder, plus a 42-character name). Bytes freed by a prune are not reported: other objects collected
between the two histograms move them by more than the paths hold. The live heap's change over a side holds
Spark's and py4j's objects of the latest queries too (Spark's status store keeps the last jobs, stages and SQL
executions: the session keeps 20 of each, and a warm-up fills them; a query's plan stays until Python collects
its DataFrame): it varies by a megabyte or two from side to side and does not grow with the transfers.

    python benchmarks/socket_paths.py                  # 2 rounds of 2,000 transfers a side: about 5 minutes
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
from typing import Any

os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)

from _spark import jvm_pid, local_session_builder, product_confs

from airflow_arroyo.jvm import SocketPathPruner

RETAINED = {"spark.sql.ui.retainedExecutions": "20", "spark.ui.retainedJobs": "20", "spark.ui.retainedStages": "20",
            "spark.ui.retainedTasks": "200"}


ENTRY, STRING = "java.util.LinkedHashMap$Entry", "java.lang.String"  # a registered path: an entry and a String


def live_heap(pid: int) -> dict[str, tuple[int, int]]:
    """The JVM's live objects by class as (instances, bytes), and ``total`` (jcmd's class histogram, after a
    full collection)."""
    out = subprocess.run(["jcmd", str(pid), "GC.class_histogram"], capture_output=True, text=True, check=True).stdout
    heap = {m.group(3): (int(m.group(1)), int(m.group(2)))
            for m in re.finditer(r"^\s*\d+:\s+(\d+)\s+(\d+)\s+(\S+)", out, re.MULTILINE)}
    found = re.search(r"^Total\s+(\d+)\s+(\d+)", out, re.MULTILINE)
    if found is None:
        raise RuntimeError(f"no total in jcmd's class histogram: {out[-500:]}")
    heap["total"] = (int(found.group(1)), int(found.group(2)))
    return heap


def instance_size(heap: dict[str, tuple[int, int]], cls: str) -> int:
    instances, size = heap[cls]
    return size // instances


def path_layout_bytes(heap: dict[str, tuple[int, int]], socket_dir: str) -> int:
    """A registered path's bytes by the JVM's layout: the set's entry, the ``String``, and its Latin-1 bytes
    (a 16-byte array header, padded to 8); Spark's name for a socket file is 42 characters, ``.<uuid>.sock``."""
    chars = len(socket_dir.rstrip("/")) + 1 + 42
    return instance_size(heap, ENTRY) + instance_size(heap, STRING) + (16 + chars + 7) // 8 * 8


def transfers(spark: Any, count: int, pruner: SocketPathPruner | None, every: int) -> None:
    for i in range(1, count + 1):
        spark.range(1).toArrow()
        if pruner is not None and i % every == 0:
            pruner.prune()


def side(spark: Any, pid: int, name: str, count: int, every: int, pruner: SocketPathPruner) -> dict[str, float]:
    pruner.prune(keep_newest=0)
    listed, heap = pruner.registered(), live_heap(pid)
    transfers(spark, count, pruner if name == "pruned" else None, every)
    grown, after = pruner.registered() - listed, live_heap(pid)
    out = {"list growth per transfer": grown / count,
           "live heap change over the side (KB)": (after["total"][1] - heap["total"][1]) / 1024}
    if name == "kept":
        pruner.prune(keep_newest=0)
        out["set entries freed per path"] = (after[ENTRY][0] - live_heap(pid)[ENTRY][0]) / max(1, grown)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--transfers", type=int, default=2000, help="transfers per side and round")
    parser.add_argument("--every", type=int, default=100, help="the pruned side prunes every N transfers")
    parser.add_argument("--warmup", type=int, default=300, help="transfers before the first round")
    args = parser.parse_args(argv)

    spark = local_session_builder("arroyo-socket-paths", confs={**product_confs({}), **RETAINED}).getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    pruner = SocketPathPruner(spark, keep_newest=16)
    if not pruner.active:
        raise SystemExit("the provider's jar is not on the driver's class path (airflow_arroyo.jvm.master_conf)")
    jvm = spark.sparkContext._jvm
    assert jvm is not None
    pid = jvm_pid(spark)
    socket_dir = str(spark.sparkContext.getConf().get("spark.python.unix.domain.socket.dir")
                     or jvm.java.lang.System.getProperty("java.io.tmpdir"))
    transfers(spark, args.warmup, pruner, args.every)
    results: dict[str, list[dict[str, float]]] = {"kept": [], "pruned": []}
    layout = path_layout_bytes(live_heap(pid), socket_dir)
    for r in range(args.rounds):
        for name in (("kept", "pruned") if r % 2 == 0 else ("pruned", "kept")):
            got = side(spark, pid, name, args.transfers, args.every, pruner)
            results[name].append(got)
            print(f"round {r + 1} {name:>6}: " + ", ".join(f"{k} {v:,.2f}" for k, v in got.items()), flush=True)
    spark.stop()

    print(f"\nmedians over {args.rounds} rounds of {args.transfers:,} transfers a side (pruned: every {args.every})")
    for measure in ("list growth per transfer", "live heap change over the side (KB)"):
        kept = statistics.median(g[measure] for g in results["kept"])
        pruned = statistics.median(g[measure] for g in results["pruned"])
        ratio = f", pruned / kept {pruned / kept:.3f}" if measure.startswith("list") and kept else ""
        print(f"  {measure}: kept {kept:,.2f}, pruned {pruned:,.2f}{ratio}")
    freed = statistics.median(g["set entries freed per path"] for g in results["kept"])
    print(f"  set entries one prune freed, per kept path: {freed:.2f}")
    print(f"  a path in {socket_dir} by the JVM's layout: {layout} bytes; a million transfers kept: {layout} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
