-- Overview: one row per event kind (kinds as defined in _base.sql).
--
--   calls       number of slices of the kind; a dataloader wait directly inside a 'Dataloader'
--               phase is part of that phase's call and not counted again.
--   total_ns    time the kind covers inside the frame (the selected steps; a rank without
--               steps: its whole span): per rank, the length of the union of the kind's
--               intervals over all threads/streams of that rank (overlaps merged, never double
--               counted) that lies inside the rank's frame islands, summed over ranks.
--   outside_ns  the rest of that union: the kind's time outside the frame (before the first
--               step, between steps that do not touch, after the last).
--   ratio       total_ns / frame time (ss_totals.frame_ns): at most 1.
--
-- Algorithm: per kind present, one window pass over its slices, read region by region
-- (ss_frame_region: the regions of a rank tile its time line, so each slice is read once, in
-- start order). With the shared base (indexed_base = 1), from the slices' (kind_id, upid, ts,
-- end_ts) index in the regions' (upid, id) order: no sort. With the CTEs alone (the SQL pasted
-- into trace processor, say) a join on a time range would probe every region's slices, so the
-- regions' starts are sorted in with the slices instead, and each slice takes the last region
-- begun at or before it (one sort per kind, as the union itself needs). With m the largest end
-- before a slice, the slice adds the piece [a, b) = [max(ts, m), end_ts) to the union (pieces
-- never overlap; a nested slice adds none). A piece that ends before the next region starts
-- (b <= nxt, as nearly all do) lies in its own region [f0, nxt), so its part inside the frame is
-- [a, min(b, f1)); a longer one (a range around steps that do not touch) is measured with the
-- frame time before its ends: C(b) - C(a), two lookups in the regions' (upid, f0) index.
-- A scalar subquery returns one value, so the pass gives its two sums as the text
-- '<union> <inside>', read back by CAST (which takes the leading integer). (+b: the column
-- without its declared INTEGER affinity, which would keep the lookup off the index on f0, a
-- column with none.)
{{base}},
-- (ov_pass and ov_union are both aggregates, one row per kind, so that SQLite cannot flatten the
-- one into the other: ov_union reads `sums` twice, and a flattened copy would run the pass
-- twice; "AS MATERIALIZED" says so too, but SQLite before 3.35 rejects it)
ov_pass AS (
  SELECT k.kind_id, MAX((
    SELECT SUM(MAX(0, b - a)) || ' ' || SUM(
             CASE WHEN b <= a THEN 0
                  WHEN b <= nxt THEN MAX(0, MIN(b, f1) - a)
                  ELSE (SELECT c.cum + MIN(b, c.f1) - c.f0 FROM ss_frame_region c
                        WHERE c.upid = p.upid AND c.f0 <= +b ORDER BY c.f0 DESC LIMIT 1)
                     - (SELECT c.cum + MIN(a, c.f1) - c.f0 FROM ss_frame_region c
                        WHERE c.upid = p.upid AND c.f0 <= a ORDER BY c.f0 DESC LIMIT 1)
             END)
    FROM (
      -- with the shared base's indexes: each region's slices, by index
      SELECT r.upid, r.f1, r.nxt, s.end_ts AS b,
             MAX(s.ts, COALESCE(MAX(s.end_ts) OVER (
                                    PARTITION BY r.upid ORDER BY r.id, s.ts
                                    ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING), s.ts)) AS a
      FROM ss_frame_region r CROSS JOIN ss_slice s
      WHERE {{indexed_base}} AND s.kind_id = k.kind_id AND s.upid = r.upid AND s.ts >= r.f0
        AND s.ts < r.nxt
      UNION ALL
      -- else (the CTEs alone, no index to probe): one sorted pass over the regions' starts
      -- and the slices, each slice in the last region begun at or before it
      SELECT x.upid, r.f1, r.nxt, x.end_ts AS b, MAX(x.ts, COALESCE(x.m, x.ts)) AS a
      FROM (
        SELECT upid, ts, end_ts, is_slice,
               MAX(rid) OVER (PARTITION BY upid ORDER BY ts, is_slice ROWS UNBOUNDED PRECEDING)
                 AS rid,
               MAX(end_ts) OVER (PARTITION BY upid ORDER BY ts, is_slice
                                 ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS m
        FROM (SELECT upid, f0 AS ts, NULL AS end_ts, id AS rid, 0 AS is_slice
              FROM ss_frame_region
              UNION ALL
              SELECT upid, ts, end_ts, NULL, 1 FROM ss_slice s WHERE s.kind_id = k.kind_id)
      ) x JOIN ss_frame_region r ON r.id = x.rid
      WHERE NOT {{indexed_base}} AND x.is_slice = 1
    ) p)) AS sums
  FROM ss_kind k
  WHERE EXISTS (SELECT 1 FROM ss_slice s WHERE s.kind_id = k.kind_id)
  GROUP BY k.kind_id
),
ov_union AS (
  SELECT kind_id, CAST(MAX(sums) AS INTEGER) AS union_ns,
         CAST(substr(MAX(sums), instr(MAX(sums), ' ') + 1) AS INTEGER) AS total_ns
  FROM ov_pass GROUP BY kind_id
),
ov_calls AS (  -- read in the slices' kind index order: no sort
  SELECT kind_id, COUNT(*) AS calls FROM ss_slice WHERE kind_id IS NOT NULL GROUP BY kind_id
),
ov_nested_dl AS (  -- dataloader waits directly inside a 'Dataloader' phase (kind 1): no call
  SELECT COUNT(*) AS n FROM ss_slice s
  WHERE s.kind_id = 1 AND s.category = 'dataloader' AND EXISTS (
    SELECT 1 FROM slice p WHERE p.id = s.parent_id
    AND p.category = 'phase' AND {{dataloader_phase}})
)
SELECT k.kind,
       n.calls - CASE WHEN n.kind_id = 1 THEN (SELECT n FROM ov_nested_dl) ELSE 0 END AS calls,
       u.total_ns,
       u.union_ns - u.total_ns AS outside_ns,
       CAST(u.total_ns AS REAL) / NULLIF((SELECT frame_ns FROM ss_totals), 0) AS ratio
FROM ov_calls n JOIN ov_union u ON u.kind_id = n.kind_id JOIN ss_kind k ON k.kind_id = n.kind_id
ORDER BY n.kind_id
