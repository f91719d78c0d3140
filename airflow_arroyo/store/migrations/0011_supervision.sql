-- Supervision (issue 11, restart strategies): a supervised pipeline's failures and restarts
-- (docs/airflow.md, "Supervision"; the decisions are airflow_arroyo.supervision's).
--
-- arroyo_pipelines.supervision: what the supervisor of the current lineage does ('watching': the run is up
-- or starting; 'restarting': a failure was recorded and a restart is due; 'gave_up': the strategy gave up;
-- 'ended': the pipeline stopped, or nobody supervises it any more); NULL: never supervised.
-- supervised_run: the lineage, the first run id of the chain (a restart's run is <lineage>.restart<n>);
-- supervised_since: when this supervision began (a lineage supervised again later, e.g. a cleared DAG run
-- reusing its run id, starts its count afresh); restart_strategy: the strategy as configured (its dict).
--
-- arroyo_restarts: one row per failure the supervisor noticed, in the order noticed (attempt 1, 2, ...):
-- the failed run, the cause, the delay decided, and once resubmitted the new run and the epoch it restores
-- (gave_up: the strategy gave up on that failure, no restart follows). A failure is recorded once per
-- failed run and supervision (a restarted triggerer noticing it again finds the row).

ALTER TABLE arroyo_pipelines
    ADD COLUMN supervision text CHECK (supervision IN ('watching', 'restarting', 'gave_up', 'ended')),
    ADD COLUMN supervised_run text,
    ADD COLUMN supervised_since timestamptz,
    ADD COLUMN restart_strategy jsonb;

CREATE TABLE arroyo_restarts (
    pipeline_id    text        NOT NULL REFERENCES arroyo_pipelines (pipeline_id) ON DELETE CASCADE,
    lineage        text        NOT NULL,
    supervised_since timestamptz NOT NULL,
    attempt        integer     NOT NULL CHECK (attempt > 0),
    failed_run_id  text        NOT NULL,
    cause          text        NOT NULL,
    failed_at      timestamptz NOT NULL DEFAULT clock_timestamp(),
    delay_s        double precision NOT NULL DEFAULT 0 CHECK (delay_s >= 0),
    gave_up        boolean     NOT NULL DEFAULT false,
    decision       text,
    new_run_id     text,
    restored_epoch bigint,
    restarted_at   timestamptz,
    PRIMARY KEY (pipeline_id, lineage, supervised_since, attempt),
    UNIQUE (pipeline_id, supervised_since, failed_run_id)
);
