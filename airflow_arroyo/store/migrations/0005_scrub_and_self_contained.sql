-- Scrubbing and self-contained epochs (docs/retention.md, "Scrubbing"; docs/runtime.md, "Self-contained epochs").
--
-- arroyo_objects.verified_at / verify_state: when a scrub (airflow-arroyo verify, the retention run) last
-- re-hashed the object and what it found. Scrubs take the least recently verified objects first, so runs
-- with a time budget cover every object in turn. A damaged object stays recorded until a later check finds it
-- sound again.
ALTER TABLE arroyo_objects
    ADD COLUMN verified_at   timestamptz,
    ADD COLUMN verify_state  text CHECK (verify_state IN ('ok', 'missing', 'corrupt')),
    ADD COLUMN verify_detail text,
    ADD CONSTRAINT arroyo_objects_verified CHECK ((verified_at IS NULL) = (verify_state IS NULL));
CREATE INDEX arroyo_objects_by_verified ON arroyo_objects (pipeline_id, verified_at NULLS FIRST, object_key);

-- An epoch whose snapshot holds its own copy of every object (epochs/<n>/... keys, Flink's savepoint
-- format): asked for when the epoch is started, honoured by every stage's capture.
ALTER TABLE arroyo_epochs ADD COLUMN self_contained boolean NOT NULL DEFAULT false;
