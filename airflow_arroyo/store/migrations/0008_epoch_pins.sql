-- Pinned epochs (issue 11, savepoint-style operations): an operator keeps a completed epoch out of
-- retention on purpose, with a label saying why.
--
-- arroyo_epochs.pin_label / pinned_at: set together by EpochStore.pin_epoch (only on a completed epoch),
-- cleared together by unpin_epoch. Retention keeps a pinned epoch whatever its policy says, and with it
-- every snapshot object and channel range a restore of it needs. The last constraint is the database's
-- own guard: a pinned epoch can never be moved to pruning or pruned, whichever statement tries.

ALTER TABLE arroyo_epochs
    ADD COLUMN pin_label text,
    ADD COLUMN pinned_at timestamptz,
    ADD CONSTRAINT arroyo_epochs_pin_whole CHECK ((pin_label IS NULL) = (pinned_at IS NULL)),
    ADD CONSTRAINT arroyo_epochs_pin_label CHECK (pin_label IS NULL OR length(btrim(pin_label)) BETWEEN 1 AND 200),
    ADD CONSTRAINT arroyo_epochs_pinned_kept CHECK (pin_label IS NULL OR state NOT IN ('pruning', 'pruned'));
