"""The decoder's C-or-numpy choice, made here once for every stage.

``native`` is the C module ``_decodeloops`` (see ``_decodeloops.pyi``) when it is built and
wanted, else None (``STEPSCOPE_PURE_PYTHON=1`` forces None, see ``stepscope._ext``). The stages
read it at each call and run their numpy twin when it is None, with the same results:

=========================  ==================================  =============================
C function                 used by                             numpy twin
=========================  ==================================  =============================
``split_repeated``         ``protoscan.split_repeated``        the same function
``groups``                 ``packets._body_groups``            the same function
``generations``            ``state.generations``               the same function
``last_owner``             ``state.lookup_last``               the same function
``packet_clocks``          ``state._packet_clocks``            the same function
``nest``                   ``decode._build_slices``            its numpy passes
=========================  ==================================  =============================

Tests set ``native`` to None to run the twins against the C loops.
"""

from __future__ import annotations

from types import ModuleType

from ... import _ext

native: ModuleType | None = _ext.load("stepscope.analysis.tp._decodeloops")
