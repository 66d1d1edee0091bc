"""The image writer's C-or-Python choice, made here once.

``native`` is the C module ``_sqlpages`` (see ``_sqlpages.pyi``: cell sizes and leaf pages in
one pass per B-tree) when it is built and wanted, else None (``STEPSCOPE_PURE_PYTHON=1`` forces
None, see ``stepscope._ext``). ``image`` reads it at each call and runs its numpy twin when it
is None; both write the same bytes. Tests set it to None to compare them.
"""

from __future__ import annotations

from types import ModuleType

from ... import _ext

native: ModuleType | None = _ext.load("stepscope.analysis.sqlimage._sqlpages")
