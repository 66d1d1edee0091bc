"""The analysis commands under faults, for real: a proxy that accepts and never answers, Ctrl-C
and SIGTERM sent to a loading or querying ``stepscope`` process."""

from __future__ import annotations

import glob
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

import stepscope
from stepscope.analysis import engines as eng

SRC = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "src"))
FAKE_TP = os.path.join(os.path.dirname(__file__), "fake_tp", "trace_processor_shell")
COUNT = "SELECT COUNT(*) AS n FROM slice"


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("small") / "s.pftrace")
    with stepscope.trace(path):
        with stepscope.annotate("a"):
            with stepscope.annotate("b"):
                pass
    return path


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """Enough slices (200 k) for loading to take a while."""
    path = str(tmp_path_factory.mktemp("big") / "b.pftrace")
    with stepscope.trace(path):
        for _ in range(100_000):
            with stepscope.annotate("a"):
                with stepscope.annotate("b"):
                    pass
    return path


class StallingProxy:
    """A TCP server on 127.0.0.1 that accepts connections and never answers."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.accepted: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                self.accepted.append(self.sock.accept()[0])
            except OSError:
                return

    def close(self) -> None:
        self.sock.close()
        for c in self.accepted:
            c.close()


@pytest.fixture
def proxy():
    p = StallingProxy()
    yield p
    p.close()


def _env(tmp_path, proxy=None, **extra):
    """A clean environment: an empty HOME (no perfetto cache), a PATH without
    trace_processor_shell, all traffic sent to ``proxy``, temporary files in a fresh dir."""
    env = {k: v for k, v in os.environ.items()
           if k.lower() not in ("http_proxy", "https_proxy", "no_proxy", "all_proxy")
           and k != eng.ENV_BIN}
    home, tmp = tmp_path / "home", tmp_path / "tmpdir"
    home.mkdir(exist_ok=True)
    tmp.mkdir(exist_ok=True)
    env.update(HOME=str(home), TMPDIR=str(tmp), PYTHONPATH=SRC, PATH="/usr/bin:/bin")
    if proxy is not None:
        for k in ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy"):
            env[k] = proxy.url
    env.update(extra)
    if shutil.which("trace_processor_shell", path=env["PATH"]):
        pytest.skip("a trace_processor_shell is installed in /usr/bin or /bin")
    return env


def _stepscope(*argv, env, timeout=60):
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "stepscope.cli", *argv], env=env,
                         capture_output=True, text=True, timeout=timeout)
    return out, time.monotonic() - t0


def test_auto_never_waits_on_the_network(small, tmp_path, proxy):
    env = _env(tmp_path, proxy)
    out, _ = _stepscope("sql", small, COUNT, "--format", "csv", env=env)
    assert (out.returncode, out.stdout, out.stderr) == (0, "n\n2\n", "")
    out, _ = _stepscope("summary", small, env=env)
    assert out.returncode == 0, out.stderr
    assert "download" not in out.stderr.lower() and "trace processor" not in out.stderr.lower()
    assert proxy.accepted == []  # not one connection was tried
    assert os.listdir(tmp_path / "home") == [] and os.listdir(tmp_path / "tmpdir") == []


def test_an_asked_download_gives_up_after_its_timeout(small, tmp_path, proxy):
    env = _env(tmp_path, proxy, STEPSCOPE_DOWNLOAD_TIMEOUT="2")
    base, base_s = _stepscope("sql", small, COUNT, "--engine", "embedded", env=env)
    assert base.returncode == 0
    out, took = _stepscope("sql", small, COUNT, "--engine", "trace_processor", env=env)
    lines = out.stderr.splitlines()
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert lines[0].startswith("stepscope sql: error: cannot download trace_processor_shell "
                               "from https://")
    assert lines[0].endswith(f": timed out after 2 s (set {eng.ENV_BIN} to a local binary)")
    assert len(proxy.accepted) == 1  # it did try, through the proxy
    assert 2.0 <= took - base_s + 1.0 and took - base_s < 2.0 + 6.0  # the timeout, not more
    print(f"gave up after {took:.2f} s ({took - base_s:.2f} s more than a run without it)")
    out, took = _stepscope("get-trace-processor", "--timeout", "1.5", env=env)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and "timed out after 1.5 s" in out.stderr
    assert took < base_s + 1.5 + 3.0
    prebuilts = tmp_path / "home" / ".local" / "share" / "perfetto" / "prebuilts"
    assert os.listdir(prebuilts) == []  # no partial download left


def test_a_present_binary_starts_whatever_the_proxy(small, tmp_path, proxy):
    """trace processor's start-up check on localhost does not go through a stalling proxy."""
    env = _env(tmp_path, proxy)
    env["PYTHONPATH"] = os.pathsep.join([SRC, *[p for p in sys.path if p]])
    out, took = _stepscope("sql", small, small, COUNT, "--format", "csv",
                           "--trace-processor-bin", FAKE_TP, env=env, timeout=90)
    assert (out.returncode, out.stdout) == (0, "n\n4\n"), out.stderr
    assert proxy.accepted == []


def _start(argv, env):
    return subprocess.Popen([sys.executable, "-m", "stepscope.cli", *argv], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _wait_for_db(p, tmpdir, limit=60.0):
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit:
        if glob.glob(os.path.join(tmpdir, "stepscope-*.db")):
            return True
        if p.poll() is not None:
            return False
        time.sleep(0.002)
    return False


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_while_loading_leaves_no_temporary_database(big, tmp_path, sig, code):
    env = _env(tmp_path)
    tmpdir = str(tmp_path / "tmpdir")
    p = _start(["sql", big, COUNT, "--engine", "embedded", "-q"], env)
    try:
        assert _wait_for_db(p, tmpdir), "the database file never appeared"
        p.send_signal(sig)
        out, err = p.communicate(timeout=60)
    finally:
        p.kill()
    assert p.returncode == code and "Traceback" not in err, err
    assert os.listdir(tmpdir) == []


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_ctrl_c_stops_an_endless_query(small, tmp_path, sig, code):
    env = _env(tmp_path)
    tmpdir = str(tmp_path / "tmpdir")
    endless = "WITH RECURSIVE r(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM r) " \
              "SELECT COUNT(*) FROM r"
    p = _start(["sql", small, endless, "--engine", "embedded"], env)
    try:
        assert _wait_for_db(p, tmpdir)
        time.sleep(1.0)  # loaded (a few milliseconds) and well into the query
        assert p.poll() is None
        t0 = time.monotonic()
        p.send_signal(sig)
        out, err = p.communicate(timeout=30)
        took = time.monotonic() - t0
    finally:
        p.kill()
    print(f"exited {took:.3f} s after {signal.Signals(sig).name}")
    assert p.returncode == code and "Traceback" not in err, err
    assert took < 8.0  # interpreter teardown included, on a loaded machine (hangs took > 10 s)
    assert os.listdir(tmpdir) == []


def test_an_asked_download_lands_in_the_cache_that_auto_reads(small, tmp_path, monkeypatch):
    """The download (here from a local server) is checked against the pinned SHA-256, lands
    where the perfetto package keeps it, and auto then finds it without any network; a bad
    checksum leaves nothing."""
    import hashlib
    import http.server

    body = b"#!/bin/sh\nexit 3\n"
    served = []

    class H(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_GET(self):
            served.append(self.path)
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    srv = http.server.HTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    for k in ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.delenv(eng.ENV_BIN, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    url = f"http://127.0.0.1:{srv.server_address[1]}/tp"
    entry = {"file_name": "trace_processor_shell", "url": url,
             "sha256": hashlib.sha256(b"something else").hexdigest()}
    monkeypatch.setattr(eng, "_prebuilt_entry", lambda: entry)
    cache = tmp_path / ".local" / "share" / "perfetto" / "prebuilts"
    try:
        with pytest.raises(eng.EngineError, match="checksum mismatch"):
            eng.download_trace_processor(timeout=10)
        assert os.listdir(cache) == []
        assert eng.find_trace_processor() is None
        entry["sha256"] = hashlib.sha256(body).hexdigest()
        path = eng.download_trace_processor(timeout=10)
        assert path == str(cache / f"trace_processor_shell-{entry['sha256'][:16]}")
        with open(path, "rb") as f:
            assert f.read() == body
        assert os.access(path, os.X_OK) and os.listdir(cache) == [os.path.basename(path)]
        assert served == ["/tp", "/tp"]
        assert eng.find_trace_processor() == path  # found, not fetched again
        assert eng.download_trace_processor(timeout=10) == path and len(served) == 2
    finally:
        srv.shutdown()
        srv.server_close()


def test_a_trickling_download_gives_up_at_the_timeout(tmp_path, monkeypatch):
    """A server that sends a byte every 0.1 s never lets one recv time out: the download
    still gives up after its timeout (1 s) in total, leaving no file."""
    import http.server

    stop = threading.Event()

    class H(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", str(1 << 20))
            self.end_headers()
            while not stop.wait(0.1):
                try:
                    self.wfile.write(b"x")
                    self.wfile.flush()
                except OSError:
                    return

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    for k in ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    url = f"http://127.0.0.1:{srv.server_address[1]}/tp"
    entry = {"file_name": "trace_processor_shell", "url": url, "sha256": "0" * 64}
    monkeypatch.setattr(eng, "_prebuilt_entry", lambda: entry)
    t0 = time.monotonic()
    try:
        with pytest.raises(eng.EngineError, match=r"timed out after 1 s"):
            eng.download_trace_processor(timeout=1)
    finally:
        took = time.monotonic() - t0
        stop.set()
        srv.shutdown()
        srv.server_close()
    assert 1.0 <= took < 4.0
    cache = tmp_path / ".local" / "share" / "perfetto" / "prebuilts"
    assert not cache.exists() or os.listdir(cache) == []
