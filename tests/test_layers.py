"""The package's layers (tools/import_graph.py over all of stepscope) and the hooks through
which the producers reach the core without the core importing them."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import types
from pathlib import Path

import stepscope
from stepscope.core import hooks
from stepscope.core import session as _session

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("import_graph", ROOT / "tools" / "import_graph.py")
ig = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("import_graph", ig)  # (its dataclasses look their module up)
_spec.loader.exec_module(ig)


def test_the_whole_package_imports_only_downwards_without_loops_or_hidden_imports():
    text, _ = ig.report(ROOT / "src" / "stepscope")
    sections: dict[str, list[str]] = {}
    head = None
    for line in text.splitlines():
        if line.startswith("  "):
            sections[head].append(line)
        else:
            head = line.split(":")[0]
            sections[head] = []
    assert sections["cycles"] == []
    assert sections["cycles through function-level imports"] == []
    assert sections["function-level imports, own"] == []
    assert sections["upward imports"] == []


def test_every_module_has_a_layer():
    mods = ig.find_modules(ROOT / "src" / "stepscope")
    top = {n for n in mods if ig.layer_of(n) == ig.LAYERS["stepscope"]}
    # only the public API and the commands sit on the top layer; a new module gets its own row
    assert top == {"stepscope", "stepscope.cli", "stepscope.profiler.boot",
                   "stepscope.profiler.runner", "stepscope.profiler.cli_profiler"}


def test_the_core_names_no_producer():
    """The core, the recorder, the writer and the format never import profiler/gpu/pytorch,
    not even inside a function."""
    mods = ig.find_modules(ROOT / "src" / "stepscope")
    for m in mods.values():
        ig.read_imports(m, set(mods), ROOT / "src" / "stepscope")
    low = ("stepscope.core", "stepscope.record", "stepscope.write", "stepscope.format")
    bad = [(m.name, t) for m in mods.values() if m.name.startswith(low)
           for t, _, _ in m.imports
           if t.startswith(("stepscope.profiler", "stepscope.gpu", "stepscope.pytorch",
                            "stepscope._api", "stepscope._nvtx")) or t == "stepscope"]
    assert bad == []


def test_importing_stepscope_registers_the_gpu_hooks_without_loading_cupti():
    code = ("import sys, stepscope\n"
            "from stepscope import gpu\n"
            "from stepscope.core import hooks\n"
            "assert hooks.sync_gpu is gpu.sync_current_stream\n"
            "assert hooks.gpu_timer_factory is gpu._gpu_timer\n"
            "print(sorted(m for m in sys.modules if m.startswith('stepscope.gpu')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "['stepscope.gpu', 'stepscope.gpu.cupy_timing']"


def test_a_sync_gpu_range_ends_through_the_hook(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(hooks, "sync_gpu", lambda: calls.append("sync"))
    monkeypatch.setitem(sys.modules, "cupy", types.ModuleType("cupy"))  # "the program uses CuPy"
    with stepscope.trace(tmp_path / "t.pftrace"):
        with stepscope.annotate("fwd", sync_gpu=True):
            calls.append("body")
        with stepscope.annotate("plain"):
            pass
    assert calls == ["body", "sync"]


class _Timer:
    def __init__(self, session):
        self.session, self.polls = session, 0

    def poll(self):
        self.polls += 1


def test_the_session_gpu_timer_comes_from_the_registered_factory(tmp_path, monkeypatch):
    monkeypatch.setattr(hooks, "gpu_timer_factory", lambda s: None)  # no CuPy
    sess = _session.Session(tmp_path / "a.pftrace").start()
    try:
        assert sess.gpu_timer() is None and sess.flush_hooks == []
    finally:
        sess.stop()
    made = []
    monkeypatch.setattr(hooks, "gpu_timer_factory", lambda s: made.append(_Timer(s)) or made[-1])
    sess = _session.Session(tmp_path / "b.pftrace").start()
    try:
        timer = sess.gpu_timer()
        assert sess.gpu_timer() is timer and made == [timer] and timer.session is sess
        sess.flush()
        assert timer.polls == 1  # polled at every flush
    finally:
        sess.stop()
