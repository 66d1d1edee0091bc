import json
import os
import subprocess
import sys

import pytest

from stepscope.profiler import options
from stepscope.profiler.schedule import Schedule, from_range


def test_parse_full():
    o = options.parse(json.dumps({
        "dir": "/tmp/x", "schedule": {"wait": 1, "warmup": 1, "active": 2, "repeat": -1},
        "timer_only": False, "levels": ["detail", "summary"], "host_metrics": True,
        "sample_interval_s": 0.25, "buffer_bytes": 65536, "rank": 2,
    }))
    assert o["schedule"] == Schedule(wait=1, warmup=1, active=2, repeat=-1)
    assert o["levels"] == ("summary", "detail")
    assert o["sample_interval_s"] == 0.25 and o["rank"] == 2 and o["dir"] == "/tmp/x"


def test_range_schedule_and_env():
    o = options.from_env({"STEPSCOPE_OPTIONS": '{"schedule": [2, 5], "levels": "summary"}'})
    assert o == {"schedule": from_range(2, 5), "levels": ("summary",)}
    assert options.from_env({}) == {}
    assert options.from_env({"STEPSCOPE_OPTIONS": "  "}) == {}


def test_dumps_roundtrip():
    o = {"dir": "d", "schedule": Schedule(skip_first=1, active=3), "levels": ("summary",)}
    assert options.parse(options.dumps(o)) == o


@pytest.mark.parametrize(
    "text, message",
    [
        ("{not json", "STEPSCOPE_OPTIONS is not valid JSON"),
        ("[1, 2]", "must be a JSON object, got list"),
        ('{"dri": "x"}', "unknown key(s) ['dri']"),
        ('{"timer_only": "yes"}', "'timer_only' must be true or false"),
        ('{"sample_interval_s": 0}',
         "'sample_interval_s' must be a finite number from 0.001 to 86400, got 0"),
        ('{"rank": -1}', "'rank' must be an integer from 0 to 2147483647, got -1"),
        ('{"levels": ["full"]}', "'levels' must be a non-empty list"),
        ('{"schedule": {"active": 0}}', "'schedule': schedule: active must be >= 1"),
        ('{"schedule": [5, 2]}', "end must be greater than start"),
        ('{"dir": ""}', "'dir' must be a non-empty string"),
    ],
)
def test_errors(text, message):
    with pytest.raises(ValueError) as e:
        options.parse(text)
    assert message in str(e.value)


@pytest.mark.parametrize(
    "key, value, message",
    [
        # JSON's non-finite numbers: inf passed "> 0" and killed the sampler thread
        ("sample_interval_s", "Infinity", "a finite number from 0.001 to 86400, got inf"),
        ("sample_interval_s", "-Infinity", "a finite number from 0.001 to 86400, got -inf"),
        ("sample_interval_s", "NaN", "a finite number from 0.001 to 86400, got nan"),
        ("sample_interval_s", "1e-300", "a finite number from 0.001 to 86400, got 1e-300"),
        ("sample_interval_s", "86401", "a finite number from 0.001 to 86400, got 86401"),
        ("sample_interval_s", "true", "a finite number from 0.001 to 86400, got True"),
        ("buffer_bytes", "1024", "an integer from 65536 to 1099511627776, got 1024"),
        ("buffer_bytes", "1e9", "an integer from 65536 to 1099511627776, got 1000000000.0"),
        ("buffer_bytes", str(1 << 41), f"an integer from 65536 to 1099511627776, got {1 << 41}"),
        ("rank", str(1 << 31), f"an integer from 0 to 2147483647, got {1 << 31}"),
        ("rank", "Infinity", "an integer from 0 to 2147483647, got inf"),
        ("gpu_bucket_ns", "0", "an integer from 1 to 3600000000000, got 0"),
        ("gpu_bucket_ns", "10" * 13, f"an integer from 1 to 3600000000000, got {'10' * 13}"),
    ],
)
def test_out_of_range_and_non_finite_numbers_name_the_key(key, value, message):
    with pytest.raises(ValueError) as e:
        options.from_env({"STEPSCOPE_OPTIONS": f'{{"{key}": {value}}}'})
    assert str(e.value) == f"STEPSCOPE_OPTIONS: {key!r} must be {message}"


@pytest.mark.parametrize("key, value", [("sample_interval_s", 0.001),
                                        ("sample_interval_s", 86400),
                                        ("buffer_bytes", 1 << 16), ("buffer_bytes", 1 << 40),
                                        ("rank", (1 << 31) - 1), ("gpu_bucket_ns", 1),
                                        ("gpu_bucket_ns", 3600 * 10**9)])
def test_the_bounds_themselves_are_accepted(key, value):
    assert options.parse(json.dumps({key: value})) == {key: value}


def test_the_sampler_refuses_an_endless_interval():
    from stepscope.profiler.host_metrics import HostSampler

    for bad in (float("inf"), float("nan"), 0, 1e-9):
        with pytest.raises(ValueError, match="sample_interval_s must be from 0.001 to 86400"):
            HostSampler(interval_s=bad)


@pytest.mark.parametrize("bad", [0.0001, float("inf"), float("nan"), 0, -1.0])
def test_the_profiler_refuses_a_bad_interval_to_the_caller(tmp_path, bad):
    """Review 2: checked in ``Profiler()``, as other argument errors are (it used to turn
    tracing off for the whole run with one warning, from inside ``start()``)."""
    from stepscope.profiler import Profiler

    with pytest.raises(ValueError, match="sample_interval_s must be from 0.001 to 86400"):
        Profiler(tmp_path, sample_interval_s=bad, use_env=False)


def test_a_start_failing_after_the_session_began_stops_it(tmp_path, monkeypatch, capsys):
    """Review 2: the session ``start()`` began is stopped when a later step of the start fails:
    no writer or I/O thread left running, the summary file finished (it was left open)."""
    import threading

    from stepscope.core import session as _session
    from stepscope.profiler import Profiler
    from stepscope.profiler import profiler as P

    def no_sampler(*a, **k):
        raise OSError("psutil: permission denied")

    monkeypatch.setattr(P, "HostSampler", no_sampler)
    prof = Profiler(tmp_path, schedule=None, run_id="r", report=False, use_env=False)
    prof.start()
    assert "tracing could not start (OSError('psutil: permission denied'))" in \
        capsys.readouterr().err
    assert _session.current() is None
    assert [t.name for t in threading.enumerate() if t.name.startswith("stepscope-")] == []
    prof.step()
    prof.stop()


def test_the_buffer_minimum_has_one_owner(tmp_path, monkeypatch):
    """Review 20: the session owns the buffer minimum; the options and Profiler() read it."""
    from stepscope.core import session as _session
    from stepscope.profiler import Profiler

    monkeypatch.setattr(_session, "MIN_BUFFER_BYTES", 1 << 17)
    with pytest.raises(ValueError, match="buffer_bytes"):
        options.parse(json.dumps({"buffer_bytes": 1 << 16}))
    with pytest.raises(ValueError, match="buffer_bytes must be an integer >= 131072"):
        Profiler(tmp_path, buffer_bytes=1 << 16, use_env=False)
    assert options.parse(json.dumps({"buffer_bytes": 1 << 17})) == {"buffer_bytes": 1 << 17}



BAD_RUN_IDS = ["/abs/x", "../x", "a/b", "", ".", "..", "x" * 256]


def _bad_run_id(name: str, value: str) -> str:
    return (f"{name} must be one plain directory name (no '/', not '.' or '..', 1 to 255 "
            f"bytes), got {value!r}")


@pytest.mark.parametrize("value", BAD_RUN_IDS)
def test_a_run_id_that_is_not_one_directory_name_is_refused(tmp_path, monkeypatch, value):
    """The run id names the run's directory under ``dir``: '/abs/x', '../x' and 'a/b' wrote
    the files outside it, '' and '.' straight into it. Refused where it is given: the
    argument, STEPSCOPE_OPTIONS, STEPSCOPE_RUN_ID (read at start(): checked in Profiler())."""
    from stepscope.profiler import Profiler

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError) as e:
        Profiler("prof", run_id=value, use_env=False)
    assert str(e.value) == _bad_run_id("run_id", value)
    with pytest.raises(ValueError) as e:
        options.parse(json.dumps({"run_id": value}))
    assert str(e.value) == _bad_run_id("STEPSCOPE_OPTIONS: 'run_id'", value)
    if value:  # (an empty STEPSCOPE_RUN_ID is unset)
        monkeypatch.setenv("STEPSCOPE_RUN_ID", value)
        with pytest.raises(ValueError) as e:
            Profiler("prof")
        assert str(e.value) == _bad_run_id("STEPSCOPE_RUN_ID", value)
    assert os.listdir(tmp_path) == []


def test_launcher_run_ids_become_one_directory_name():
    """A launcher's job id is sanitised, not refused: the MPI namespace's '/' (as before) and
    torchrun's --rdzv-id, any text."""
    from stepscope import ranks
    from stepscope.profiler.profiler import default_run_id

    info = ranks.detect(rank=0)
    assert default_run_id(info, {"PMIX_NAMESPACE": "prterun-h-1/1"}) == "mpi-prterun-h-1_1"
    assert default_run_id(info, {"TORCHELASTIC_RUN_ID": "../x"}) == "torchelastic-.._x"
    assert default_run_id(info, {"STEPSCOPE_RUN_ID": "r-1"}) == "r-1"


@pytest.mark.parametrize("how", ["flag", "env"])
def test_stepscope_run_refuses_a_bad_run_id_before_the_program_runs(tmp_path, how):
    (tmp_path / "p.py").write_text("open('ran', 'w').close()\n")
    flag = ["--run-id", "../x"] if how == "flag" else []
    env = _run_env(STEPSCOPE_RUN_ID="../x") if how == "env" else _run_env()
    r = subprocess.run([sys.executable, "-m", "stepscope.cli", "run", "--dir", "out", *flag,
                        "--", sys.executable, "p.py"], capture_output=True, text=True,
                       env=env, timeout=60, cwd=tmp_path)
    name = "--run-id" if how == "flag" else "STEPSCOPE_RUN_ID"
    assert (r.returncode, r.stdout, r.stderr) == (
        2, "", f"stepscope run: {_bad_run_id(name, '../x')}\n")
    assert os.listdir(tmp_path) == ["p.py"]


def _run_env(**extra):
    src = os.path.join(os.path.dirname(__file__), "..", "..", "src")
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEPSCOPE_")}
    env["PYTHONPATH"] = os.pathsep.join([src, env.get("PYTHONPATH", "")])
    return {**env, **extra}


def test_the_boot_module_refuses_a_bad_run_id_in_one_line(tmp_path, monkeypatch, capsys):
    """Under a launcher (``-m stepscope.profiler.boot``): one line, not the Profiler's
    traceback, and the program not run."""
    from stepscope.profiler import boot

    (tmp_path / "p.py").write_text("open('ran', 'w').close()\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("STEPSCOPE_OPTIONS", raising=False)
    monkeypatch.setenv("STEPSCOPE_RUN_ID", "a/b")
    assert boot.main(["p.py"]) == 2
    assert capsys.readouterr().err == f"stepscope: {_bad_run_id('STEPSCOPE_RUN_ID', 'a/b')}\n"
    assert os.listdir(tmp_path) == ["p.py"]
