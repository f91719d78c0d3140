-- Unrestorable epochs (issue 30): a completed epoch whose snapshot a restore proved can never rebuild a
-- checkpoint Spark accepts (objects missing or corrupt, or files that break Spark's rules for a restart).
--
-- arroyo_epochs.unrestorable: why, as the restore found it (NULL: no restore found a problem). Written by the
-- restoring driver before its commit point, so nothing else changed. 'latest' then refuses the epoch by name
-- instead of failing the same way again, and a supervisor gives up rather than restart into it: an epoch's
-- state is not moved by this (it stays completed, and retention's rules for it stay the same).

ALTER TABLE arroyo_epochs
    ADD COLUMN unrestorable text,
    ADD CONSTRAINT arroyo_epochs_unrestorable_said CHECK (unrestorable IS NULL OR length(btrim(unrestorable)) > 0);
