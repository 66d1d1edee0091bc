-- Steps / benchmark: one row per selected step (aggregates avg/min/max/p50/p90 are computed in
-- Python over these rows: stepscope.analysis.summaries).
--
--   batch_cost_ns   the step slice's duration (category 'step', name "step <n>").
--   step            debug.step, else the <n> of the name.
--   reader_cost_ns  time the step waited for data: the union of the dataloader waits (category
--                   'dataloader') and 'Dataloader' phases of the step's rank that START inside the
--                   step [ts, ts + dur), each clipped to the step's end.
--   num_samples     debug.num_samples of the step (NULL when the batch size is unknown).
{{base}},
st_reader AS (
  SELECT upid, ts, end_ts FROM ss_slice
  WHERE kind_id = 1  -- category 'dataloader', or a 'phase' named 'Dataloader'
),
-- the step current at each reader row: a window counting the steps seen so far in
-- (time, ord, id) order; at a step row the count is its own ordinal by (ts, id)
st_carry AS (
  SELECT upid, ord, id, ts, end_ts,
         SUM(1 - ord) OVER (PARTITION BY upid ORDER BY ts, ord, id
                            ROWS UNBOUNDED PRECEDING) AS cur_s
  FROM (SELECT upid, 0 AS ord, id, ts, end_ts FROM ss_step
        UNION ALL
        SELECT upid, 1, NULL, ts, end_ts FROM st_reader)
),
st_steps AS (
  SELECT upid, cur_s AS sseq, id, ts, end_ts FROM st_carry WHERE ord = 0
),
st_clip AS (
  SELECT ms.id AS step_id, MAX(r.ts, ms.ts) AS ts, MIN(r.end_ts, ms.end_ts) AS end_ts
  FROM st_carry r JOIN st_steps ms ON ms.upid = r.upid AND ms.sseq = r.cur_s
  WHERE r.ord = 1 AND r.ts < ms.end_ts
),
st_union AS (
  SELECT step_id, SUM(MAX(0, end_ts - MAX(ts, COALESCE(m, ts)))) AS ns FROM (
    SELECT step_id, ts, end_ts,
           MAX(end_ts) OVER (PARTITION BY step_id ORDER BY ts
                             ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS m
    FROM st_clip
  ) GROUP BY step_id
)
SELECT st.rank, st.step, st.ts, st.dur AS batch_cost_ns,
       COALESCE(u.ns, 0) AS reader_cost_ns, st.num_samples
FROM ss_step st LEFT JOIN st_union u ON u.step_id = st.id
ORDER BY st.rank, st.ts, st.id
