-- An epoch a restore of an older epoch abandoned: completed once, but the channels were cut before its
-- barriers, so it can never be restored again. Retention prunes it; "latest completed" ignores it.
ALTER TABLE arroyo_epochs DROP CONSTRAINT arroyo_epochs_state_check;
ALTER TABLE arroyo_epochs ADD CONSTRAINT arroyo_epochs_state_check
    CHECK (state IN ('triggered', 'completed', 'failed', 'expired', 'pruning', 'pruned', 'superseded'));
