-- Model: one row per step phase (Dataloader, Forward, Backward, Optimization, any user phase,
-- then Others).
--
--   phase instance  a slice of category 'phase' (row = its name), or a dataloader wait that is
--                   not directly inside a phase (counted as a 'Dataloader' instance), except
--                   those that lie between the steps: the final wait that found a loader
--                   exhausted, and the waits of an evaluation pass (dataloader.eval). Waits and
--                   'Dataloader' phases count on the thread that makes the rank's steps only
--                   (a prefetch thread's waits overlap the step's work: Dataloader and Others
--                   added up to more than the steps), on any thread of a rank without steps.
--   calls           number of phase instances.
--   cpu_total_ns    sum of the instances' durations; cpu_avg/max/min over instances.
--   cpu_ratio       cpu_total_ns / frame time (union of ss_frame per rank, summed).
--   launch time     of a device slice (kernel, communication, memcpy, memset): the start of the
--                   slice its flow comes from (the runtime launch call); without a flow, the
--                   device slice's own start.
--   attribution     a device slice belongs to the phase instance of its rank that started last
--                   at or before its launch time, if that instance is still running at that
--                   time (phases are expected not to nest); likewise to a step instance.
--   gpu per instance  length of the union of the device slices attributed to it (not clipped).
--   gpu_total_ns    sum over instances; gpu_avg = gpu_total / calls; gpu_max/min over
--                   instances (an instance without device work counts 0).
--   gpu_ratio       gpu_total_ns / device time (union of all device slices per rank, summed).
--   Others          one instance per selected step: cpu = step duration minus the union of the
--                   phase instances attributed to that step (by start) clipped to the step;
--                   gpu = union of the device slices attributed to the step and to no phase.
{{base}},
-- dataloader waits that are no instances of their own: those directly inside a phase (part of
-- that phase), the waits between the steps (a loader's exhausted end, evaluation passes), and
-- the waits and 'Dataloader' phases of a thread other than the steps' (of a rank with steps)
md_nested_dl AS (
  SELECT w.id FROM ss_slice w JOIN slice p ON p.id = w.parent_id
  WHERE w.kind_id = 1 AND w.category = 'dataloader' AND p.category = 'phase'
  UNION ALL
  SELECT w.id FROM ss_slice w WHERE w.kind_id = 1 AND w.name IN ({{between_waits}})
  UNION ALL
  SELECT w.id FROM ss_slice w
  WHERE w.kind_id = 1 AND w.upid IN (SELECT upid FROM ss_step)
    AND (w.utid IS NULL OR w.utid NOT IN (SELECT utid FROM ss_step))
),
-- the phase instances. Kinds 2-5 are 'phase' slices by definition, kind 1 holds the
-- 'Dataloader' phases and the dataloader waits. (md_cpu selects the same rows with the same
-- test: each reader then takes the columns it needs from the index that holds them, with no
-- slice row read; a CTE read twice would be stored once with all its columns.)
md_phase AS (
  SELECT s.id, s.upid, s.ts, s.end_ts,
         CASE WHEN s.kind_id = 1 THEN 'Dataloader' ELSE s.name END AS phase
  FROM ss_slice s
  WHERE s.kind_id BETWEEN 1 AND 5  -- kinds of 'phase' and 'dataloader' slices
    AND (s.kind_id > 1 OR s.id NOT IN (SELECT id FROM md_nested_dl))
),
-- CPU per phase: grouped by (kind, name) first (the order of the name index: no sort), then the
-- names of kind 1 merged into 'Dataloader'
md_cpu AS (
  SELECT CASE WHEN kind_id = 1 THEN 'Dataloader' ELSE name END AS phase, SUM(n) AS calls,
         SUM(total) AS cpu_total_ns, MAX(max_ns) AS cpu_max_ns, MIN(min_ns) AS cpu_min_ns
  FROM (SELECT s.kind_id, s.name, COUNT(*) AS n, SUM(s.dur) AS total, MAX(s.dur) AS max_ns,
               MIN(s.dur) AS min_ns
        FROM ss_slice s
        WHERE s.kind_id BETWEEN 1 AND 5  -- the rows of md_phase
          AND (s.kind_id > 1 OR s.id NOT IN (SELECT id FROM md_nested_dl))
        GROUP BY s.kind_id, s.name)
  GROUP BY 1
),
-- device slices with the start of the slice their flow comes from: devices and flows in one
-- sort by slice id (no per-slice probe of the flow table, which trace processor does not index)
md_dev AS (
  SELECT x.id, x.upid, x.ts, x.end_ts, COALESCE(l.ts, x.ts) AS launch_ts
  FROM (
    SELECT id, upid, ts, end_ts, dev, MAX(src) OVER (PARTITION BY id) AS src
    FROM (SELECT id, upid, ts, end_ts, 1 AS dev, NULL AS src FROM ss_device
          UNION ALL
          SELECT slice_in, NULL, NULL, NULL, 0, slice_out FROM flow)
  ) x
  LEFT JOIN slice l ON l.id = x.src
  WHERE x.dev = 1
),
-- the step and phase current at each row: in (time, ord, id) order per rank, the step (phase)
-- that started last at or before the row (ties: the larger id), or NULL before the first one.
-- Both engines number slices in start-time order (ties: the order they are read), so that is
-- the largest step (phase) id seen so far: one window, one sort. At a step or phase row it is
-- that row itself.
md_carry AS (
  SELECT upid, t, ord, id, ts, end_ts,
         MAX(CASE WHEN ord = 0 THEN id END)
           OVER (PARTITION BY upid ORDER BY t, ord, id ROWS UNBOUNDED PRECEDING) AS step_id,
         MAX(CASE WHEN ord = 1 THEN id END)
           OVER (PARTITION BY upid ORDER BY t, ord, id ROWS UNBOUNDED PRECEDING) AS phase_id
  FROM (SELECT upid, ts AS t, 0 AS ord, id, ts, end_ts FROM ss_step
        UNION ALL
        SELECT upid, ts, 1, id, ts, end_ts FROM md_phase
        UNION ALL
        SELECT upid, launch_ts, 2, id, ts, end_ts FROM md_dev)
),
-- device rows: the phase and step they are attributed to (those still running at the launch;
-- each looked up by id in the slice table)
md_dev_attr AS (
  SELECT d.ts, d.end_ts,
         CASE WHEN d.t < p.ts + p.dur THEN d.phase_id END AS phase_id,
         CASE WHEN d.t < st.ts + st.dur THEN d.step_id END AS step_id
  FROM md_carry d
  LEFT JOIN slice p ON p.id = d.phase_id
  LEFT JOIN slice st ON st.id = d.step_id
  WHERE d.ord = 2
),
-- unions (see _base.sql), one pass over three tagged inputs: kind 1 = device work per phase
-- instance (GPU time of the phase), kind 2 = device work in a step outside any phase (GPU time
-- of Others), kind 3 = the phases of a step clipped to it (the step time covered by phases)
md_union_in AS (
  SELECT 1 AS kind, phase_id AS gid, ts, end_ts FROM md_dev_attr WHERE phase_id IS NOT NULL
  UNION ALL
  SELECT 2, step_id, ts, end_ts FROM md_dev_attr WHERE phase_id IS NULL AND step_id IS NOT NULL
  UNION ALL
  SELECT 3, step_id, ts, end_ts FROM (
    SELECT c.step_id, MAX(c.ts, st.ts) AS ts, MIN(c.end_ts, st.ts + st.dur) AS end_ts
    FROM md_carry c CROSS JOIN slice st  -- each phase row, then its step by id (never a
    WHERE st.id = c.step_id AND c.ord = 1  -- scan of slice per row)
  ) WHERE end_ts > ts
),
md_union AS (
  SELECT kind, gid, SUM(MAX(0, end_ts - MAX(ts, COALESCE(m, ts)))) AS ns FROM (
    SELECT kind, gid, ts, end_ts,
           MAX(end_ts) OVER (PARTITION BY kind, gid ORDER BY ts
                             ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS m
    FROM md_union_in
  ) GROUP BY kind, gid
),
-- GPU per phase, over the instances with device work (the others count 0: see the SELECT);
-- each instance meets its phase name in one sort by id (the instances and the phases grouped)
md_gpu AS (
  SELECT phase, COUNT(*) AS n, SUM(ns) AS total, MAX(ns) AS max_ns, MIN(ns) AS min_ns
  FROM (
    SELECT MAX(phase) AS phase, MAX(ns) AS ns FROM (
      SELECT id AS gid, phase, NULL AS ns FROM md_phase
      WHERE EXISTS (SELECT 1 FROM md_union WHERE kind = 1)  -- no device work: no phase read
      UNION ALL
      SELECT gid, NULL, ns FROM md_union WHERE kind = 1
    ) GROUP BY gid HAVING COUNT(ns) > 0
  ) GROUP BY 1
),
md_others AS (  -- one Others instance per selected step: its rows grouped by step id
  SELECT MAX(dur) - SUM(covered) AS cpu_ns, SUM(gpu) AS gpu_ns FROM (
    SELECT id AS gid, dur, 0 AS covered, 0 AS gpu FROM ss_step
    UNION ALL
    SELECT gid, NULL, CASE kind WHEN 3 THEN ns ELSE 0 END, CASE kind WHEN 2 THEN ns ELSE 0 END
    FROM md_union WHERE kind > 1
  ) GROUP BY gid HAVING COUNT(dur) > 0
),
md_rows AS (
  SELECT c.phase, 1 AS is_phase, c.calls, c.cpu_total_ns, c.cpu_max_ns, c.cpu_min_ns,
         COALESCE(g.total, 0) AS gpu_total_ns,
         COALESCE(g.max_ns, 0) AS gpu_max_ns,
         CASE WHEN COALESCE(g.n, 0) < c.calls THEN 0 ELSE g.min_ns END AS gpu_min_ns
  FROM md_cpu c LEFT JOIN md_gpu g ON g.phase IS c.phase  -- IS: a phase may have no name
  UNION ALL
  SELECT 'Others', 0, COUNT(*), SUM(cpu_ns), MAX(cpu_ns), MIN(cpu_ns),
         SUM(gpu_ns), MAX(gpu_ns), MIN(gpu_ns)
  FROM md_others HAVING COUNT(*) > 0
)
SELECT phase, calls, cpu_total_ns, CAST(cpu_total_ns AS REAL) / calls AS cpu_avg_ns,
       cpu_max_ns, cpu_min_ns,
       CAST(cpu_total_ns AS REAL) / NULLIF((SELECT frame_ns FROM ss_totals), 0) AS cpu_ratio,
       gpu_total_ns, CAST(gpu_total_ns AS REAL) / calls AS gpu_avg_ns, gpu_max_ns, gpu_min_ns,
       CAST(gpu_total_ns AS REAL) / NULLIF((SELECT device_ns FROM ss_totals), 0) AS gpu_ratio
FROM md_rows
ORDER BY is_phase DESC,
         CASE phase WHEN 'Dataloader' THEN 0 WHEN 'Forward' THEN 1 WHEN 'Backward' THEN 2
                    WHEN 'Optimization' THEN 3 ELSE 4 END,
         phase
