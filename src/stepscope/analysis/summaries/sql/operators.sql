-- Operators / user ranges: one row per range name, threads merged or per rank and thread
-- (this query: {{op_group}}). Threads merged, rank / tid / thread_name are NULL and the rows
-- are grouped by name alone (no join to the process and thread tables).
--
--   ranges          slices of kind 'User ranges' (no category, 'nvtx', or a user's domain;
--                   of some duration: a mark, an instant, is none).
--   calls           number of ranges; total_ns = sum of durations; avg = total / calls; max, min.
--   sq_hh .. sq_bb  the sum of the squared durations, exact, in integer parts: with a duration
--                   d = h 2^32 + a 2^16 + b (h = d >> 32; a, b 16-bit), d^2 = h^2 2^64
--                   + 2 h (a 2^16 + b) 2^32 + a^2 2^32 + 2 a b 2^16 + b^2, each part summed as
--                   an integer (no int64 overflow below 2^31 ranges of one name, 2^23 if they
--                   last more than 18 minutes). Python takes the population
--                   stddev = sqrt(calls * sum(d^2) - sum(d)^2) / calls, the difference exact:
--                   no cancellation, and the same bits on every engine and row order (a REAL
--                   sum is not: trace processor's SQLite adds with Kahan-Babuska-Neumaier,
--                   older SQLite plainly).
--   self_ns         sum over ranges of (duration - sum of the durations of its direct children,
--                   i.e. slices whose parent_id is the range, which are on the same track).
--   ratio           total_ns / frame time (union of ss_frame per rank, summed); nested ranges
--                   each count, so ratios can add up to more than 1.
--   GPU time of a range  length of the union of the device slices (kernel, communication,
--                   memcpy, memset) launched inside it: the device slice's flow starts at a
--                   launch slice of the range's thread (on the thread's track or a child track
--                   such as "CUDA API") whose start lies inside the range. Found without a
--                   range x launch join: S = the slice of the thread's own track (the thread
--                   track that is not a child of another thread track) that started last at or
--                   before the launch (the deepest one on ties: the largest id, both engines
--                   numbering slices in start-time order); as slices on one track nest
--                   strictly, the ranges containing the launch are S and those of its ancestors
--                   (parent_id) that end after the launch (ancestors are walked once per
--                   distinct S). Device slices without a flow count for no range.
--   gpu_total_ns    sum over ranges; gpu_avg = gpu_total / calls; gpu_max/min over ranges
--                   (ranges without device work count 0).
--   gpu_ratio       gpu_total_ns / device time (union of all device slices per rank, summed).
{{base}},
op_range AS (
  SELECT s.id, s.name, {{op_rank}} AS rank, {{op_tid}} AS tid, {{op_thread}} AS thread_name,
         s.ts, s.dur
  FROM ss_slice s {{op_join}}
  WHERE s.kind_id = 6  -- User ranges
),
op_launch AS (
  SELECT d.id AS dev_id, d.ts, d.end_ts, l.ts AS launch_ts, li.utid
  FROM ss_device d
  JOIN flow f ON f.slice_in = d.id
  JOIN slice l ON l.id = f.slice_out
  JOIN ss_track_info li ON li.track_id = l.track_id
  WHERE li.utid IS NOT NULL
),
op_root AS (
  SELECT tt.utid, tt.id AS track_id
  FROM thread_track tt JOIN track t ON t.id = tt.id
  WHERE t.parent_id IS NULL OR t.parent_id NOT IN (SELECT id FROM thread_track)
),
-- S of each launch: the launches and the slices of the root tracks of their threads in one
-- sort per root track (time, slices before launches); S is the largest slice id seen so far, as
-- both engines number slices in start-time order (at one time: the deepest). The slices are
-- read only when there are launches (the one row of `need` drives them).
op_start AS (
  SELECT dev_id, t, dts, dend, start_id FROM (
    SELECT ord, dev_id, t, dts, dend,
           MAX(sid) OVER (PARTITION BY track_id ORDER BY t, ord
                          ROWS UNBOUNDED PRECEDING) AS start_id
    FROM (
      SELECT r.track_id, s.ts AS t, 0 AS ord, s.id AS sid, NULL AS dev_id, NULL AS dts,
             NULL AS dend
      FROM (SELECT 1 WHERE EXISTS (SELECT 1 FROM op_launch)) need
      CROSS JOIN op_root r JOIN slice s ON s.track_id = r.track_id
      UNION ALL
      SELECT r.track_id, l.launch_ts, 1, NULL, l.dev_id, l.ts, l.end_ts
      FROM op_launch l JOIN op_root r ON r.utid = l.utid
    )
  ) WHERE ord = 1
),
op_walk(start_id, anc_id, hops) AS (
  SELECT DISTINCT start_id, start_id, 0 FROM op_start WHERE start_id IS NOT NULL
  UNION ALL
  SELECT w.start_id, s.parent_id, w.hops + 1
  FROM op_walk w JOIN slice s ON s.id = w.anc_id
  WHERE s.parent_id IS NOT NULL AND w.hops < 256
),
op_hit AS (
  SELECT w.start_id, r.id AS range_id, r.end_ts AS range_end
  FROM op_walk w CROSS JOIN ss_slice r  -- each ancestor looked up by id (never a scan of
  WHERE r.id = w.anc_id AND r.kind_id = 6  -- every range probing the walk)
),
op_range_gpu AS (
  SELECT range_id, SUM(MAX(0, end_ts - MAX(ts, COALESCE(m, ts)))) AS ns FROM (
    SELECT range_id, ts, end_ts,
           MAX(end_ts) OVER (PARTITION BY range_id ORDER BY ts
                             ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS m
    FROM (
      SELECT h.range_id, st.dts AS ts, st.dend AS end_ts
      FROM op_hit h JOIN op_start st ON st.start_id = h.start_id AND st.t < h.range_end
    )
  ) GROUP BY range_id
),
-- op_self and op_gpu key their rows as op_range does, reading ss_slice by id: op_range is
-- read once (by op_stats), so the engine need not store its rows
op_self AS (  -- per row: the durations of the direct children of its ranges
  SELECT name, rank, tid, thread_name, SUM(child_ns) AS child_ns FROM (
    SELECT s.name, {{op_rank}} AS rank, {{op_tid}} AS tid, {{op_thread}} AS thread_name,
           c.dur AS child_ns
    FROM slice c CROSS JOIN ss_slice s  -- each child first, then its parent by id
    {{op_join}}
    WHERE s.id = c.parent_id AND s.kind_id = 6 AND c.dur >= 0
  ) GROUP BY {{op_keys}}
),
op_gpu AS (  -- per row: the ranges with device work, their GPU time
  SELECT name, rank, tid, thread_name, COUNT(*) AS ranges, SUM(ns) AS ns,
         MAX(ns) AS max_ns, MIN(ns) AS min_ns FROM (
    SELECT s.name, {{op_rank}} AS rank, {{op_tid}} AS tid, {{op_thread}} AS thread_name, g.ns
    FROM op_range_gpu g JOIN ss_slice s ON s.id = g.range_id {{op_join}}
  ) GROUP BY {{op_keys}}
),
op_stats AS (
  SELECT name, rank, tid, thread_name, COUNT(*) AS calls,
         SUM(dur) AS total_ns, MAX(dur) AS max_ns, MIN(dur) AS min_ns,
         SUM((dur >> 32) * (dur >> 32)) AS sq_hh,
         SUM((dur >> 32) * (dur & 4294967295)) AS sq_hl,
         SUM(((dur >> 16) & 65535) * ((dur >> 16) & 65535)) AS sq_aa,
         SUM(((dur >> 16) & 65535) * (dur & 65535)) AS sq_ab,
         SUM((dur & 65535) * (dur & 65535)) AS sq_bb
  FROM op_range
  GROUP BY {{op_keys}}
)
-- ranges without device work count 0: gpu_max = max(0, max over the others), gpu_min = 0
-- when there is such a range
SELECT s.name, s.rank, s.tid, s.thread_name, s.calls, s.total_ns,
       CAST(s.total_ns AS REAL) / s.calls AS avg_ns, s.max_ns, s.min_ns,
       s.sq_hh, s.sq_hl, s.sq_aa, s.sq_ab, s.sq_bb,
       s.total_ns - COALESCE(c.child_ns, 0) AS self_ns,
       CAST(s.total_ns AS REAL) / NULLIF((SELECT frame_ns FROM ss_totals), 0) AS ratio,
       COALESCE(g.ns, 0) AS gpu_total_ns, CAST(COALESCE(g.ns, 0) AS REAL) / s.calls AS gpu_avg_ns,
       COALESCE(g.max_ns, 0) AS gpu_max_ns,
       CASE WHEN COALESCE(g.ranges, 0) < s.calls THEN 0 ELSE g.min_ns END AS gpu_min_ns,
       CAST(COALESCE(g.ns, 0) AS REAL) / NULLIF((SELECT device_ns FROM ss_totals), 0)
         AS gpu_ratio
FROM op_stats s
LEFT JOIN op_self c ON c.name IS s.name AND c.rank IS s.rank AND c.tid IS s.tid
                   AND c.thread_name IS s.thread_name
LEFT JOIN op_gpu g ON g.name IS s.name AND g.rank IS s.rank AND g.tid IS s.tid
                  AND g.thread_name IS s.thread_name
ORDER BY s.total_ns DESC, s.name
