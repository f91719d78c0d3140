-- The table version a lakehouse table sink's commit made (issue 29, item 5): a Delta Lake sink commits each epoch
-- as one version of its table, and the Asset event of the commit names it, so a consumer reads exactly that
-- version (time travel) whatever the table holds by the time it runs. NULL for the sinks that have no versions
-- (files, PostgreSQL, Kafka).

ALTER TABLE arroyo_sink_commits
    ADD COLUMN table_version bigint CHECK (table_version >= 0);
