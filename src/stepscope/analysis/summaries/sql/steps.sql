-- Steps / benchmark: one row per selected step (aggregates avg/min/max/p50/p90 are computed in
-- Python over these rows: stepscope.analysis.summaries).
--
--   batch_cost_ns   the step slice's duration (category 'step', name "step <n>").
--   step            debug.step, else the <n> of the name.
--   reader_cost_ns  time the step waited for data: the union of the dataloader waits (category
--                   'dataloader') and 'Dataloader' phases of the step's thread (the thread whose
--                   steps track holds it: a loader iterated on a prefetch thread is waited for
--                   there, not by the step) that START inside the step [ts, ts + dur), each
--                   clipped to the step's end.
--   num_samples     debug.num_samples of the step (NULL when the batch size is unknown).
{{base}},
st_reader AS (
  SELECT upid, ts, end_ts FROM ss_slice
  WHERE kind_id = 1  -- category 'dataloader', or a 'phase' named 'Dataloader'
    AND utid IN (SELECT utid FROM ss_step)  -- on the steps' thread
),
-- the step current at each reader row: in (time, ord, id) order per rank, the step that started
-- last at or before it (ties: the larger id), which is the largest step id seen so far (both
-- engines number slices in start-time order): one window, then the step looked up by id
st_carry AS (
  SELECT upid, ord, ts, end_ts,
         MAX(CASE WHEN ord = 0 THEN id END)
           OVER (PARTITION BY upid ORDER BY ts, ord, id ROWS UNBOUNDED PRECEDING) AS step_id
  FROM (SELECT upid, 0 AS ord, id, ts, end_ts FROM ss_step
        UNION ALL
        SELECT upid, 1, NULL, ts, end_ts FROM st_reader)
),
st_clip AS (
  SELECT r.step_id, MAX(r.ts, st.ts) AS ts, MIN(r.end_ts, st.ts + st.dur) AS end_ts
  FROM st_carry r CROSS JOIN slice st  -- each reader row, then its step by id (never a scan
  WHERE st.id = r.step_id AND r.ord = 1 AND r.ts < st.ts + st.dur  -- of slice per row)
),
st_union AS (
  SELECT step_id, SUM(MAX(0, end_ts - MAX(ts, COALESCE(m, ts)))) AS ns FROM (
    SELECT step_id, ts, end_ts,
           MAX(end_ts) OVER (PARTITION BY step_id ORDER BY ts
                             ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS m
    FROM st_clip
  ) GROUP BY step_id
)
-- each step meets its reader time in one sort by step id (grouped, not joined)
SELECT MAX(rank) AS rank, MAX(step) AS step, MAX(ts) AS ts, MAX(dur) AS batch_cost_ns,
       SUM(ns) AS reader_cost_ns, MAX(num_samples) AS num_samples
FROM (SELECT id AS gid, rank, step, ts, dur, 0 AS ns, num_samples FROM ss_step
      UNION ALL
      SELECT step_id, NULL, NULL, NULL, NULL, ns, NULL FROM st_union)
GROUP BY gid HAVING COUNT(ts) > 0
ORDER BY rank, ts, gid
