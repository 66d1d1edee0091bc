"""``stepscope run`` on unchanged programs: where step 0 starts, runs with no steps, and
programs that cannot be run at all (they end as under Python, leaving nothing behind)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from test_run_and_crash import _cli, _env
from tracedecode import decode

from stepscope import _schema as S
from stepscope.profiler import boot
from stepscope.profiler.profiler import NO_STEPS_HINT


def _python(*args, cwd):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True,
                          env=_env(), timeout=60, cwd=cwd)


def _run(tmp_path, *args, opts=(), **kw):
    return subprocess.run([sys.executable, "-m", "stepscope.cli", "run", "--dir",
                           str(tmp_path / "out"), *opts, "--", sys.executable, *args],
                          capture_output=True, text=True, env=_env(), timeout=60,
                          cwd=tmp_path, **kw)


def test_stepscope_run_of_a_missing_script_is_pythons_error(tmp_path):
    want = _python("missing.py", cwd=tmp_path)
    got = _run(tmp_path, "missing.py")
    assert (got.returncode, got.stderr) == (want.returncode, want.stderr)
    assert got.returncode == 2 and got.stderr.count("\n") == 1  # one line, no traceback
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("args", [["-m", "no_such_module_here"], ["-c", "1 +"], ["bad.py"],
                                  ["pkgdir"]],
                         ids=["missing-module", "bad-code", "bad-script", "dir-without-main"])
def test_a_program_that_cannot_run_ends_as_under_python_and_leaves_nothing(
        tmp_path, monkeypatch, capsys, args):
    (tmp_path / "bad.py").write_text("def f(:\n")
    (tmp_path / "pkgdir").mkdir()
    want = _python(*args, cwd=tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("STEPSCOPE_OPTIONS", '{"dir": "out"}')
    code = boot.main(list(args))
    assert (code, capsys.readouterr().err) == (want.returncode, want.stderr)
    assert want.returncode == 1 and "Traceback" not in want.stderr
    assert not (tmp_path / "out").exists()


def test_a_failing_program_reports_its_own_frames_only(tmp_path):
    (tmp_path / "boom.py").write_text("def f():\n    raise ValueError('boom')\nf()\n")
    want = _python("boom.py", cwd=tmp_path)
    got = _run(tmp_path, "boom.py", opts=("--no-report", "--no-host-metrics"))
    assert got.returncode == want.returncode == 1
    assert got.stderr.endswith(want.stderr)  # after the no-steps hint, Python's traceback



def test_a_program_interrupted_by_sigint_exits_130(tmp_path):
    """Review 22: a real SIGINT (KeyboardInterrupt in the program) exits 130, as a shell
    reports Python's ^C exit, not 1; Python's traceback is shown."""
    # (the kernel may hand the signal to any thread, e.g. stepscope's writer: then the main
    # thread's sleep is not cut short and the handler runs at its next bytecode check, so the
    # program waits as a training loop does, running Python code, not in one long sleep)
    (tmp_path / "ki.py").write_text("import os, signal, time\n"
                                    "os.kill(os.getpid(), signal.SIGINT)\n"
                                    "for _ in range(500):\n    time.sleep(0.01)\n")
    # SIGINT as a terminal's program has it: a suite run as a background job of a
    # non-interactive shell inherits it ignored (then Python installs no handler at all)
    got = _run(tmp_path, "ki.py", opts=("--no-report", "--no-host-metrics"),
               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert got.returncode == 130, got.stderr
    assert got.stderr.rstrip().endswith("KeyboardInterrupt")


SIGNALLED = """
import os, sys, time, stepscope
for i in range(3000):
    time.sleep(0.01)
    stepscope.step()
    if i == 4:
        print("READY", os.getpid(), flush=True)
"""


def _run_signalled(tmp_path, preexec_fn=None) -> subprocess.Popen:
    """``stepscope run`` of SIGNALLED, started; it prints READY and the program's pid."""
    (tmp_path / "train.py").write_text(SIGNALLED)
    return subprocess.Popen(
        [sys.executable, "-m", "stepscope.cli", "run", "--dir", str(tmp_path / "out"),
         "--run-id", "r", "--schedule", "none", "--no-host-metrics", "--no-report", "--",
         sys.executable, "train.py"],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=_env(), cwd=tmp_path, preexec_fn=preexec_fn)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT],
                         ids=["SIGTERM", "SIGHUP", "SIGINT"])
def test_a_signal_to_stepscope_run_reaches_the_program_which_finishes_its_trace(tmp_path, sig):
    """A job scheduler's or a container's stop signals the top process only: ``stepscope
    run``. It passes the signal on (SIGINT too, as no terminal sent it to the whole group),
    waits for the program to finish its trace, and exits as the program did. Before, SIGTERM
    ended ``stepscope run`` alone (143), and the program ran on, its parent gone."""
    # (a suite run as a background job of a non-interactive shell inherits SIGINT ignored,
    # one run under nohup SIGHUP: an ignored signal is left so, by stepscope run too)
    proc = _run_signalled(tmp_path, lambda: [signal.signal(s, signal.SIG_DFL)
                                             for s in (signal.SIGINT, signal.SIGHUP)])
    try:
        ready = proc.stdout.readline().split()
        assert ready[0] == "READY", proc.stderr.read()
        proc.send_signal(sig)
        proc.wait(timeout=60)
    finally:
        proc.kill()
    err = proc.stderr.read()
    # as a shell gives a program that a signal ended; Python's own ^C exit for SIGINT
    assert proc.returncode == 128 + sig, err
    if sig == signal.SIGINT:
        assert err.rstrip().endswith("KeyboardInterrupt")
    with pytest.raises(ProcessLookupError):
        os.kill(int(ready[1]), 0)  # the program is gone, not orphaned
    steps = decode(tmp_path / "out" / "r" / "rank0.summary.pftrace").by_category(S.CAT_STEP)
    # the steps that step() ended, from the first call's on (the time before it began where
    # no batch or phase showed: uncounted), the one the signal cut short maybe too
    assert len(steps) >= 4 and [s.name for s in steps] == [f"step {k}"
                                                          for k in range(1, len(steps) + 1)]


def test_a_program_whose_stepscope_run_is_killed_finishes_its_trace(tmp_path):
    """SIGKILL (the OOM killer, a hard stop) to ``stepscope run``, which cannot pass it on:
    the program gets SIGTERM as its parent dies, finishes its trace and ends. Before, it ran
    on, an orphan, appending steps to the run's files."""
    proc = _run_signalled(tmp_path)
    try:
        ready = proc.stdout.readline().split()
        assert ready[0] == "READY", proc.stderr.read()
        proc.kill()
        proc.wait(timeout=60)
    finally:
        proc.kill()
    program = int(ready[1])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # (not our child: no wait() for it; gone when no
        try:  # /proc entry is left, a zombie's reaped by init)
            os.kill(program, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    with pytest.raises(ProcessLookupError):
        os.kill(program, 0)
    steps = decode(tmp_path / "out" / "r" / "rank0.summary.pftrace").by_category(S.CAT_STEP)
    assert 4 <= len(steps) < 2999
    assert [s.name for s in steps] == [f"step {k}" for k in range(1, len(steps) + 1)]


COUNTS_SIGINT = """
import os, signal, sys, time
got = []
signal.signal(signal.SIGINT, lambda *a: got.append(1))
print("READY", flush=True)
deadline = time.monotonic() + 2.0
while time.monotonic() < deadline and not got:
    time.sleep(0.01)
time.sleep(0.3)  # (a second SIGINT, passed on by stepscope run, would come meanwhile)
print("SIGINTS", len(got), flush=True)
"""


def test_a_ctrl_c_at_a_terminal_reaches_the_program_once(tmp_path):
    """A Ctrl-C at a terminal goes to its foreground process group: ``stepscope run`` and the
    program both get it. ``stepscope run`` does not pass it on (the program would get two,
    the second cutting its clean-up short): here, under a pseudo-terminal made the controlling
    terminal of a new session, the program counts one."""
    import fcntl
    import pty
    import termios

    (tmp_path / "p.py").write_text(COUNTS_SIGINT)
    try:
        master, slave = pty.openpty()
    except OSError as exc:  # (a sandbox without pseudo-terminals)
        pytest.skip(f"no pseudo-terminal here: {exc}")

    def controlling_terminal() -> None:
        os.setsid()
        fcntl.ioctl(slave, termios.TIOCSCTTY, 0)
        signal.signal(signal.SIGINT, signal.SIG_DFL)

    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "stepscope.cli", "run", "--dir", str(tmp_path / "out"),
             "--no-report", "--no-host-metrics", "--", sys.executable, "p.py"],
            stdin=slave, stdout=slave, stderr=slave, env=_env(), cwd=tmp_path,
            preexec_fn=controlling_terminal)
    except subprocess.SubprocessError as exc:  # (no controlling terminal may be taken here)
        os.close(master)
        pytest.skip(f"the pseudo-terminal cannot be a controlling terminal here: {exc}")
    finally:
        os.close(slave)
    out = b""
    try:
        while b"READY" not in out:
            out += os.read(master, 4096)
        os.killpg(proc.pid, signal.SIGINT)  # as the terminal does for Ctrl-C
        assert proc.wait(timeout=60) == 0
        while True:
            try:
                chunk = os.read(master, 4096)
            except OSError:  # (the other end closed)
                break
            if not chunk:
                break
            out += chunk
    finally:
        proc.kill()
        os.close(master)
    assert b"SIGINTS 1" in out, out


def test_a_program_a_signal_killed_exits_as_a_shell_says(tmp_path):
    """SIGKILL (nothing can be finished): 137, as a shell gives it, not Python's -9 passed to
    sys.exit (247)."""
    (tmp_path / "k.py").write_text("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n")
    got = _run(tmp_path, "k.py", opts=("--no-report", "--no-host-metrics"))
    assert got.returncode == 128 + signal.SIGKILL == 137


START_UP = """
import time
time.sleep(0.5)  # a slow import (torch)
import stepscope
batches = [1, 2, 3]
for b in stepscope.dataloader(batches):
    time.sleep(0.02)
    stepscope.step()
time.sleep(0.3)  # the tail: saving a checkpoint
"""


def test_step_zero_starts_at_the_first_batch_wait_not_at_interpreter_start(tmp_path):
    (tmp_path / "train.py").write_text(START_UP)
    r = _run(tmp_path, "train.py", opts=("--run-id", "r", "--schedule", "none",
                                         "--no-host-metrics", "--no-report"))
    assert r.returncode == 0, r.stderr
    steps = decode(tmp_path / "out" / "r" / "rank0.summary.pftrace").by_category(S.CAT_STEP)
    assert [s.name for s in steps] == ["step 0", "step 1", "step 2"]
    # each step: its wait (nothing) and 20 ms of work; not the 500 ms start-up, not the tail
    assert all(0.02e9 <= s.dur < 0.25e9 for s in steps), [s.dur for s in steps]


def test_a_run_without_steps_says_so_with_the_flag_to_use(tmp_path):
    (tmp_path / "plain.py").write_text("import time\ntime.sleep(0.2)\n")
    r = _run(tmp_path, "plain.py", opts=("--run-id", "r", "--no-host-metrics", "--no-report"))
    assert r.returncode == 0, r.stderr
    assert NO_STEPS_HINT in r.stderr and "--step-range NAME" in NO_STEPS_HINT
    d = decode(tmp_path / "out" / "r" / "rank0.summary.pftrace")
    assert d.by_category(S.CAT_STEP) == []  # not one start-up-long "step"


def test_a_step_range_that_names_no_range_says_so(tmp_path):
    (tmp_path / "train.py").write_text(textwrap.dedent("""
        import stepscope
        for i in range(3):
            with stepscope.annotate("train_step"):
                pass
    """))
    r = _cli("run", "--dir", str(tmp_path / "out"), "--step-range", "train-step", "--",
             sys.executable, str(tmp_path / "train.py"))
    assert r.returncode == 0, r.stderr
    assert "no range named 'train-step' began" in r.stderr
    assert not (tmp_path / "out").exists()


OWN_PROFILER = """
import time
import stepscope
loader = [1, 2, 3]
with stepscope.Profiler(dir="own", schedule=None) as prof:
    for epoch in range(2):
        wrapped = prof.dataloader(loader)
        assert len(wrapped) == 3  # tqdm's total
        for b in wrapped:
            with prof.phase("forward"):
                time.sleep(0.01)
            with prof.phase("backward"):
                time.sleep(0.02)
            prof.step(num_samples=4)
        prof.epoch()
    print("timer steps", prof.timer_stats().steps, "step_num", prof.step_num)
print("summary", prof.summary().splitlines()[0])
"""


def test_a_program_with_its_own_profiler_records_its_steps_under_stepscope_run(tmp_path):
    # the program's Profiler is the one it calls step()/phase()/dataloader() on: under
    # `stepscope run` those calls reach the run's profiler (2 epochs x 3 batches = 6 steps, each
    # with one forward and one backward phase), not a timer nobody prints
    (tmp_path / "train.py").write_text(OWN_PROFILER)
    r = _run(tmp_path, "train.py", opts=("--run-id", "r", "--schedule", "none",
                                         "--no-host-metrics", "--no-report"))
    assert r.returncode == 0, r.stderr
    assert "timer steps 6 step_num 6" in r.stdout
    assert "summary stepscope timer (6 steps)" in r.stdout
    assert NO_STEPS_HINT not in r.stderr
    d = decode(tmp_path / "out" / "r" / "rank0.summary.pftrace")
    steps = d.by_category(S.CAT_STEP)
    assert [s.name for s in steps] == [f"step {i}" for i in range(6)]
    phases = [s.name for s in d.slices if s.name in ("forward", "backward")]
    assert phases == ["forward", "backward"] * 6
    assert len([s for s in d.slices if s.name == "dataloader.next"]) == 6
    assert all(0.03e9 <= s.dur < 0.5e9 for s in steps), [s.dur for s in steps]
    assert not (tmp_path / "own").exists()  # one run, one directory: the run's


def test_an_interpreter_without_stepscopes_dependencies_is_one_line(tmp_path):
    """``stepscope run -- python train.py`` with a ``python`` that lacks stepscope's
    dependencies (here a bare venv): the boot module's imports failed with a raw traceback.
    Now one line naming the interpreter, what it could not import and what to do; the
    program not run, nothing written."""
    import venv

    venv.create(tmp_path / "bare", with_pip=False)
    python = str(tmp_path / "bare" / "bin" / "python")
    (tmp_path / "p.py").write_text("open('ran', 'w').close()\n")
    want = subprocess.run([python, "-c", "import stepscope.profiler.boot"],
                          capture_output=True, text=True, env=_env(), timeout=60)
    why = want.stderr.strip().splitlines()[-1]
    assert want.returncode == 1 and why.startswith("ModuleNotFoundError: No module named ")
    r = subprocess.run([sys.executable, "-m", "stepscope.cli", "run", "--dir", "out", "--",
                        python, "p.py"], capture_output=True, text=True, env=_env(),
                       timeout=60, cwd=tmp_path)
    assert (r.returncode, r.stdout, r.stderr) == (2, "", (
        f"stepscope run: {python} cannot import stepscope ({why}): run the program with the "
        f"Python stepscope is installed in ({sys.executable}), or install stepscope for "
        f"{python}\n"))
    assert sorted(os.listdir(tmp_path)) == ["bare", "p.py"]
