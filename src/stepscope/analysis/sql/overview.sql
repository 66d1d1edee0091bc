-- Overview: one row per event kind (kinds as defined in _base.sql).
--
--   calls      number of slices of the kind; a dataloader wait directly inside a 'Dataloader'
--              phase is part of that phase's call and not counted again.
--   total_ns   time covered by the kind: per rank, the length of the union of the kind's
--              intervals over all threads/streams of that rank (overlaps merged, never double
--              counted), summed over ranks.
--   ratio      total_ns / frame time, where frame time is the same union taken over ss_frame
--              (the selected steps; a rank without steps: its whole span).
{{base}},
ov_items AS (
  SELECT kind AS grp, upid, ts, end_ts FROM ss_slice WHERE kind IS NOT NULL
  UNION ALL
  SELECT '__frame__', upid, ts, end_ts FROM ss_frame
),
ov_prev AS (
  SELECT grp, ts, end_ts,
         MAX(end_ts) OVER (PARTITION BY grp, upid ORDER BY ts
                           ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS m
  FROM ov_items
),
ov_union AS (
  SELECT grp, SUM(MAX(0, end_ts - MAX(ts, COALESCE(m, ts)))) AS total_ns
  FROM ov_prev GROUP BY grp
),
ov_calls AS (
  SELECT s.kind AS grp, COUNT(*) AS calls
  FROM ss_slice s LEFT JOIN slice p ON p.id = s.parent_id
  WHERE s.kind IS NOT NULL
    AND NOT (COALESCE(s.category, '') = 'dataloader' AND COALESCE(p.category, '') = 'phase'
             AND COALESCE(p.name, '') = 'Dataloader')
  GROUP BY s.kind
)
SELECT c.grp AS kind, c.calls, u.total_ns,
       CAST(u.total_ns AS REAL) / NULLIF((SELECT total_ns FROM ov_union WHERE grp = '__frame__'), 0)
         AS ratio
FROM ov_calls c JOIN ov_union u ON u.grp = c.grp
ORDER BY CASE c.grp
  WHEN 'Step' THEN 0 WHEN 'Dataloader' THEN 1 WHEN 'Forward' THEN 2 WHEN 'Backward' THEN 3
  WHEN 'Optimization' THEN 4 WHEN 'Other phases' THEN 5 WHEN 'User ranges' THEN 6
  WHEN 'Runtime API' THEN 7 WHEN 'Synchronization' THEN 8 WHEN 'Kernels' THEN 9
  WHEN 'Communication' THEN 10 WHEN 'Memcpy' THEN 11 WHEN 'Memset' THEN 12 ELSE 13 END
