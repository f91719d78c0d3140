-- Commit gates (issue 33): a gated sink's output of an epoch waits for a verdict before it commits.
--
-- One row per (pipeline, sink, epoch) the driver opened a gate for: the epoch completed and its pre-committed
-- output (the sink's micro-batches batch_from..batch_to) waits. A verdict (an Airflow task, a person through the
-- UI, the CLI) moves it from 'pending' to 'passed' or 'failed'; the driver times out a verdict that never came
-- ('timed_out'), commits a passed one in epoch order ('committed'), and under the quarantine policy moves a
-- failed one's output aside ('quarantined'). A restore to an epoch before it ends it ('superseded': the epoch's
-- output is recomputed, under a gate of its own). A failed or timed-out one can still be passed (a person's
-- approval after a look): the policy decides what waits meanwhile.
CREATE TABLE arroyo_gates (
    pipeline_id   text NOT NULL REFERENCES arroyo_pipelines (pipeline_id) ON DELETE CASCADE,
    sink          text NOT NULL,
    epoch         bigint NOT NULL CHECK (epoch > 0),
    run_id        text NOT NULL,
    uri           text NOT NULL,
    policy        text NOT NULL CHECK (policy IN ('hold', 'rollback_and_stop', 'quarantine')),
    batch_from    bigint NOT NULL CHECK (batch_from >= 0),
    batch_to      bigint NOT NULL CHECK (batch_to >= batch_from - 1),  -- batch_from - 1: the epoch wrote nothing
    details       jsonb NOT NULL DEFAULT '{}'::jsonb,                  -- where the pending output is (per sink kind)
    state         text NOT NULL DEFAULT 'pending' CHECK (state IN
                      ('pending', 'passed', 'failed', 'timed_out', 'committed', 'quarantined', 'superseded')),
    opened_at     timestamptz NOT NULL DEFAULT clock_timestamp(),
    deadline      timestamptz,                                         -- NULL: a verdict may take for ever
    decided_by    text,
    reason        text CHECK (reason IS NULL OR length(reason) <= 4000),
    decided_at    timestamptz,
    closed_at     timestamptz,
    seq           bigserial UNIQUE,                                    -- opening order: what an Asset watcher resumes after
    PRIMARY KEY (pipeline_id, sink, epoch),
    CONSTRAINT arroyo_gates_decided CHECK ((state IN ('pending', 'superseded')) OR decided_at IS NOT NULL
)
);
CREATE INDEX arroyo_gates_open ON arroyo_gates (pipeline_id, epoch)
    WHERE state IN ('pending', 'passed', 'failed', 'timed_out');
