-- Bounded store (issue 11): retention compacts what no restore can need, so the tables stay flat.
--
-- Compaction cuts a pipeline's arroyo_history at a point where no cleanup lease was held (a release
-- older than the compaction horizon) and deletes the history up to it, the pruned epochs (with their
-- acks) pruned before it and the cleanup runs that ended by it. arroyo_history_base records the cut,
-- so that the history checker (airflow_arroyo.devtools.history) starts its replay there: the epochs
-- already in the table at the cut are seeded from the table instead of their (deleted) inserts.
--
-- through_seq: the last arroyo_history.seq deleted (every event of the pipeline up to it is gone or
--              being deleted in batches); max_epoch: the highest epoch triggered by then;
-- cut_at:      the cut event's time; cleanup_run: the run whose lease release is the cut.

CREATE TABLE arroyo_history_base (
    pipeline_id  text PRIMARY KEY REFERENCES arroyo_pipelines (pipeline_id) ON DELETE CASCADE,
    through_seq  bigint NOT NULL CHECK (through_seq > 0),
    max_epoch    bigint NOT NULL CHECK (max_epoch >= 0),
    cut_at       timestamptz NOT NULL,
    cleanup_run  bigint NOT NULL,
    compacted_at timestamptz NOT NULL DEFAULT clock_timestamp()
);

-- Compaction deletes pruned epochs by age in bounded batches.
CREATE INDEX arroyo_epochs_pruned_at ON arroyo_epochs (pipeline_id, pruned_at) WHERE state = 'pruned';
