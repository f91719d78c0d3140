"""Cost of the UI's pipelines page as history grows, against the obvious aggregate query.

    .venv/bin/python benchmarks/ui_pipelines_page.py                       # 50 pipelines, 1k and 20k epochs each
    .venv/bin/python benchmarks/ui_pipelines_page.py --epochs 1000 100000  # longer histories

For each history length it loads ``--pipelines`` pipelines with that many epochs each (95 % completed,
the rest failed/expired, the newest in flight) straight into a throwaway PostgreSQL (bulk SQL; the
store's per-row trigger is disabled during the load), ANALYZEs, then times, in the same run:

* **ui**: ``StoreReader.pipelines(limit=50)``, the page's whole read (pipelines, last completed epoch
  per pipeline by a LATERAL probe of ``arroyo_epochs_by_state``, in-flight epoch, newest 10 epochs,
  live locks), one read-only snapshot;
* **aggregate**: the same "last completed epoch and in-flight epoch per pipeline" answered by one
  ``GROUP BY`` over ``arroyo_epochs`` (what a first version would write).

It prints the median of ``--repeat`` runs of each, and the ratio aggregate/ui per history length:
the ui column should stay flat as history grows, the aggregate one should grow with it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psycopg2

from airflow_arroyo.devtools.postgres import ThrowawayPostgres
from airflow_arroyo.store import EpochStore
from airflow_arroyo.store.reads import StoreReader

AGGREGATE = """
SELECT p.pipeline_id, a.last_completed, a.in_flight
FROM arroyo_pipelines p
LEFT JOIN (
    SELECT pipeline_id,
           max(epoch) FILTER (WHERE state = 'completed') AS last_completed,
           max(epoch) FILTER (WHERE state = 'triggered') AS in_flight
    FROM arroyo_epochs GROUP BY pipeline_id
) a USING (pipeline_id)
ORDER BY p.pipeline_id LIMIT 50
"""


def load(dsn: str, pipelines: int, epochs: int) -> None:
    conn = psycopg2.connect(dsn)
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute("ALTER TABLE arroyo_epochs DISABLE TRIGGER USER")
        cur.execute(
            "INSERT INTO arroyo_pipelines (pipeline_id, state, run_id, stages, checkpoint_interval_s, last_epoch,"
            " heartbeat_at) SELECT 'p' || lpad(i::text, 4, '0'), 'running', 'r1', ARRAY['src', 'sink'], 30, %s,"
            " now() FROM generate_series(1, %s) i",
            (epochs, pipelines),
        )
        cur.execute(
            "INSERT INTO arroyo_epochs (pipeline_id, epoch, state, run_id, stages, triggered_at, timeout_at,"
            " ended_at, bytes_new, bytes_total)"
            " SELECT 'p' || lpad(i::text, 4, '0'), n,"
            "   CASE WHEN n = %(n)s THEN 'triggered' WHEN n %% 20 = 0 THEN 'failed' WHEN n %% 53 = 0 THEN 'expired'"
            "        ELSE 'completed' END, 'r1', ARRAY['src', 'sink'],"
            "   now() - make_interval(secs => (%(n)s - n) * 30), now() - make_interval(secs => (%(n)s - n) * 30) +"
            "   interval '300 seconds',"
            "   CASE WHEN n = %(n)s THEN NULL ELSE now() - make_interval(secs => (%(n)s - n) * 30 - 2) END,"
            "   1000000, 500000000"
            " FROM generate_series(1, %(p)s) i CROSS JOIN generate_series(1, %(n)s) n",
            {"n": epochs, "p": pipelines},
        )
        cur.execute("ALTER TABLE arroyo_epochs ENABLE TRIGGER USER")
        cur.execute("VACUUM ANALYZE")
    conn.close()


def median_ms(fn: object, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()  # type: ignore[operator]
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pipelines", type=int, default=50)
    ap.add_argument("--epochs", type=int, nargs="+", default=[1000, 20000])
    ap.add_argument("--repeat", type=int, default=30)
    args = ap.parse_args()

    rows = []
    with ThrowawayPostgres() as pg:
        for n in args.epochs:
            dsn = pg.create_database(f"bench_{n}")
            store = EpochStore(dsn)
            store.migrate()
            store.close()
            t0 = time.perf_counter()
            load(dsn, args.pipelines, n)
            loaded_s = time.perf_counter() - t0
            ui = StoreReader(dsn)
            page = ui.pipelines(limit=50)
            assert len(page.items) == min(50, args.pipelines)
            assert all(o.last_completed is not None and o.in_flight is not None for o in page.items)
            conn = psycopg2.connect(dsn)
            conn.autocommit = True
            cur = conn.cursor()

            def aggregate(c: object = cur) -> None:
                c.execute(AGGREGATE)  # type: ignore[attr-defined]
                c.fetchall()  # type: ignore[attr-defined]

            ui_ms = median_ms(lambda q=ui: q.pipelines(limit=50), args.repeat)
            agg_ms = median_ms(aggregate, args.repeat)
            conn.close()
            ui.close()
            rows.append((n, args.pipelines * n, loaded_s, ui_ms, agg_ms))

    print(f"pipelines page, {args.pipelines} pipelines, median of {args.repeat} runs")
    print(f"{'epochs/pipeline':>16} {'epoch rows':>11} {'load s':>7} {'ui ms':>8} {'aggregate ms':>13} "
          f"{'aggregate/ui':>13}")
    for n, total, loaded_s, ui_ms, agg_ms in rows:
        print(f"{n:>16} {total:>11} {loaded_s:>7.1f} {ui_ms:>8.2f} {agg_ms:>13.2f} {agg_ms / ui_ms:>13.1f}x")
    if len(rows) > 1:
        first, last = rows[0], rows[-1]
        print(f"history x{last[0] / first[0]:.0f}: ui x{last[3] / first[3]:.2f}, aggregate x{last[4] / first[4]:.2f}")


if __name__ == "__main__":
    main()
