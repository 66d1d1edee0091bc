"""Each C extension has a ``.pyi`` stub beside it naming exactly what the module exports:
the functions of its method table, its types and its constants."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src" / "stepscope"
MODULES = [("_fast", "module_methods"), ("analysis/tp/_decodeloops", "methods"),
           ("analysis/sqlimage/_sqlpages", "methods")]


def _exports(c_text: str, table: str) -> set[str]:
    """Names a C module exports: its method table's entries, added objects and constants."""
    body = c_text[c_text.index(f"static PyMethodDef {table}[]"):]
    body = body[: body.index("};")]
    names = set(re.findall(r'^\s*\{"(\w+)"', body, re.M))
    names |= set(re.findall(r'PyModule_Add(?:ObjectRef|IntConstant|Object)\(m, "(\w+)"', c_text))
    return names


def _stubbed(pyi: str) -> set[str]:
    out = set()
    for n in ast.parse(pyi).body:
        if isinstance(n, (ast.FunctionDef, ast.ClassDef)):
            out.add(n.name)
        elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
            out.add(n.target.id)
    return out


@pytest.mark.parametrize("module, table", MODULES)
def test_the_stub_names_what_the_c_module_exports(module, table):
    c_text = (SRC / f"{module}.c").read_text()
    assert _stubbed((SRC / f"{module}.pyi").read_text()) == _exports(c_text, table)
