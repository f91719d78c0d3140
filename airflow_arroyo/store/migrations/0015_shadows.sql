-- Shadow runs (issue 32, deliverable 5): a fork of a live pipeline's pinned epoch that runs new code against
-- shadow sinks, compared with the live pipeline epoch by epoch, then promoted or discarded.
--
-- One row per shadow pipeline (itself a fork: arroyo_pipelines.forked_from_* name its fork point). ``code`` is
-- the new code (the driver's --pipeline MODULE:ATTR), ``sinks`` maps each sink of the live code to its shadow
-- target ({"sink": {"kind": "files", "live": "<path>", "shadow": "<path>"}}), what compare reads.
CREATE TABLE arroyo_shadows (
    shadow_id     text PRIMARY KEY REFERENCES arroyo_pipelines (pipeline_id) ON DELETE CASCADE,
    live_id       text NOT NULL REFERENCES arroyo_pipelines (pipeline_id) ON DELETE CASCADE,
    fork_epoch    bigint NOT NULL CHECK (fork_epoch > 0),
    code          text NOT NULL,
    sinks         jsonb NOT NULL DEFAULT '{}'::jsonb,
    state         text NOT NULL DEFAULT 'active' CHECK (state IN ('active', 'promoted', 'discarded')),
    created_at    timestamptz NOT NULL DEFAULT clock_timestamp(),
    ended_at      timestamptz,
    CONSTRAINT arroyo_shadows_not_self CHECK (shadow_id <> live_id),
    CONSTRAINT arroyo_shadows_ended CHECK ((state = 'active') = (ended_at IS NULL))
);

CREATE INDEX arroyo_shadows_live ON arroyo_shadows (live_id, created_at);
