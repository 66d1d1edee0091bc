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
  SELECT kind_id AS grp, upid, ts, end_ts,
         CASE WHEN category = 'dataloader' AND EXISTS (
                SELECT 1 FROM slice p WHERE p.id = ss_slice.parent_id
                AND p.category = 'phase' AND p.name = 'Dataloader')
              THEN 0 ELSE 1 END AS cnt
  FROM ss_slice WHERE kind_id IS NOT NULL
  UNION ALL
  SELECT -1, upid, ts, end_ts, 0 FROM ss_frame
),
ov_prev AS (
  SELECT grp, ts, end_ts, cnt,
         MAX(end_ts) OVER (PARTITION BY grp, upid ORDER BY ts
                           ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS m
  FROM ov_items
),
ov_union AS (
  SELECT grp, SUM(MAX(0, end_ts - MAX(ts, COALESCE(m, ts)))) AS total_ns, SUM(cnt) AS calls
  FROM ov_prev GROUP BY grp
)
SELECT k.kind, u.calls, u.total_ns,
       CAST(u.total_ns AS REAL) / NULLIF((SELECT total_ns FROM ov_union WHERE grp = -1), 0)
         AS ratio
FROM ov_union u JOIN ss_kind k ON k.kind_id = u.grp
ORDER BY u.grp
