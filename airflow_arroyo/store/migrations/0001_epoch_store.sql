-- airflow-arroyo epoch store, schema version 1.
-- The database enforces what it can: valid states (CHECK), one in-flight epoch per pipeline
-- (partial unique index), epoch numbers increasing per pipeline (trigger), and it keeps its own
-- history of every state change and cleanup-lock hand-over (arroyo_history, written by triggers).
-- Legal transitions themselves live in airflow_arroyo/epochs.py (one table) and are applied as
-- guarded UPDATEs (WHERE state = ANY(<states allowed to reach the target>)).

CREATE TABLE arroyo_pipelines (
    pipeline_id        text PRIMARY KEY CHECK (pipeline_id ~ '^[A-Za-z0-9_.-]{1,200}$'),
    state              text NOT NULL DEFAULT 'registered'
                       CHECK (state IN ('registered', 'running', 'stopping', 'stopped', 'failed')),
    run_id             text,
    stages             text[] NOT NULL DEFAULT '{}',
    channels           jsonb NOT NULL DEFAULT '{}'::jsonb,      -- channel name -> URI
    storage_uri        text,                                   -- root of channels and snapshots
    checkpoint_interval_s double precision CHECK (checkpoint_interval_s IS NULL OR checkpoint_interval_s > 0),
    spark_app_id       text,
    spark_ui_url       text,
    heartbeat_at       timestamptz,
    failure_cause      text,
    stop_requested     text CHECK (stop_requested IN ('graceful', 'immediate')),
    restored_from_epoch bigint,
    last_epoch         bigint NOT NULL DEFAULT 0 CHECK (last_epoch >= 0),
    config             jsonb NOT NULL DEFAULT '{}'::jsonb,
    created_at         timestamptz NOT NULL DEFAULT now(),
    updated_at         timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE arroyo_epochs (
    pipeline_id     text NOT NULL REFERENCES arroyo_pipelines (pipeline_id) ON DELETE CASCADE,
    epoch           bigint NOT NULL CHECK (epoch > 0),
    state           text NOT NULL
                    CHECK (state IN ('triggered', 'completed', 'failed', 'expired', 'pruning', 'pruned')),
    run_id          text,
    stages          text[] NOT NULL,                 -- stages that must acknowledge
    is_final        boolean NOT NULL DEFAULT false,  -- stop-with-final-epoch
    triggered_by    text,
    triggered_at    timestamptz NOT NULL DEFAULT clock_timestamp(),
    timeout_at      timestamptz NOT NULL,
    ended_at        timestamptz,                     -- completed, failed or expired
    failure_reason  text,
    bytes_new       bigint,
    bytes_total     bigint,
    pruned_at       timestamptz,
    bytes_freed     bigint,
    PRIMARY KEY (pipeline_id, epoch),
    CHECK (timeout_at > triggered_at),
    CHECK ((state = 'triggered') = (ended_at IS NULL))
);

-- At most one epoch in flight per pipeline, whoever tries to insert a second.
CREATE UNIQUE INDEX arroyo_epochs_one_in_flight ON arroyo_epochs (pipeline_id) WHERE state = 'triggered';
CREATE INDEX arroyo_epochs_by_state ON arroyo_epochs (pipeline_id, state, epoch DESC);
CREATE INDEX arroyo_epochs_by_time ON arroyo_epochs (pipeline_id, triggered_at DESC);

CREATE TABLE arroyo_acks (
    pipeline_id   text NOT NULL,
    epoch         bigint NOT NULL,
    stage         text NOT NULL,
    acked_at      timestamptz NOT NULL DEFAULT clock_timestamp(),
    cursors       jsonb NOT NULL DEFAULT '{}'::jsonb,  -- input channel -> position a restored reader resumes at
    alignment_ms  double precision CHECK (alignment_ms >= 0),
    sync_ms       double precision CHECK (sync_ms >= 0),
    async_ms      double precision CHECK (async_ms >= 0),
    bytes_new     bigint CHECK (bytes_new >= 0),
    bytes_total   bigint CHECK (bytes_total >= 0),
    snapshot_uri  text,
    details       jsonb NOT NULL DEFAULT '{}'::jsonb,
    PRIMARY KEY (pipeline_id, epoch, stage),
    FOREIGN KEY (pipeline_id, epoch) REFERENCES arroyo_epochs (pipeline_id, epoch) ON DELETE CASCADE
);

-- Content-addressed snapshot objects (incremental snapshots reference, never re-copy, a held object).
CREATE TABLE arroyo_objects (
    pipeline_id   text NOT NULL REFERENCES arroyo_pipelines (pipeline_id) ON DELETE CASCADE,
    object_key    text NOT NULL,          -- path relative to the pipeline's snapshot root
    bytes         bigint NOT NULL CHECK (bytes >= 0),
    first_epoch   bigint NOT NULL,
    created_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (pipeline_id, object_key)
);

-- Which objects make up a stage's snapshot in an epoch, under which relative checkpoint path.
CREATE TABLE arroyo_epoch_objects (
    pipeline_id   text NOT NULL,
    epoch         bigint NOT NULL,
    stage         text NOT NULL,
    rel_path      text NOT NULL,
    object_key    text NOT NULL,
    PRIMARY KEY (pipeline_id, epoch, stage, rel_path),
    FOREIGN KEY (pipeline_id, epoch) REFERENCES arroyo_epochs (pipeline_id, epoch) ON DELETE CASCADE,
    FOREIGN KEY (pipeline_id, object_key) REFERENCES arroyo_objects (pipeline_id, object_key)
);
CREATE INDEX arroyo_epoch_objects_by_object ON arroyo_epoch_objects (pipeline_id, object_key);

-- The cleanup lock: a lease per pipeline. A crashed cleanup cannot hold it past expires_at.
CREATE TABLE arroyo_cleanup_locks (
    pipeline_id   text PRIMARY KEY REFERENCES arroyo_pipelines (pipeline_id) ON DELETE CASCADE,
    cleanup_run   bigint NOT NULL,
    holder        text NOT NULL,
    acquired_at   timestamptz NOT NULL DEFAULT clock_timestamp(),
    expires_at    timestamptz NOT NULL,
    CHECK (expires_at > acquired_at)
);

CREATE TABLE arroyo_cleanup_runs (
    id            bigserial PRIMARY KEY,
    pipeline_id   text NOT NULL REFERENCES arroyo_pipelines (pipeline_id) ON DELETE CASCADE,
    holder        text NOT NULL,
    state         text NOT NULL DEFAULT 'running'
                  CHECK (state IN ('running', 'succeeded', 'failed', 'lock_lost')),
    policy        jsonb NOT NULL DEFAULT '{}'::jsonb,
    started_at    timestamptz NOT NULL DEFAULT clock_timestamp(),
    ended_at      timestamptz,
    epochs_pruned bigint[] NOT NULL DEFAULT '{}',
    bytes_freed   bigint NOT NULL DEFAULT 0,
    error         text
);
CREATE INDEX arroyo_cleanup_runs_by_pipeline ON arroyo_cleanup_runs (pipeline_id, id DESC);

-- The database's own history. Written only by the triggers below.
CREATE TABLE arroyo_history (
    seq          bigserial PRIMARY KEY,
    at           timestamptz NOT NULL DEFAULT clock_timestamp(),
    txid         bigint NOT NULL DEFAULT txid_current(),
    pipeline_id  text NOT NULL,
    kind         text NOT NULL,   -- epoch_state | lock_acquired | lock_released
    epoch        bigint,
    old_state    text,
    new_state    text,
    cleanup_run  bigint,
    holder       text,
    lock_expires_at timestamptz
);
CREATE INDEX arroyo_history_by_pipeline ON arroyo_history (pipeline_id, seq);

CREATE FUNCTION arroyo_epochs_check_increasing() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM arroyo_epochs WHERE pipeline_id = NEW.pipeline_id AND epoch >= NEW.epoch) THEN
        RAISE EXCEPTION 'epoch % of pipeline % is not greater than every earlier epoch', NEW.epoch, NEW.pipeline_id
            USING ERRCODE = 'check_violation';
    END IF;
    RETURN NEW;
END $$;

CREATE TRIGGER arroyo_epochs_increasing BEFORE INSERT ON arroyo_epochs
    FOR EACH ROW EXECUTE FUNCTION arroyo_epochs_check_increasing();

CREATE FUNCTION arroyo_epochs_history() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        INSERT INTO arroyo_history (pipeline_id, kind, epoch, old_state, new_state)
        VALUES (NEW.pipeline_id, 'epoch_state', NEW.epoch, NULL, NEW.state);
    ELSIF NEW.state IS DISTINCT FROM OLD.state THEN
        INSERT INTO arroyo_history (pipeline_id, kind, epoch, old_state, new_state)
        VALUES (NEW.pipeline_id, 'epoch_state', NEW.epoch, OLD.state, NEW.state);
    END IF;
    RETURN NEW;
END $$;

CREATE TRIGGER arroyo_epochs_history AFTER INSERT OR UPDATE ON arroyo_epochs
    FOR EACH ROW EXECUTE FUNCTION arroyo_epochs_history();

CREATE FUNCTION arroyo_cleanup_locks_history() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        INSERT INTO arroyo_history (pipeline_id, kind, cleanup_run, holder, lock_expires_at)
        VALUES (NEW.pipeline_id, 'lock_acquired', NEW.cleanup_run, NEW.holder, NEW.expires_at);
    ELSIF TG_OP = 'UPDATE' THEN
        IF NEW.cleanup_run IS DISTINCT FROM OLD.cleanup_run THEN
            -- an expired lease taken over by another run
            INSERT INTO arroyo_history (pipeline_id, kind, cleanup_run, holder, lock_expires_at)
            VALUES (OLD.pipeline_id, 'lock_released', OLD.cleanup_run, OLD.holder, OLD.expires_at);
            INSERT INTO arroyo_history (pipeline_id, kind, cleanup_run, holder, lock_expires_at)
            VALUES (NEW.pipeline_id, 'lock_acquired', NEW.cleanup_run, NEW.holder, NEW.expires_at);
        ELSIF NEW.expires_at IS DISTINCT FROM OLD.expires_at THEN
            INSERT INTO arroyo_history (pipeline_id, kind, cleanup_run, holder, lock_expires_at)
            VALUES (NEW.pipeline_id, 'lock_renewed', NEW.cleanup_run, NEW.holder, NEW.expires_at);
        END IF;
    ELSE
        INSERT INTO arroyo_history (pipeline_id, kind, cleanup_run, holder, lock_expires_at)
        VALUES (OLD.pipeline_id, 'lock_released', OLD.cleanup_run, OLD.holder, OLD.expires_at);
    END IF;
    RETURN NULL;
END $$;

CREATE TRIGGER arroyo_cleanup_locks_history AFTER INSERT OR UPDATE OR DELETE ON arroyo_cleanup_locks
    FOR EACH ROW EXECUTE FUNCTION arroyo_cleanup_locks_history();
