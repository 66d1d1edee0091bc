-- Collectives: one row per torch.distributed op (category 'collective': the host side of each
-- op of a process group, from its issue to its completion; named by the op, e.g. 'allreduce').
--
--   calls           number of ops.
--   bytes           sum of their input bytes (debug.bytes; a recv's: its buffer's).
--   timed           ops whose slice ends at their completion (no debug.completion arg). The
--                   others have no host-side time: a device backend's op ends when it is
--                   enqueued on its stream ('stream', NCCL's: its kernel, a 'communication'
--                   slice, has its time); gloo's works without a completion to wait for end
--                   when the program's wait() on them returns ('waited', counted below) or,
--                   without one from Python, when issued ('issued').
--   waited          ops ended when the program waited for them later than their issue
--                   ('waited': gloo's isend/irecv, an asynchronous reduce_scatter_tensor): each
--                   slice ends at its completion's latest, so they are not in the times.
--   total_ns, avg_ns, max_ns, min_ns   of the timed ops' durations, issue to completion (an
--                   op queued behind earlier ones of its group waits in it: gloo runs a
--                   group's ops one at a time); NULL without any.
--   bytes_per_s     the timed ops' bytes / their total duration, in bytes per second: the
--                   rate at which the ops moved their input, not the link's (no algorithm
--                   factor such as a ring all-reduce's 2(n-1)/n).
{{base}},
cl AS (
  SELECT s.name, s.dur, COALESCE(b.int_value, CAST(b.real_value AS INTEGER)) AS bytes,
         CASE WHEN c.arg_set_id IS NULL THEN 1 ELSE 0 END AS timed,
         CASE WHEN c.string_value = 'waited' THEN 1 ELSE 0 END AS waited
  FROM ss_slice s
  LEFT JOIN args b ON b.arg_set_id = s.arg_set_id AND b.key = 'debug.bytes'
  LEFT JOIN args c ON c.arg_set_id = s.arg_set_id AND c.key = 'debug.completion'
  WHERE s.kind_id = 14
)
SELECT name, COUNT(*) AS calls, SUM(bytes) AS bytes, SUM(timed) AS timed,
       SUM(waited) AS waited,
       SUM(CASE WHEN timed = 1 THEN dur END) AS total_ns,
       AVG(CASE WHEN timed = 1 THEN dur END) AS avg_ns,
       MAX(CASE WHEN timed = 1 THEN dur END) AS max_ns,
       MIN(CASE WHEN timed = 1 THEN dur END) AS min_ns,
       1e9 * SUM(CASE WHEN timed = 1 THEN bytes END)
         / NULLIF(SUM(CASE WHEN timed = 1 AND bytes IS NOT NULL THEN dur END), 0)
         AS bytes_per_s
FROM cl
GROUP BY name
ORDER BY total_ns DESC, calls DESC, name
