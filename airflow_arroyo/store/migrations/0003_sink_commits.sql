-- What each exactly-once file sink made visible, epoch by epoch (second phase of its two-phase
-- commit, written by the driver right after it moved the files). Airflow turns these rows into
-- Asset events (airflow_arroyo.assets): a downstream DAG reads a sink's files of batches <= batch_id.
-- seq orders the commits of all pipelines: an Asset watcher resumes after the last seq it emitted.
CREATE TABLE arroyo_sink_commits (
    seq             bigserial PRIMARY KEY,
    pipeline_id     text NOT NULL REFERENCES arroyo_pipelines (pipeline_id) ON DELETE CASCADE,
    epoch           bigint NOT NULL CHECK (epoch > 0),
    sink            text NOT NULL,
    uri             text NOT NULL,
    run_id          text,
    batch_id        bigint NOT NULL CHECK (batch_id >= -1),   -- committed through this micro-batch
    files           integer NOT NULL CHECK (files >= 0),      -- made visible by this commit
    rows_committed  bigint CHECK (rows_committed >= 0),       -- NULL: unknown (a batch without a count)
    bytes_committed bigint NOT NULL CHECK (bytes_committed >= 0),
    committed_at    timestamptz NOT NULL DEFAULT clock_timestamp(),
    UNIQUE (pipeline_id, sink, epoch)
);
CREATE INDEX arroyo_sink_commits_by_pipeline ON arroyo_sink_commits (pipeline_id, seq);
