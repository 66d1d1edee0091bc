"""tools/import_graph.py over stepscope.analysis: no import loop, no import running up the
layers, no function-level import of stepscope's own modules (hidden loops); and the tool
itself finds those on a small package made for the test."""

from __future__ import annotations

import importlib.util
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("import_graph", ROOT / "tools" / "import_graph.py")
ig = importlib.util.module_from_spec(spec)
sys.modules["import_graph"] = ig  # (its dataclasses look their module up)
spec.loader.exec_module(ig)


def test_analysis_has_no_cycle_upward_or_hidden_import():
    text, clean = ig.report(ROOT / "src" / "stepscope" / "analysis")
    assert "cycles: none\n" in text
    assert "cycles through function-level imports: none\n" in text
    assert "function-level imports, own: none\n" in text
    assert "upward imports: none\n" in text
    assert "private names imported from another module: none\n" in text
    assert clean


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, body in files.items():
        p = tmp_path / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(body))
    return tmp_path / "pkg"


def test_the_tool_finds_loops_hidden_imports_and_private_names(tmp_path):
    pkg = _package(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "from . import b\n",
        "pkg/b.py": "from .c import _secret\n",
        "pkg/c.py": "def f():\n    from . import a\n    import json\n_secret = 1\n",
        "pkg/d/__init__.py": "from .e import x\n",
        "pkg/d/e.py": "from ..a import b\nx = 1\n",
        "pkg/f.py": "from .d import e\ne._hidden = 2\n",
    })
    text, clean = ig.report(pkg)
    assert not clean
    assert "cycles: none\n" in text  # a -> b -> c is a loop only through c's function
    assert "  pkg.a <-> pkg.b <-> pkg.c\n" in text
    assert "  pkg.c:2 pkg.a\n" in text and "  pkg.c:3 json\n" in text
    assert "  pkg.b:1 _secret from pkg.c\n" in text
    assert "  pkg.f:2 _hidden of pkg.d.e\n" in text  # set through the imported module
    # importing pkg.d.e runs pkg.d's __init__ first; pkg.d's own modules do not run it again
    g = ig.graph(_read(pkg))
    assert g["pkg.f"] == {"pkg.d", "pkg.d.e"}
    assert g["pkg.d.e"] == {"pkg.a"} and g["pkg.d"] == {"pkg.d.e"}


def _read(pkg: Path) -> dict:
    mods = ig.find_modules(pkg)
    for m in mods.values():
        ig.read_imports(m, set(mods), ig.package_root(pkg)[0])
    return mods


def test_a_module_level_loop_and_an_upward_import(tmp_path):
    pkg = _package(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/low.py": "from . import high\n",
        "pkg/high.py": "from . import low\n",
    })
    mods = _read(pkg)
    assert ig.cycles(ig.graph(mods)) == [["pkg.high", "pkg.low"]]
    assert ig.upward(mods, {"pkg.low": 0, "pkg.high": 1}) == \
        ["pkg.low:1 imports pkg.high (layer 1 > 0)"]
