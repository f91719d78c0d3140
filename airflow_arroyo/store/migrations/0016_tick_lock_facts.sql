-- The controller's batch of ticks in fewer round trips (issue 34, deliverable 5): the row locks, which
-- requested pipelines exist, every locked pipeline's tick facts and its watched epochs that ended, in ONE
-- call. The triggerer then decides in Python (decide_trigger) and inserts its starts before it commits.
--
-- Each statement of a VOLATILE PL/pgSQL function takes a fresh snapshot (READ COMMITTED): the facts are read
-- after every lock is held and see what the previous holders of those rows committed, as when the lock and the
-- facts were separate statements. Blocking locks first, in pipeline-id order while holding no other (ordered
-- locking cannot deadlock), then the rest SKIP LOCKED (never waits).
--
-- Rows: per locked pipeline its facts (``found`` and ``locked`` true, the e_ columns NULL); per watched epoch
-- (``watch_p``, ``watch_n`` pairs) of a locked pipeline that is no longer in flight, its row in the e_ columns
-- (the facts NULL), in epoch order; per requested pipeline not locked, ``locked`` false and ``found`` whether it
-- exists (a found row not locked was held by another transaction: that tick is skipped).
CREATE FUNCTION arroyo_tick_lock_facts(wait_ids text[], skip_ids text[], ids text[], ks int[],
                                       watch_p text[], watch_n bigint[])
RETURNS TABLE (pipeline_id text, found boolean, locked boolean, state text, last_epoch bigint, stop_requested text,
               heartbeat_at timestamptz, now timestamptz, in_flight bigint, in_flight_timeout_at timestamptz,
               last_triggered_at timestamptz, last_ended_at timestamptz, holder text, expires_at timestamptz,
               recent text[], recent_epochs bigint[], e_pipeline_id text, e_epoch bigint, e_state text,
               e_run_id text, e_stages text[], e_is_final boolean, e_triggered_by text, e_triggered_at timestamptz,
               e_timeout_at timestamptz, e_ended_at timestamptz, e_failure_reason text, e_bytes_new bigint,
               e_bytes_total bigint, e_pruned_at timestamptz, e_bytes_freed bigint, e_self_contained boolean,
               e_outcome text, e_pin_label text, e_pinned_at timestamptz, e_unrestorable text)
LANGUAGE plpgsql VOLATILE AS $$
#variable_conflict use_column
DECLARE
    got text[];
    more text[];
BEGIN
    SELECT coalesce(array_agg(x.pipeline_id), '{}') INTO got FROM (
        SELECT p.pipeline_id FROM arroyo_pipelines p WHERE p.pipeline_id = ANY(wait_ids)
        ORDER BY p.pipeline_id FOR UPDATE) x;
    SELECT coalesce(array_agg(x.pipeline_id), '{}') INTO more FROM (
        SELECT p.pipeline_id FROM arroyo_pipelines p WHERE p.pipeline_id = ANY(skip_ids)
        ORDER BY p.pipeline_id FOR UPDATE SKIP LOCKED) x;
    got := got || more;
    RETURN QUERY
    SELECT r.pipeline_id, true, true, p.state, p.last_epoch, p.stop_requested, p.heartbeat_at,
        clock_timestamp(), f.epoch, f.timeout_at,
        (SELECT max(e.triggered_at) FROM arroyo_epochs e WHERE e.pipeline_id = r.pipeline_id),
        (SELECT e.ended_at FROM arroyo_epochs e WHERE e.pipeline_id = r.pipeline_id AND e.ended_at IS NOT NULL
          ORDER BY e.epoch DESC LIMIT 1),
        l.holder, l.expires_at,
        ARRAY(SELECT e.state FROM arroyo_epochs e WHERE e.pipeline_id = r.pipeline_id
          ORDER BY e.epoch DESC LIMIT r.k),
        ARRAY(SELECT e.epoch FROM arroyo_epochs e WHERE e.pipeline_id = r.pipeline_id
          ORDER BY e.epoch DESC LIMIT r.k),
        NULL::text, NULL::bigint, NULL::text, NULL::text, NULL::text[], NULL::boolean, NULL::text,
        NULL::timestamptz, NULL::timestamptz, NULL::timestamptz, NULL::text, NULL::bigint, NULL::bigint,
        NULL::timestamptz, NULL::bigint, NULL::boolean, NULL::text, NULL::text, NULL::timestamptz, NULL::text
    FROM unnest(ids, ks) AS r(pipeline_id, k)
    JOIN arroyo_pipelines p ON p.pipeline_id = r.pipeline_id AND p.pipeline_id = ANY(got)
    LEFT JOIN arroyo_epochs f ON f.pipeline_id = r.pipeline_id AND f.state = 'triggered'
    LEFT JOIN arroyo_cleanup_locks l ON l.pipeline_id = r.pipeline_id AND l.expires_at > clock_timestamp()
    WHERE r.pipeline_id = ANY(got);
    RETURN QUERY
    SELECT e.pipeline_id, true, true,
        NULL::text, NULL::bigint, NULL::text, NULL::timestamptz, NULL::timestamptz, NULL::bigint,
        NULL::timestamptz, NULL::timestamptz, NULL::timestamptz, NULL::text, NULL::timestamptz, NULL::text[],
        NULL::bigint[],
        e.pipeline_id, e.epoch, e.state, e.run_id, e.stages, e.is_final, e.triggered_by, e.triggered_at,
        e.timeout_at, e.ended_at, e.failure_reason, e.bytes_new, e.bytes_total, e.pruned_at, e.bytes_freed,
        e.self_contained, e.outcome, e.pin_label, e.pinned_at, e.unrestorable
    FROM arroyo_epochs e JOIN unnest(watch_p, watch_n) AS u(pipeline_id, epoch)
      ON u.pipeline_id = e.pipeline_id AND u.epoch = e.epoch
    WHERE e.state <> 'triggered'
    ORDER BY e.pipeline_id, e.epoch;
    RETURN QUERY
    SELECT r.pipeline_id, EXISTS (SELECT 1 FROM arroyo_pipelines p WHERE p.pipeline_id = r.pipeline_id), false,
        NULL::text, NULL::bigint, NULL::text, NULL::timestamptz, NULL::timestamptz, NULL::bigint,
        NULL::timestamptz, NULL::timestamptz, NULL::timestamptz, NULL::text, NULL::timestamptz, NULL::text[],
        NULL::bigint[],
        NULL::text, NULL::bigint, NULL::text, NULL::text, NULL::text[], NULL::boolean, NULL::text,
        NULL::timestamptz, NULL::timestamptz, NULL::timestamptz, NULL::text, NULL::bigint, NULL::bigint,
        NULL::timestamptz, NULL::bigint, NULL::boolean, NULL::text, NULL::text, NULL::timestamptz, NULL::text
    FROM unnest(ids) AS r(pipeline_id)
    WHERE NOT r.pipeline_id = ANY(got);
END
$$;
