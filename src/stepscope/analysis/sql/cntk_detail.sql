-- CNTK-style detail rows: every finished slice of the selection (kind not NULL), in time order.
--   thread   the thread id (tid) of a host slice; for slices on other tracks (GPU streams,
--            async ranges) the track's name.
--   stat_name  the name the summary groups by: 'step' for every step slice ("step <n>"),
--            else the slice's name. Statistics are computed in Python (analysis/cntk.py).
{{base}}
SELECT rank, name, CASE WHEN category = 'step' THEN 'step' ELSE name END AS stat_name,
       COALESCE(CAST(tid AS TEXT), track_name) AS thread, ts, end_ts, dur
FROM ss_slice
WHERE kind IS NOT NULL
ORDER BY rank, ts, id
