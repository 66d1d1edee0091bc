"""The import graph of a package, read from its source with ``ast`` (nothing is imported).

    python tools/import_graph.py                       # src/stepscope
    python tools/import_graph.py src/stepscope/analysis --edges

Prints, for the modules under the given folder (a package, or a part of one):

* ``cycles``: import loops among module-level imports, as strongly connected components.
  Importing ``a.b.c`` runs the ``__init__`` of ``a.b`` first, so that counts as an edge too.
* ``function-level``: imports inside a function or method, of the package's own modules
  (``own``: usually hiding a loop) and of other modules (``other``: lazy optional
  dependencies, e.g. pandas).
* ``upward``: module-level imports from a lower layer to a higher one, by ``LAYERS``.
* ``private``: underscore-prefixed names taken from another module (``from .x import _y``, or
  ``x._y`` through an imported module) and underscore-prefixed modules imported from outside
  the package that holds them.

Exit status 1 when there is a cycle, an upward import or a function-level import of the
package's own modules (``--check``), else 0. ``tests/test_import_graph.py`` runs it.
"""

from __future__ import annotations

import argparse
import ast
import sys
from dataclasses import dataclass, field
from pathlib import Path

# Layers, lowest first: a module may import from its own layer (no cycle) and the ones below.
# Keys are module names or prefixes (the longest matching prefix decides); modules matching
# no key are not judged. docs/internals.md draws them.
LAYERS: dict[str, int] = {
    # leaves: clocks, schema strings, launcher ranks, extension loading, bounded inflation and
    # the compression it bounds
    "stepscope._ext": 0,
    "stepscope._clock": 0,
    "stepscope._schema": 0,
    "stepscope.ranks": 0,
    "stepscope._inflate": 0,
    "stepscope._deflate": 0,
    # the trace format: field numbers and wire encoding
    "stepscope.format": 10,
    # analysis (reads traces; knows the format and the leaves, nothing of the writer): shared
    # leaves, the image writer, the trace-processor clone, the summaries, the engines, the CLI,
    # the facade
    "stepscope.analysis._errors": 11,
    "stepscope.analysis._arrays": 11,
    "stepscope.analysis._threads": 11,
    "stepscope.analysis.rundir": 11,
    "stepscope.analysis.sqlimage": 12,
    "stepscope.analysis.tp": 13,
    "stepscope.analysis.summaries": 14,
    "stepscope.analysis.merge": 14,
    "stepscope.analysis.engines": 15,
    "stepscope.analysis.cli": 16,
    "stepscope.analysis": 17,
    # the hot path, then the write pipeline, then the session facade and its parts
    "stepscope.record": 20,
    "stepscope.write": 30,
    "stepscope.core": 40,
    # producers: they register with the core through core.hooks; the core never imports them
    "stepscope.profiler": 50,
    "stepscope.gpu": 50,
    "stepscope.pytorch": 50,
    # the public API and the commands
    "stepscope._nvtx": 60,
    "stepscope._api": 60,
    "stepscope.profiler.boot": 70,
    "stepscope.profiler.runner": 70,
    "stepscope.profiler.cli_profiler": 70,
    "stepscope.cli": 70,
    "stepscope": 70,
}

# Function-level imports of the package's own modules that are allowed: loading a heavy part
# only when it is used (never to dodge a loop). (importer prefix, imported prefix) -> why.
LAZY_OK: dict[tuple[str, str], str] = {
    ("stepscope.profiler.profiler", "stepscope.analysis"):
        "the reader (SQLite image, summaries) loads only when a run's summary is asked for",
    ("stepscope.profiler.profiler", "stepscope.pytorch"):
        "the torch integration imports torch (seconds): only for programs that use torch",
    ("stepscope.pytorch", "stepscope.pytorch"):
        "the integration's parts import torch: loaded when it is attached",
    ("stepscope.pytorch.ranges", "stepscope"):
        "torch's record_function ranges go to the public API's start_range/end_range (above "
        "the producers), looked up when a range starts",
}


def lazy_ok(importer: str, target: str) -> bool:
    return any(_within(importer, a) and _within(target, b) for a, b in LAZY_OK)


@dataclass
class Module:
    name: str
    path: Path
    is_package: bool
    imports: list[tuple[str, int, bool]] = field(default_factory=list)  # (target, line, in_fn)
    private: list[tuple[str, int]] = field(default_factory=list)  # (what, line)


def package_root(folder: Path) -> tuple[Path, str]:
    """The top package folder holding ``folder`` and ``folder``'s dotted name."""
    folder = folder.resolve()
    parts = [folder.name]
    top = folder
    while (top.parent / "__init__.py").exists():
        top = top.parent
        parts.insert(0, top.name)
    return top, ".".join(parts)


def find_modules(folder: Path) -> dict[str, Module]:
    """Every module under ``folder`` by dotted name (a package by its own name)."""
    _, prefix = package_root(folder)
    out = {}
    for path in sorted(folder.resolve().rglob("*.py")):
        rel = path.relative_to(folder.resolve()).with_suffix("")
        parts = [prefix, *rel.parts]
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts.pop()
        name = ".".join(parts)
        out[name] = Module(name, path, is_pkg)
    return out


def _inside_function(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            return True
    return False


def _resolve(mod: Module, level: int, target: str | None) -> str:
    """The absolute name of a (possibly relative) ``from`` import's module."""
    if level == 0:
        return target or ""
    base = mod.name.split(".")
    if not mod.is_package:
        base = base[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join([*base, target] if target else base)


def read_imports(mod: Module, known: set[str], top_dir: Path) -> None:
    """Fill ``mod.imports`` and ``mod.private`` from its source."""
    tree = ast.parse(mod.path.read_text("utf-8"), str(mod.path))
    parents = {c: p for p in ast.walk(tree) for c in ast.iter_child_nodes(p)}
    aliases: dict[str, str] = {}  # local name -> the package's own module it is bound to
    for node in ast.walk(tree):
        in_fn = _inside_function(node, parents)
        if isinstance(node, ast.Import):
            for a in node.names:
                mod.imports.append((a.name, node.lineno, in_fn))
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(mod, node.level, node.module)
            for a in node.names:
                full = f"{base}.{a.name}"
                if full in known or _is_module_file(full, top_dir):
                    mod.imports.append((full, node.lineno, in_fn))
                    aliases[a.asname or a.name] = full
                    if a.name.startswith("_") and not _within(mod.name, base):
                        mod.private.append((f"module {full}", node.lineno))
                else:
                    mod.imports.append((base, node.lineno, in_fn))
                    if a.name.startswith("_") and not a.name.endswith("__"):  # not dunders
                        mod.private.append((f"{a.name} from {base}", node.lineno))
    for node in ast.walk(tree):  # ``module._name`` read or set through an imported module
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in aliases and node.attr.startswith("_")
                and not node.attr.endswith("__")):
            mod.private.append((f"{node.attr} of {aliases[node.value.id]}", node.lineno))


def _is_module_file(name: str, top_dir: Path) -> bool:
    """Whether ``name`` is a module or package of the package at ``top_dir``."""
    parts = name.split(".")
    if parts[0] != top_dir.name:
        return False
    path = top_dir.joinpath(*parts[1:])
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _within(importer: str, package: str) -> bool:
    """Whether ``importer`` is inside ``package`` (which may then use its private modules)."""
    return importer == package or importer.startswith(package + ".")


def _packages_run(target: str, importer: str, known: set[str]) -> list[str]:
    """``target`` and the package ``__init__``s importing it runs (not the importer's own)."""
    parts = target.split(".")
    out = []
    for i in range(1, len(parts) + 1):
        name = ".".join(parts[:i])
        if name in known and not _within(importer, name):
            out.append(name)
    return out


def graph(mods: dict[str, Module], function_level: bool = False) -> dict[str, set[str]]:
    """Module -> the modules among ``mods`` its imports run (module-level ones only unless
    ``function_level``)."""
    known = set(mods)
    g: dict[str, set[str]] = {n: set() for n in mods}
    for m in mods.values():
        for target, _, in_fn in m.imports:
            if in_fn and not function_level:
                continue
            g[m.name].update(t for t in _packages_run(target, m.name, known) if t != m.name)
    return g


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (or a module importing itself)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    sys.setrecursionlimit(max(10000, sys.getrecursionlimit()))

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(g[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in g[v]:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def layer_of(name: str, layers: dict[str, int] = LAYERS) -> int | None:
    best = None
    for key, n in layers.items():
        if _within(name, key) and (best is None or len(key) > len(best[0])):
            best = (key, n)
    return None if best is None else best[1]


def upward(mods: dict[str, Module], layers: dict[str, int] = LAYERS) -> list[str]:
    """Module-level imports of a module from a higher layer than its own."""
    out = []
    for m in mods.values():
        lo = layer_of(m.name, layers)
        for target, line, in_fn in m.imports:
            hi = layer_of(target, layers)
            if in_fn or lo is None or hi is None or hi <= lo or _within(m.name, target):
                continue  # (a package's __init__ imports from its own modules)
            out.append(f"{m.name}:{line} imports {target} (layer {hi} > {lo})")
    return sorted(set(out))


def function_imports(mods: dict[str, Module], top: str) -> tuple[list[str], list[str]]:
    """(own, other): function-level imports of ``top``'s modules, and of anything else."""
    own, other = [], []
    for m in mods.values():
        for target, line, in_fn in m.imports:
            if in_fn and not lazy_ok(m.name, target):
                (own if _within(target, top) else other).append(f"{m.name}:{line} {target}")
    return sorted(set(own)), sorted(set(other))


def report(folder: Path, edges: bool = False) -> tuple[str, bool]:
    """The printed report and whether it is clean (no cycle, upward or own lazy import)."""
    top_dir, _ = package_root(folder)
    top = top_dir.name
    mods = find_modules(folder)
    for m in mods.values():
        read_imports(m, set(mods), top_dir)
    g = graph(mods)
    loops = cycles(g)
    hidden = [c for c in cycles(graph(mods, function_level=True)) if c not in loops]
    up = upward(mods)
    own, other = function_imports(mods, top)
    private = sorted({f"{m.name}:{line} {what}" for m in mods.values() for what, line in m.private})
    lines = [f"modules: {len(mods)}, imports among them: {sum(map(len, g.values()))}"]
    if edges:
        lines.append("graph:")
        lines += [f"  {n} -> {', '.join(sorted(g[n])) or '-'}" for n in sorted(g)]
    lines.append("cycles: " + ("none" if not loops else ""))
    lines += ["  " + " <-> ".join(c) for c in loops]
    lines.append("cycles through function-level imports: " + ("none" if not hidden else ""))
    lines += ["  " + " <-> ".join(c) for c in hidden]
    lines.append("function-level imports, own: " + ("none" if not own else ""))
    lines += ["  " + s for s in own]
    lines.append("function-level imports, other (lazy optional dependencies): "
                 + ("none" if not other else ""))
    lines += ["  " + s for s in other]
    lines.append("upward imports: " + ("none" if not up else ""))
    lines += ["  " + s for s in up]
    lines.append("private names imported from another module: " + ("none" if not private else ""))
    lines += ["  " + s for s in private]
    return "\n".join(lines) + "\n", not (loops or hidden or up or own)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("folder", nargs="?", default=str(Path(__file__).parent.parent / "src"
                                                     / "stepscope"))
    ap.add_argument("--edges", action="store_true", help="print every module's imports too")
    ap.add_argument("--check", action="store_true",
                    help="exit 1 on a cycle, an upward or an own function-level import")
    a = ap.parse_args(argv)
    text, clean = report(Path(a.folder), a.edges)
    sys.stdout.write(text)
    return 1 if a.check and not clean else 0


if __name__ == "__main__":
    sys.exit(main())
