-- Device: utilization over the profiled span, one row per counter track (host CPU of the
-- process and of the system from 'host.*' counters, 'nvml.*', 'gpm.*', 'GPU <id> ...') and one
-- row per GPU device computed from its kernels.
--
--   counter rows    samples, min and max of the counter's values; mean is time-weighted: each
--                   sample holds until the next sample of the same track or, at the latest
--                   (the last one always), until the end of the rank's run (the end of its
--                   frame, ss_frame: its last step, or last slice for a process without steps;
--                   with a step range set, the end of the selected steps), or nowhere if it
--                   comes later; and from the start of the run on (a sample before it holds
--                   from the run's start until the next sample, if that comes later):
--                   sum(value_i * hold_i) / sum(hold_i); with no hold at all (one sample at
--                   the run's end, or all at one instant) the plain mean. (A rate over an
--                   interval is stamped at the interval's start, see host_metrics.py, so that
--                   it holds over the interval it measured.) With a step range
--                   set, only samples inside the rank's window are used. A counter of no
--                   process runs to the latest frame end. Values are in the counter's own unit
--                   (the name says it, e.g. "host.cpu.user %").
--   GPU rows        "<GPU track name> kernel busy %": 100 * time in which at least one kernel
--                   ('kernel' or 'communication'; memcpy/memset excluded) runs on any stream of
--                   that GPU, inside the rank's frame (ss_frame), / frame time of that rank.
--                   The GPU of a device slice is its track's parent when that is named 'GPU ...',
--                   else its own track.
--   order           rank, counters before GPUs, name; rows of one name by track id, so both
--                   engines list them alike.
{{base}},
dv_end AS (
  SELECT upid, MIN(ts) AS start_ts, MAX(end_ts) AS end_ts FROM ss_frame GROUP BY upid
),
dv_ctr AS (
  SELECT s.track_id, s.ts, s.value, ti.rank, ti.track_name AS name,
         LEAD(s.ts) OVER (PARTITION BY s.track_id ORDER BY s.ts, s.id) AS next_ts,
         COALESCE(e.start_ts, (SELECT MIN(start_ts) FROM dv_end)) AS run_start,
         COALESCE(e.end_ts, (SELECT MAX(end_ts) FROM dv_end)) AS run_end
  FROM counter s JOIN ss_track_sel ti ON ti.track_id = s.track_id
  LEFT JOIN dv_end e ON e.upid = ti.upid
  WHERE ({{window_filter}})
),
dv_hold AS (
  SELECT track_id, rank, name, value,
         MAX(0, MIN(COALESCE(next_ts, run_end), run_end) - MAX(ts, run_start)) AS hold
  FROM dv_ctr
),
dv_counters AS (
  SELECT rank, name, COUNT(*) AS samples,
         CASE WHEN SUM(hold) > 0
              THEN SUM(value * hold) / SUM(hold)
              ELSE AVG(value) END AS mean,
         MIN(value) AS min, MAX(value) AS max, 0 AS is_gpu, track_id AS tie
  FROM dv_hold GROUP BY track_id, rank, name
),
dv_gpu AS (
  SELECT s.upid, CASE WHEN gp.name LIKE 'GPU %' THEN gp.id ELSE t.id END AS gpu_id,
         CASE WHEN gp.name LIKE 'GPU %' THEN gp.name ELSE t.name END AS gpu_name,
         s.ts, s.end_ts
  FROM ss_device s JOIN track t ON t.id = s.track_id LEFT JOIN track gp ON gp.id = t.parent_id
  WHERE s.category IN ('kernel', 'communication')
),
dv_gpus AS (
  SELECT DISTINCT g.upid, COALESCE(p.rank, g.upid) AS rank, g.gpu_id, g.gpu_name
  FROM dv_gpu g LEFT JOIN ss_process p ON p.upid = g.upid
),
dv_ev AS (  -- as distributed.sql's sweep: kernels + 2^40 * frames in one running sum
  SELECT gpu_id, ts AS t, 1 AS d FROM dv_gpu
  UNION ALL SELECT gpu_id, end_ts, -1 FROM dv_gpu
  UNION ALL SELECT g.gpu_id, f.ts, 1099511627776 FROM ss_frame f JOIN dv_gpus g ON g.upid = f.upid
  UNION ALL SELECT g.gpu_id, f.end_ts, -1099511627776
  FROM ss_frame f JOIN dv_gpus g ON g.upid = f.upid
),
dv_run AS (
  SELECT gpu_id, t, nt, c & 1099511627775 AS ck, c >> 40 AS cf FROM (
    SELECT gpu_id, t,
           SUM(d) OVER (PARTITION BY gpu_id ORDER BY t ROWS UNBOUNDED PRECEDING) AS c,
           LEAD(t) OVER (PARTITION BY gpu_id ORDER BY t ROWS UNBOUNDED PRECEDING) AS nt
    FROM dv_ev)
),
dv_busy AS (
  SELECT gpu_id,
         SUM(CASE WHEN ck > 0 AND cf > 0 THEN nt - t ELSE 0 END) AS busy_ns,
         SUM(CASE WHEN cf > 0 THEN nt - t ELSE 0 END) AS frame_ns
  FROM dv_run WHERE nt IS NOT NULL GROUP BY gpu_id
)
SELECT rank, name, samples, mean, min, max FROM (
  SELECT rank, name, samples, mean, min, max, is_gpu, tie FROM dv_counters
  UNION ALL
  SELECT g.rank, g.gpu_name || ' kernel busy %', NULL,
         100.0 * b.busy_ns / NULLIF(b.frame_ns, 0), NULL, NULL, 1, g.gpu_id
  FROM dv_gpus g JOIN dv_busy b ON b.gpu_id = g.gpu_id
)
ORDER BY rank, is_gpu, name, tie
