-- Kernels: one row per GPU kernel name (categories 'kernel' and 'communication').
--
--   calls          number of kernel slices; total_ns = sum of durations; avg = total / calls.
--   ratio          total_ns / sum of the durations of all kernels in the selection.
--   blocks_per_sm  duration-weighted mean of debug.blocks_per_sm over the kernels that carry it:
--                  sum(blocks_per_sm * dur) / sum(dur).
--   occupancy      duration-weighted mean of debug.est_achieved_occupancy (as written by the
--                  converter), same weighting.
{{base}},
kn AS (
  SELECT s.name, s.dur,
         COALESCE(b.real_value, b.int_value) AS bps,
         COALESCE(o.real_value, o.int_value) AS occ
  FROM ss_device s
  LEFT JOIN args b ON b.arg_set_id = s.arg_set_id AND b.key = 'debug.blocks_per_sm'
  LEFT JOIN args o ON o.arg_set_id = s.arg_set_id AND o.key = 'debug.est_achieved_occupancy'
  WHERE s.category IN ('kernel', 'communication')
)
SELECT name, COUNT(*) AS calls, SUM(dur) AS total_ns, AVG(dur) AS avg_ns,
       MAX(dur) AS max_ns, MIN(dur) AS min_ns,
       CAST(SUM(dur) AS REAL) / NULLIF((SELECT SUM(dur) FROM kn), 0) AS ratio,
       SUM(CASE WHEN bps IS NOT NULL THEN bps * dur END)
         / NULLIF(SUM(CASE WHEN bps IS NOT NULL THEN dur END), 0) AS blocks_per_sm,
       SUM(CASE WHEN occ IS NOT NULL THEN occ * dur END)
         / NULLIF(SUM(CASE WHEN occ IS NOT NULL THEN dur END), 0) AS occupancy
FROM kn
GROUP BY name
ORDER BY total_ns DESC, name
