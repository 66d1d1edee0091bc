-- Shared building blocks of every summary query (CTEs; the table files start with `{{base}},`).
--
-- Portable SQL: plain SQLite (CTEs, recursive CTEs, window functions) over trace processor's
-- tables, so the same text runs on Perfetto's trace processor and on stepscope's embedded engine.
-- `{{...}}` placeholders are filled by stepscope.analysis.summaries.render() with literal filters
-- (always valid SQL; "1" when no filter is set).
--
-- Definitions used by every table:
--   * owner of a track (ss_track_info): upid of the nearest track at or above it (following
--     track.parent_id) that is a thread track (-> thread.upid) or a process track (-> upid),
--     counter tracks included (thread_counter_track, process_counter_track: trace processor
--     lists a counter under a process there, with no parent_id and not in process_track).
--     GPU "stream <id>" tracks sit under a "GPU <id> (<name>)" track under the rank's process
--     track, so device slices belong to the rank that launched them. upid -1 = no process.
--     utid: the thread of the nearest thread track at or above the track (host slices, also
--     those on child tracks of a thread such as "CUDA API", whether the engine lists such a
--     child as a thread track or as a process track); NULL when no thread track is above.
--   * rank of a process: the <N> of its name "rank <N> (<host>)", else its pid.
--   * unfinished slices (dur < 0) are ignored everywhere.
--   * kind of a slice (ss_slice.kind_id, an integer: sorting on it is much cheaper than on text;
--     names in ss_kind, listed here in that order), used by the Overview:
--       Step            category 'step'
--       Dataloader      category 'dataloader' (consumer waits) or a 'phase' named 'Dataloader'
--                       (or 'data', 'data_loading', ...: as below)
--       Forward / Backward / Optimization   a 'phase' slice with that name, or one of its
--                       usual spellings in any case ('fwd', 'BWD', 'optimizer_step', ...:
--                       stepscope._schema.PHASE_ALIASES; placeholder phase_kind)
--       Other phases    any other 'phase' slice
--       Kernels         category 'kernel'          Communication  category 'communication'
--       Memcpy          category 'memcpy'          Memset         category 'memset'
--       Synchronization category 'sync'            Runtime API    'cuda_runtime' / 'cuda_driver'
--       GPU ranges      category 'gpu_range'       (none)         category 'stepscope'
--       Collectives     category 'collective': torch.distributed ops on the host, issue to
--                       completion (not device activity: gloo's run on the CPU, NCCL's kernels
--                       are 'communication' slices of their own)
--       User ranges     anything else (no category, 'nvtx', or a user's domain/category)
--                       that lasts: a slice of no duration is an instant (mark(), an NVTX
--                       mark), not a call, and has no kind
--   * device activity (kind_id 9-12): kernel, communication, memcpy, memset slices; ss_device
--     holds just those rows of ss_slice (the tables that only need device slices read it).
--   * placeholders slices / step_rows: the table the slices are read from and the test that
--     picks the step slices: slice / s.category = 'step'; on stepscope's embedded engine, the
--     importer's ss_slice_base (every slice; the finished ones on listed tracks with their
--     kind_id, which the others lack) / s.kind_id = 0, which its kind index answers. Both give
--     the same rows.
--   * filters: rank filter -> ss_track_sel (tracks of the selected ranks); selected steps (step
--     number in [A, B)) -> ss_step; with a step range set, slices are kept when they START
--     inside the rank's window [start of its first selected step, end of its last selected
--     step), step slices only when selected -> ss_slice; the thread filter keeps host slices
--     of the named threads (tid or thread name) and never removes device/process-track slices
--     but the async ranges (start_range, async def: on "async ranges" tracks of the process,
--     of no one thread) -> ss_slice. Steps and windows ignore the thread filter.
--   * union length ("time covered", overlaps merged): with a group's intervals ordered by start,
--     an interval adds max(0, end - max(start, M)) where M is the largest end before it
--     (earlier intervals all start no later, so what they cover of [start, end) is exactly
--     [start, min(end, M))). One window pass:
--       m = MAX(end_ts) OVER (PARTITION BY g ORDER BY ts
--                             ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING),
--       union = SUM(MAX(0, end_ts - MAX(ts, COALESCE(m, ts)))).
--   * frame (ss_frame): the time ratios refer to: the selected step slices of each rank; a rank
--     with no step slices gets one frame from its first slice start to its last slice end.
--   * frame regions (ss_frame_region): the frame of each rank as islands [f0, f1) (its frame
--     intervals with overlapping or touching ones merged), each with the frame time before it
--     (cum) and the next island's start (nxt), plus one region before the first island
--     (f0 = f1 = the smallest integer): per rank, the regions [f0, nxt) tile the time line, so
--     every slice starts in exactly one. id numbers them in (upid, f0) order. Frame time before
--     an instant x: C(x) = cum + MIN(x, f1) - f0 of the last region with f0 <= x.
--   * totals (ss_totals, one row): frame_ns = the length of the frame islands, summed over
--     ranks (the denominator of the time ratios); device_ns = the union of the device slices
--     (kind_id 9-12) per rank, summed over ranks (the denominator of the GPU ratios).
WITH RECURSIVE
ss_track_up(track_id, cur_id, hops) AS (
  SELECT id, id, 0 FROM track
  UNION ALL
  SELECT u.track_id, t.parent_id, u.hops + 1
  FROM ss_track_up u JOIN track t ON t.id = u.cur_id
  WHERE t.parent_id IS NOT NULL AND u.hops < 32
),
ss_track_hop AS (
  SELECT u.track_id, u.hops, COALESCE(th.upid, pt.upid, pc.upid) AS upid,
         COALESCE(tt.utid, tc.utid) AS utid
  FROM ss_track_up u
  LEFT JOIN thread_track tt ON tt.id = u.cur_id
  LEFT JOIN thread_counter_track tc ON tc.id = u.cur_id
  LEFT JOIN thread th ON th.utid = COALESCE(tt.utid, tc.utid)
  LEFT JOIN process_track pt ON pt.id = u.cur_id
  LEFT JOIN process_counter_track pc ON pc.id = u.cur_id
  WHERE tt.id IS NOT NULL OR pt.id IS NOT NULL OR tc.id IS NOT NULL OR pc.id IS NOT NULL
),
ss_track_owner AS (
  SELECT DISTINCT track_id,
         FIRST_VALUE(upid) OVER (PARTITION BY track_id ORDER BY hops) AS upid,
         FIRST_VALUE(utid) OVER (PARTITION BY track_id
                                 ORDER BY CASE WHEN utid IS NULL THEN 1 ELSE 0 END, hops) AS utid
  FROM ss_track_hop
),
ss_track_info AS (
  SELECT t.id AS track_id, t.name AS track_name, COALESCE(o.upid, -1) AS upid, o.utid
  FROM track t LEFT JOIN ss_track_owner o ON o.track_id = t.id
),
ss_process AS (
  SELECT upid, pid, name AS process_name,
         CASE WHEN name LIKE 'rank %' THEN CAST(substr(name, 6) AS INTEGER) ELSE pid END AS rank
  FROM process
),
ss_kind AS (
  SELECT 0 AS kind_id, 'Step' AS kind UNION ALL SELECT 1, 'Dataloader'
  UNION ALL SELECT 2, 'Forward' UNION ALL SELECT 3, 'Backward' UNION ALL SELECT 4, 'Optimization'
  UNION ALL SELECT 5, 'Other phases' UNION ALL SELECT 6, 'User ranges'
  UNION ALL SELECT 7, 'Runtime API' UNION ALL SELECT 8, 'Synchronization'
  UNION ALL SELECT 9, 'Kernels' UNION ALL SELECT 10, 'Communication'
  UNION ALL SELECT 11, 'Memcpy' UNION ALL SELECT 12, 'Memset' UNION ALL SELECT 13, 'GPU ranges'
  UNION ALL SELECT 14, 'Collectives'
),
ss_track_sel AS (
  SELECT ti.track_id, ti.track_name, ti.upid, ti.utid, COALESCE(p.rank, ti.upid) AS rank
  FROM ss_track_info ti LEFT JOIN ss_process p ON p.upid = ti.upid
  WHERE ({{rank_filter}})
),
ss_step_all AS (
  SELECT s.id, s.ts, s.dur, s.ts + s.dur AS end_ts, ti.upid, ti.rank, ti.utid,
         COALESCE(a.int_value, CAST(a.real_value AS INTEGER),
                  CAST(substr(s.name, 6) AS INTEGER)) AS step,
         COALESCE(n.int_value, n.real_value) AS num_samples
  FROM {{slices}} s
  CROSS JOIN ss_track_sel ti  -- slices in id order, each track looked up (no per-track scans)
  LEFT JOIN args a ON a.arg_set_id = s.arg_set_id AND a.key = 'debug.step'
  LEFT JOIN args n ON n.arg_set_id = s.arg_set_id AND n.key = 'debug.num_samples'
  WHERE ti.track_id = s.track_id AND {{step_rows}} AND s.dur >= 0
),
ss_step AS (
  SELECT * FROM ss_step_all WHERE ({{step_filter}})
),
ss_window AS (
  SELECT upid, MIN(ts) AS w_start, MAX(end_ts) AS w_end FROM ss_step GROUP BY upid
),
ss_slice AS (
  SELECT s.id, s.ts, s.dur, s.ts + s.dur AS end_ts, s.track_id, s.category, s.name,
         s.parent_id, s.arg_set_id, ti.upid, ti.utid,
         CASE
           WHEN s.category IS NULL THEN CASE WHEN s.dur > 0 THEN 6 END  -- most: tested first
           WHEN s.category = 'step' THEN 0
           WHEN s.category = 'dataloader' THEN 1
           WHEN s.category = 'phase' THEN {{phase_kind}}
           WHEN s.category IN ('cuda_runtime', 'cuda_driver') THEN 7
           WHEN s.category = 'sync' THEN 8
           WHEN s.category = 'kernel' THEN 9
           WHEN s.category = 'communication' THEN 10
           WHEN s.category = 'memcpy' THEN 11
           WHEN s.category = 'memset' THEN 12
           WHEN s.category = 'gpu_range' THEN 13
           WHEN s.category = 'collective' THEN 14
           WHEN s.category = 'stepscope' THEN NULL
           WHEN s.dur > 0 THEN 6
         END AS kind_id
  FROM {{slices}} s
  CROSS JOIN ss_track_sel ti  -- slices in id order, each track looked up (no per-track scans)
  WHERE ti.track_id = s.track_id AND s.dur >= 0 AND ({{thread_filter}}) AND ({{window_filter}})
    AND ({{step_slice_filter}})
),
ss_frame AS (
  SELECT upid, ts, end_ts FROM ss_step
  UNION ALL
  SELECT s.upid, MIN(s.ts), MAX(s.end_ts)
  -- the one row of `need` (none when every process has steps) drives the scan of all slices,
  -- so it is skipped then (a WHERE term with a subquery would be tested on every slice);
  -- the second test picks the processes without steps
  FROM (SELECT 1 WHERE EXISTS (SELECT 1 FROM ss_track_sel
                               WHERE upid NOT IN (SELECT upid FROM ss_step))) need
  CROSS JOIN ss_slice s
  WHERE s.upid NOT IN (SELECT upid FROM ss_step)
  GROUP BY s.upid
),
ss_frame_region AS (
  SELECT ROW_NUMBER() OVER (ORDER BY upid, f0) AS id, upid, f0, f1,
         COALESCE(SUM(f1 - f0) OVER (PARTITION BY upid ORDER BY f0
                                     ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING), 0) AS cum,
         LEAD(f0, 1, 9223372036854775807) OVER (PARTITION BY upid ORDER BY f0) AS nxt
  FROM (
    SELECT upid, MIN(ts) AS f0, MAX(end_ts) AS f1 FROM (
      SELECT upid, ts, end_ts,  -- island number: the count of frames that start one
             SUM(CASE WHEN ts <= m THEN 0 ELSE 1 END) OVER (PARTITION BY upid ORDER BY ts, end_ts
                                                          ROWS UNBOUNDED PRECEDING) AS island
      FROM (SELECT upid, ts, end_ts,
                   MAX(end_ts) OVER (PARTITION BY upid ORDER BY ts, end_ts
                                     ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS m
            FROM ss_frame)
    ) GROUP BY upid, island
    UNION ALL
    SELECT upid, -9223372036854775807 - 1, -9223372036854775807 - 1 FROM ss_frame GROUP BY upid
  )
),
ss_device AS (
  SELECT * FROM ss_slice WHERE kind_id BETWEEN 9 AND 12  -- device activity
),
ss_totals AS (
  SELECT (SELECT SUM(f1 - f0) FROM ss_frame_region) AS frame_ns,
         COALESCE((SELECT SUM(MAX(0, end_ts - MAX(ts, COALESCE(m, ts)))) FROM (
            SELECT ts, end_ts,
                   MAX(end_ts) OVER (PARTITION BY upid ORDER BY ts
                                     ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS m
            FROM ss_device)), 0) AS device_ns
)
