-- Forks (issue 11, savepoint-style operations): a new pipeline id that starts from a completed epoch of
-- another pipeline, sharing that epoch's snapshot objects instead of copying them (docs/retention.md,
-- "Forks").
--
-- arroyo_pipelines.forked_from_pipeline / forked_from_epoch / forked_at: set together, once, by
-- EpochStore.fork_pipeline when it creates the fork's row (state 'stopped', no run yet; last_epoch = the
-- fork point, so the fork's own epochs are numbered after it). The fork point is pinned in the source
-- (label 'fork:<fork id>' unless it was pinned already), and it cannot be unpinned while the fork has not
-- completed an epoch of its own: until then the fork's first restore reads the source's objects and channel
-- ranges. A fork's own snapshots are recorded under its own pipeline id and path, so retention of either
-- pipeline only ever deletes objects of its own.

ALTER TABLE arroyo_pipelines
    ADD COLUMN forked_from_pipeline text REFERENCES arroyo_pipelines (pipeline_id),
    ADD COLUMN forked_from_epoch bigint CHECK (forked_from_epoch > 0),
    ADD COLUMN forked_at timestamptz,
    ADD CONSTRAINT arroyo_pipelines_fork_whole CHECK (
        (forked_from_pipeline IS NULL) = (forked_from_epoch IS NULL)
        AND (forked_from_pipeline IS NULL) = (forked_at IS NULL)),
    ADD CONSTRAINT arroyo_pipelines_fork_other CHECK (forked_from_pipeline IS DISTINCT FROM pipeline_id);

CREATE INDEX arroyo_pipelines_by_fork_point ON arroyo_pipelines (forked_from_pipeline, forked_from_epoch)
    WHERE forked_from_pipeline IS NOT NULL;
