-- CNTK-style detail rows: every finished slice of the selection (kind_id not NULL: not the
-- profiler's bookkeeping), in time order.
--   thread   the thread id (tid) of a host slice; for slices on other tracks (GPU streams,
--            async ranges) the track's name.
--   stat_name  the name the summary groups by: 'step' for every step slice ("step <n>"),
--            else the slice's name. Statistics are computed in Python (summaries/cntk.py).
{{base}}
SELECT COALESCE(p.rank, s.upid) AS rank, s.name,
       CASE WHEN s.category = 'step' THEN 'step' ELSE s.name END AS stat_name,
       COALESCE(CAST(th.tid AS TEXT), t.name) AS thread, s.ts, s.end_ts, s.dur
FROM ss_slice s
JOIN track t ON t.id = s.track_id
LEFT JOIN ss_process p ON p.upid = s.upid
LEFT JOIN thread th ON th.utid = s.utid
WHERE s.kind_id IS NOT NULL
ORDER BY rank, s.ts, s.id
