-- Fencing (issue 16): every registration of a run gives the pipeline a new, higher generation, in the
-- transaction that registers it. A run's writes carry the generation it was registered with (its
-- fencing token, like Kafka's producer epoch); the store refuses a write whose token is not the current
-- one, and storage records it (channel fences, the sinks' commit points) so that readers ignore what a
-- superseded run writes after the takeover. The trigger keeps the rule in one place, whichever
-- statement registers: a row entering 'registered' (a new run) or changing run_id gets generation + 1;
-- nothing else may change it.

ALTER TABLE arroyo_pipelines ADD COLUMN generation bigint NOT NULL DEFAULT 0 CHECK (generation >= 0);

CREATE FUNCTION arroyo_pipelines_generation() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        NEW.generation := 1;
    ELSIF (NEW.state = 'registered' AND OLD.state <> 'registered') OR NEW.run_id IS DISTINCT FROM OLD.run_id THEN
        NEW.generation := OLD.generation + 1;
    ELSE
        NEW.generation := OLD.generation;
    END IF;
    RETURN NEW;
END $$;

CREATE TRIGGER arroyo_pipelines_generation BEFORE INSERT OR UPDATE ON arroyo_pipelines
    FOR EACH ROW EXECUTE FUNCTION arroyo_pipelines_generation();
