"""End to end in subprocesses: ``stepscope run``, and crashes mid-step (exception, SIGKILL)."""

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb
from tracedecode import decode

from stepscope import _schema as S

SRC = str(Path(__file__).resolve().parents[2] / "src")


def _env(**extra):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([SRC, env.get("PYTHONPATH", "")])
    env.pop("STEPSCOPE_OPTIONS", None)
    env.update(extra)
    return env


def _cli(*args, **kw):
    return subprocess.run([sys.executable, "-m", "stepscope.cli", *args],
                          capture_output=True, text=True, env=_env(), timeout=60, **kw)


def _steps(path):
    return [s.name for s in decode(path).by_category(S.CAT_STEP)]


def test_stepscope_run_end_to_end(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import sys
        import stepscope
        from stepscope import profiler
        for i in range(6):
            with stepscope.annotate(f"work {i}"):
                pass
            profiler.step()
        print("args", sys.argv[1:])
        sys.exit(3)
    """))
    out = tmp_path / "out"
    r = _cli("run", "--dir", str(out), "--run-id", "r", "--schedule", "2-4",
             "--no-host-metrics", "--", sys.executable, str(script), "a", "--b")
    assert r.returncode == 3, r.stderr  # the program's exit status is kept
    assert "args ['a', '--b']" in r.stdout
    # report printed at stop. Step 0 (work 0) began where the profiler could not see it (no
    # batch wait, no phase), at no known time: the first step() ends it uncounted, so five steps
    # are timed, numbered as the program's steps; the tail after the last step() is no step
    assert "stepscope timer (5 steps)" in r.stderr
    run = out / "r"
    assert _steps(run / "rank0.summary.pftrace") == [f"step {i}" for i in range(1, 6)]
    d = decode(run / "rank0.detail.0.pftrace")
    assert sorted(s.name for s in d.slices if s.category == "") == ["work 2", "work 3"]


def test_stepscope_run_step_range(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import stepscope
        setup = sum(range(1000))
        for i in range(4):
            with stepscope.annotate("train_step"):
                pass
    """))
    r = _cli("run", "--dir", str(tmp_path), "--run-id", "r", "--step-range", "train_step",
             "--schedule", "none", "--no-host-metrics", "--no-report", "--", sys.executable,
             str(script))
    assert r.returncode == 0, r.stderr
    # started at the first range begin, a new step at each later begin, the last closed at exit
    assert _steps(tmp_path / "r" / "rank0.summary.pftrace") == [f"step {i}" for i in range(4)]


def test_stepscope_run_errors(tmp_path):
    r = _cli("run", "--schedule", "wait=x", "--", sys.executable, "x.py")
    assert r.returncode == 2 and "is not key=integer" in r.stderr
    r = _cli("run", "--", "bash", "-c", "true")
    assert r.returncode == 2 and "must start with a Python interpreter" in r.stderr
    for launcher in ("torch.distributed.run", "torch.distributed.launch"):
        # (profiled, torchrun's module was the run's one rank: "no steps were recorded")
        r = _cli("run", "--dir", str(tmp_path / "out"), "--", sys.executable, "-u", "-m",
                 launcher, "--nproc-per-node", "2", "train.py")
        assert r.returncode == 2 and r.stderr == (
            f"stepscope run: {launcher} is a launcher. Under a launcher, run the boot module "
            "yourself, e.g. 'torchrun ... -m stepscope.profiler.boot train.py', with options "
            "in STEPSCOPE_OPTIONS\n")
        assert not (tmp_path / "out").exists()
    r = _cli("merge", str(tmp_path), "-o", str(tmp_path / "o.pftrace"))
    assert r.returncode == 2 and "no rank*.summary*.pftrace files found" in r.stderr


CRASH = """
import os, signal, sys, time
import stepscope
from stepscope.profiler import Profiler, schedule
prof = Profiler(sys.argv[1], schedule(skip_first=1, warmup=0, active=100), run_id="r",
                sample_interval_s=0.1, report=False)
prof.start()
t0 = time.monotonic()
for i in range(10**6):
    with prof.phase("Forward"):
        with stepscope.annotate(f"user {i}"):
            time.sleep(0.01)
            if i == 40:
                if sys.argv[2] == "kill" and time.monotonic() - t0 > 1.2:
                    os.kill(os.getpid(), signal.SIGKILL)
                if sys.argv[2] == "raise":
                    raise RuntimeError("boom in step 40")
    prof.step()
"""


def _strict_decode(path):
    trace = pb.Trace()
    trace.ParseFromString(Path(path).read_bytes())  # raises on a torn packet
    return decode(path)


def test_crash_by_exception_leaves_complete_traces(tmp_path):
    (tmp_path / "crash.py").write_text(CRASH)
    r = subprocess.run([sys.executable, str(tmp_path / "crash.py"), str(tmp_path), "raise"],
                       capture_output=True, text=True, env=_env(), timeout=60)
    assert r.returncode == 1 and "boom in step 40" in r.stderr
    s = _strict_decode(tmp_path / "r" / "rank0.summary.pftrace")
    steps = s.by_category(S.CAT_STEP)
    assert [x.name for x in steps] == [f"step {i}" for i in range(41)]
    assert all(x.dur is not None for x in steps)  # the crashed step was closed at exit
    d = _strict_decode(tmp_path / "r" / "rank0.detail.0.pftrace")
    users = [x.name for x in d.slices if x.category == ""]
    assert users == [f"user {i}" for i in range(1, 41)]


def test_crash_by_sigkill_leaves_loadable_traces(tmp_path):
    (tmp_path / "crash.py").write_text(CRASH.replace("time.sleep(0.01)", "time.sleep(0.04)"))
    r = subprocess.run([sys.executable, str(tmp_path / "crash.py"), str(tmp_path), "kill"],
                       capture_output=True, text=True, env=_env(), timeout=60)
    assert r.returncode == -signal.SIGKILL, r.stderr
    s = _strict_decode(tmp_path / "r" / "rank0.summary.pftrace")
    steps = [x.name for x in s.by_category(S.CAT_STEP)]
    # everything up to the last periodic flush (every 1 s of a 1.6 s run) is there
    assert len(steps) >= 10 and steps == [f"step {i}" for i in range(len(steps))]
    assert s.counters[S.HOST_PROCESS_RSS]
    d = _strict_decode(tmp_path / "r" / "rank0.detail.0.pftrace")
    users = [x.name for x in d.slices if x.category == ""]
    assert len(users) >= 10 and users == [f"user {i}" for i in range(1, len(users) + 1)]



TAIL = """
import sys, time
import stepscope
from stepscope.profiler import Profiler
prof = Profiler(sys.argv[1], schedule=None, run_id="r", report=False, host_metrics=False,
                use_env=False)
ending = sys.argv[2]
prof.start()  # never stopped: the interpreter's exit stops it
for i in range(4):
    time.sleep(0.002)
    if ending == "raise in step 3" and i == 3:
        raise RuntimeError("boom in step 3")
    prof.step()
time.sleep(0.002)  # the program's tail
if ending == "sys.exit":
    sys.exit(0)
"""


def test_an_exit_without_stop_leaves_the_tail_out_of_the_steps(tmp_path):
    """Four ``step()`` calls and no ``stop()``: the interpreter's exit (the program's end,
    ``sys.exit``) makes four steps (before: a fifth, the tail after the last call, the run's
    fastest, skewing the min, max and average). An uncaught exception in the fourth
    iteration, before its ``step()``, stops the session at once: three steps, the failed one
    (no batch, no phase in it) not written."""
    (tmp_path / "tail.py").write_text(TAIL)
    for ending, status, n in (("end", 0, 4), ("sys.exit", 0, 4), ("raise in step 3", 1, 3)):
        out = tmp_path / ending.replace(" ", "_")
        r = subprocess.run([sys.executable, str(tmp_path / "tail.py"), str(out), ending],
                           capture_output=True, text=True, env=_env(), timeout=60)
        assert r.returncode == status, r.stderr
        steps = _strict_decode(out / "r" / "rank0.summary.pftrace").by_category(S.CAT_STEP)
        assert [x.name for x in steps] == [f"step {i}" for i in range(n)], (ending, steps)
        assert all(x.dur >= 2_000_000 for x in steps), (ending, steps)
