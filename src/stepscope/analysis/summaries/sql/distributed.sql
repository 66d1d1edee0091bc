-- Distributed: one row per rank (= per process), over the rank's frame (its selected steps;
-- without steps, its whole span). Stragglers are flagged in Python (summaries/post.py).
--
--   steps            number of selected steps; avg_step_ns = mean step duration.
--   frame_ns         length of the union of the rank's frame intervals.
--   computation_ns   time inside the frame in which at least one compute kernel (category
--                    'kernel') runs on any of the rank's streams.
--   communication_ns time inside the frame in which at least one communication kernel
--                    (category 'communication', e.g. NCCL) runs or a torch.distributed op of the
--                    rank (category 'collective', host side) is in flight, counting only the ops
--                    whose slice ends at their completion (no debug.completion arg: gloo's;
--                    NCCL's end when enqueued, their kernels have their time).
--   overlap_ns       time inside the frame in which both run.
--   other_ns         frame_ns - computation_ns - communication_ns + overlap_ns (neither runs).
--   how: one sweep over the rank's interval ends in time order; each start adds 1 to its
--   counter (kernels, communication, frames), each end takes 1 off, and a time span counts
--   where the counters it needs are > 0 up to the next event. The three counters travel
--   packed in one integer (kernels + 2^20 * communication + 2^40 * frames), so one running
--   sum gives all three; it runs in rows, not peers: events at one instant come in any order
--   and the spans between them are 0 long, so only the sum after an instant's last event is
--   read, where each counter is in [0, 2^20) (never below 0, and no 2^20 intervals at once).
--   device_slices    the rank's device slices (kernels, copies, sets) in the selection, and
--   collectives      its collectives timed to completion: without device slices computation,
--                    overlap and other are NULL (no GPU data to split the time with), and
--                    communication too without such collectives (summaries/post.py).
{{base}},
ds_coll AS (
  SELECT s.upid, s.ts, s.end_ts FROM ss_slice s
  WHERE s.kind_id = 14 AND NOT EXISTS (
    SELECT 1 FROM args c WHERE c.arg_set_id = s.arg_set_id AND c.key = 'debug.completion')
),
ds_ev AS (  -- each interval's start and end, its counter's step packed in one integer
  SELECT upid, ts AS t, CASE category WHEN 'kernel' THEN 1 ELSE 1048576 END AS d
  FROM ss_device WHERE category IN ('kernel', 'communication')
  UNION ALL SELECT upid, end_ts, CASE category WHEN 'kernel' THEN -1 ELSE -1048576 END
  FROM ss_device WHERE category IN ('kernel', 'communication')
  UNION ALL SELECT upid, ts, 1048576 FROM ds_coll
  UNION ALL SELECT upid, end_ts, -1048576 FROM ds_coll
  UNION ALL SELECT upid, ts, 1099511627776 FROM ss_frame
  UNION ALL SELECT upid, end_ts, -1099511627776 FROM ss_frame
),
ds_run AS (  -- the counters from t to the next event (one running sum unpacked)
  SELECT upid, t, nt, c & 1048575 AS ck, (c >> 20) & 1048575 AS cc, c >> 40 AS cf FROM (
    SELECT upid, t,
           SUM(d) OVER (PARTITION BY upid ORDER BY t ROWS UNBOUNDED PRECEDING) AS c,
           LEAD(t) OVER (PARTITION BY upid ORDER BY t ROWS UNBOUNDED PRECEDING) AS nt
    FROM ds_ev)
),
ds_sum AS (
  SELECT upid,
         SUM(CASE WHEN cf > 0 THEN nt - t ELSE 0 END) AS frame_ns,
         SUM(CASE WHEN cf > 0 AND ck > 0 THEN nt - t ELSE 0 END) AS computation_ns,
         SUM(CASE WHEN cf > 0 AND cc > 0 THEN nt - t ELSE 0 END) AS communication_ns,
         SUM(CASE WHEN cf > 0 AND ck > 0 AND cc > 0 THEN nt - t ELSE 0 END) AS overlap_ns
  FROM ds_run WHERE nt IS NOT NULL GROUP BY upid
),
ds_steps AS (
  SELECT upid, COUNT(*) AS steps, AVG(dur) AS avg_step_ns FROM ss_step GROUP BY upid
),
ds_has AS (
  SELECT upid, SUM(d) AS device_slices, SUM(c) AS collectives FROM (
    SELECT upid, 1 AS d, 0 AS c FROM ss_device UNION ALL SELECT upid, 0, 1 FROM ds_coll)
  GROUP BY upid
)
SELECT COALESCE(p.rank, d.upid) AS rank, p.process_name, COALESCE(st.steps, 0) AS steps,
       st.avg_step_ns, d.frame_ns, d.computation_ns, d.communication_ns, d.overlap_ns,
       d.frame_ns - d.computation_ns - d.communication_ns + d.overlap_ns AS other_ns,
       COALESCE(h.device_slices, 0) AS device_slices, COALESCE(h.collectives, 0) AS collectives
FROM ds_sum d
LEFT JOIN ss_process p ON p.upid = d.upid
LEFT JOIN ds_steps st ON st.upid = d.upid
LEFT JOIN ds_has h ON h.upid = d.upid
ORDER BY rank
