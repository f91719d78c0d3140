-- Wake-ups instead of polling: every epoch start and end, and every change of a pipeline's state or
-- stop request, is announced with NOTIFY on the pipeline's own channel, delivered when the writing
-- transaction commits. Checkpoint triggers LISTEN for epoch ends (the next epoch may start at once),
-- pipeline drivers for epoch starts (inject the barrier at once). A notification is only a hint to read
-- the tables again: nobody decides anything from its payload, and a listener that was disconnected
-- reads the tables again before it trusts its wake-ups.
--
-- Channels (pipeline ids may be longer than a channel name's 63 bytes): arroyo_channel(pipeline_id),
-- 'arroyo_' || md5(pipeline_id), carries epoch ends and pipeline changes (what a trigger waits for);
-- arroyo_channel(pipeline_id) || '_start' carries epoch starts (what a driver waits for, besides).
-- Payload: 'epoch <n> <state>' or 'pipeline <state>'.

CREATE FUNCTION arroyo_channel(pipeline_id text) RETURNS text LANGUAGE sql IMMUTABLE AS $$
    SELECT 'arroyo_' || md5(pipeline_id)
$$;

CREATE FUNCTION arroyo_epochs_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        PERFORM pg_notify(arroyo_channel(NEW.pipeline_id) || '_start', 'epoch ' || NEW.epoch || ' ' || NEW.state);
    ELSIF OLD.state = 'triggered' AND NEW.state <> 'triggered' THEN
        PERFORM pg_notify(arroyo_channel(NEW.pipeline_id), 'epoch ' || NEW.epoch || ' ' || NEW.state);
    END IF;
    RETURN NULL;
END $$;

CREATE TRIGGER arroyo_epochs_notify AFTER INSERT OR UPDATE OF state ON arroyo_epochs
    FOR EACH ROW EXECUTE FUNCTION arroyo_epochs_notify();

CREATE FUNCTION arroyo_pipelines_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' OR NEW.state IS DISTINCT FROM OLD.state
       OR NEW.stop_requested IS DISTINCT FROM OLD.stop_requested OR NEW.run_id IS DISTINCT FROM OLD.run_id THEN
        PERFORM pg_notify(arroyo_channel(NEW.pipeline_id), 'pipeline ' || NEW.state);
    END IF;
    RETURN NULL;
END $$;

-- Not fired by the frequent updates of other columns (heartbeats, last_epoch on every epoch start).
CREATE TRIGGER arroyo_pipelines_notify AFTER INSERT OR UPDATE OF state, stop_requested, run_id ON arroyo_pipelines
    FOR EACH ROW EXECUTE FUNCTION arroyo_pipelines_notify();
