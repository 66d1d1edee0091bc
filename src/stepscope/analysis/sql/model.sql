-- Model: one row per step phase (Dataloader, Forward, Backward, Optimization, any user phase,
-- then Others).
--
--   phase instance  a slice of category 'phase' (row = its name), or a dataloader wait that is
--                   not directly inside a phase (counted as a 'Dataloader' instance).
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
-- dataloader waits directly inside a phase: part of that phase, not instances of their own
md_nested_dl AS (
  SELECT w.id FROM ss_slice w JOIN slice p ON p.id = w.parent_id
  WHERE w.kind_id = 1 AND w.category = 'dataloader' AND p.category = 'phase'
),
-- the phase instances. Kinds 2-5 are 'phase' slices by definition, kind 1 holds the
-- 'Dataloader' phases and the dataloader waits. (md_cpu selects the same rows with the same
-- test: each reader then takes the columns it needs from the index that holds them, with no
-- slice row read; a CTE read twice would be stored once with all its columns.)
md_phase AS (
  SELECT s.id, s.upid, s.ts, s.end_ts
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
md_dev AS (
  SELECT d.id, d.upid, d.ts, d.end_ts, COALESCE(l.ts, d.ts) AS launch_ts
  FROM ss_device d
  LEFT JOIN flow f ON f.slice_in = d.id
  LEFT JOIN slice l ON l.id = f.slice_out
),
-- the phase / step current at each row: one window counting, in (time, ord, id) order, the steps
-- (high 32 bits) and phases (low 32 bits) seen so far. At a step or phase row the count is its
-- own ordinal by (ts, id); at a later row it is the ordinal of the instance that started last
-- at or before the time of that row (ties: the larger id), or 0 before the first one.
-- (the window sits in the select list of md_carry: computed once for its three readers)
md_carry AS (
  SELECT upid, t, ord, id, ts, end_ts,
         SUM(CASE ord WHEN 0 THEN 4294967296 WHEN 1 THEN 1 ELSE 0 END)
           OVER (PARTITION BY upid ORDER BY t, ord, id ROWS UNBOUNDED PRECEDING) AS n
  FROM (SELECT upid, ts AS t, 0 AS ord, id, ts, end_ts FROM ss_step
        UNION ALL
        SELECT upid, ts, 1, id, ts, end_ts FROM md_phase
        UNION ALL
        SELECT upid, launch_ts, 2, id, ts, end_ts FROM md_dev)
),
md_steps AS (
  SELECT upid, n >> 32 AS sseq, id AS step_id, ts, end_ts FROM md_carry WHERE ord = 0
),
md_phases AS (
  SELECT upid, n & 4294967295 AS pseq, id AS phase_id, ts, end_ts, n >> 32 AS cur_s
  FROM md_carry WHERE ord = 1
),
md_dev_attr AS (
  SELECT d.id AS dev_id, d.upid, d.ts, d.end_ts, mp.phase_id, ms.step_id
  FROM md_carry d
  LEFT JOIN md_phases mp ON mp.upid = d.upid AND mp.pseq = d.n & 4294967295 AND d.t < mp.end_ts
  LEFT JOIN md_steps ms ON ms.upid = d.upid AND ms.sseq = d.n >> 32 AND d.t < ms.end_ts
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
    SELECT ms.step_id, MAX(mp.ts, ms.ts) AS ts, MIN(mp.end_ts, ms.end_ts) AS end_ts
    FROM md_phases mp JOIN md_steps ms ON ms.upid = mp.upid AND ms.sseq = mp.cur_s
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
-- GPU per phase, over the instances with device work (the others count 0: see the SELECT)
md_gpu AS (
  SELECT CASE WHEN s.kind_id = 1 THEN 'Dataloader' ELSE s.name END AS phase,
         COUNT(*) AS n, SUM(u.ns) AS total, MAX(u.ns) AS max_ns, MIN(u.ns) AS min_ns
  FROM md_union u JOIN ss_slice s ON s.id = u.gid
  WHERE u.kind = 1
  GROUP BY 1
),
md_others AS (  -- one Others instance per selected step
  SELECT ms.dur - COALESCE(c.ns, 0) AS cpu_ns, COALESCE(o.ns, 0) AS gpu_ns
  FROM ss_step ms
  LEFT JOIN md_union c ON c.kind = 3 AND c.gid = ms.id
  LEFT JOIN md_union o ON o.kind = 2 AND o.gid = ms.id
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
