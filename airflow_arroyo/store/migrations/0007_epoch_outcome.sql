-- How each epoch ended, as data (issue 14): readers that report outcomes (the checkpoint controller's
-- summary and metrics, Asset events, the UI's summary) read this column and decide nothing from the text
-- of failure_reason.
--
-- arroyo_epochs.outcome: the state the epoch ended in (completed, failed, expired, or superseded once a
-- restore of an older epoch abandoned it), kept when retention then moves it to pruning and pruned.
-- NULL while it is in flight. The trigger below keeps the rule in one place, whichever statement moves
-- the epoch: the outcome follows the state while the state is one of those four, stays as it was
-- through pruning, and cannot be written on its own.

ALTER TABLE arroyo_epochs
    ADD COLUMN outcome text CHECK (outcome IN ('completed', 'failed', 'expired', 'superseded'));

-- Epochs that ended before this migration: their state, or, for those already pruning or pruned, the last
-- of those four states the database's own history (written for every state change since version 1)
-- recorded for them.
UPDATE arroyo_epochs SET outcome = state WHERE state IN ('completed', 'failed', 'expired', 'superseded');
UPDATE arroyo_epochs e SET outcome = h.new_state
  FROM (SELECT DISTINCT ON (pipeline_id, epoch) pipeline_id, epoch, new_state FROM arroyo_history
         WHERE kind = 'epoch_state' AND new_state IN ('completed', 'failed', 'expired', 'superseded')
         ORDER BY pipeline_id, epoch, seq DESC) h
 WHERE e.pipeline_id = h.pipeline_id AND e.epoch = h.epoch AND e.state IN ('pruning', 'pruned');

CREATE FUNCTION arroyo_epochs_outcome() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.state = 'triggered' THEN
        NEW.outcome := NULL;
    ELSIF NEW.state IN ('completed', 'failed', 'expired', 'superseded') THEN
        NEW.outcome := NEW.state;
    ELSIF TG_OP = 'UPDATE' THEN
        NEW.outcome := OLD.outcome;  -- pruning, pruned: the outcome it was pruned with
    END IF;
    RETURN NEW;
END $$;

CREATE TRIGGER arroyo_epochs_outcome BEFORE INSERT OR UPDATE OF state, outcome ON arroyo_epochs
    FOR EACH ROW EXECUTE FUNCTION arroyo_epochs_outcome();
