-- Memory copies: one row per copy direction ('Memcpy <debug.copy_kind>', e.g. 'Memcpy HtoD';
-- 'Memcpy unknown' without the arg) and one row 'Memset'.
--
--   calls           number of slices; total_ns = sum of durations; avg = total / calls; max, min.
--   bytes           sum of debug.bytes.
--   bandwidth_gbps  bytes / total duration of the slices that carry debug.bytes, in GB/s
--                   (bytes per ns = 1e9 bytes per s).
{{base}},
mc AS (
  SELECT CASE WHEN s.category = 'memcpy' THEN 'Memcpy ' || COALESCE(k.string_value, 'unknown')
              ELSE 'Memset' END AS kind,
         s.dur, COALESCE(b.int_value, CAST(b.real_value AS INTEGER)) AS bytes
  FROM ss_device s
  LEFT JOIN args k ON k.arg_set_id = s.arg_set_id AND k.key = 'debug.copy_kind'
  LEFT JOIN args b ON b.arg_set_id = s.arg_set_id AND b.key = 'debug.bytes'
  WHERE s.category IN ('memcpy', 'memset')
)
SELECT kind, COUNT(*) AS calls, SUM(bytes) AS bytes, SUM(dur) AS total_ns, AVG(dur) AS avg_ns,
       MAX(dur) AS max_ns, MIN(dur) AS min_ns,
       CAST(SUM(bytes) AS REAL)
         / NULLIF(SUM(CASE WHEN bytes IS NOT NULL THEN dur END), 0) AS bandwidth_gbps
FROM mc
GROUP BY kind
ORDER BY CASE WHEN kind = 'Memset' THEN 1 ELSE 0 END, kind
