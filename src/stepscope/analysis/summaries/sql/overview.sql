-- Overview: one row per event kind (kinds as defined in _base.sql).
--
--   calls      number of slices of the kind; a dataloader wait directly inside a 'Dataloader'
--              phase is part of that phase's call and not counted again.
--   total_ns   time covered by the kind: per rank, the length of the union of the kind's
--              intervals over all threads/streams of that rank (overlaps merged, never double
--              counted), summed over ranks.
--   ratio      total_ns / frame time, where frame time is the same union taken over ss_frame
--              (the selected steps; a rank without steps: its whole span): ss_totals.frame_ns.
{{base}},
-- per kind: its slices, and the union window run on that kind's rows alone (on the embedded
-- engine's shared base, read from one index on (kind_id, upid, ts, end_ts): no sort at all)
ov_union AS (
  SELECT k.kind_id, COUNT(*) AS calls, (
    SELECT SUM(MAX(0, end_ts - MAX(ts, COALESCE(m, ts)))) FROM (
      SELECT ts, end_ts,
             MAX(end_ts) OVER (PARTITION BY upid ORDER BY ts
                               ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS m
      FROM ss_slice s WHERE s.kind_id = k.kind_id
    )) AS total_ns
  FROM ss_slice k WHERE k.kind_id IS NOT NULL GROUP BY k.kind_id
),
ov_nested_dl AS (  -- dataloader waits directly inside a 'Dataloader' phase (kind 1): no call
  SELECT COUNT(*) AS n FROM ss_slice s
  WHERE s.kind_id = 1 AND s.category = 'dataloader' AND EXISTS (
    SELECT 1 FROM slice p WHERE p.id = s.parent_id
    AND p.category = 'phase' AND {{dataloader_phase}})
)
SELECT k.kind,
       u.calls - CASE WHEN u.kind_id = 1 THEN (SELECT n FROM ov_nested_dl) ELSE 0 END AS calls,
       u.total_ns,
       CAST(u.total_ns AS REAL) / NULLIF((SELECT frame_ns FROM ss_totals), 0) AS ratio
FROM ov_union u JOIN ss_kind k ON k.kind_id = u.kind_id
ORDER BY u.kind_id
