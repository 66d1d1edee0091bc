"""The tags the C recorder writes come from the format module: the generated header is current
and the built ``_fast`` carries the same values."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

from stepscope.format import wire as w
from stepscope.record import recorder as _recorder
from stepscope.write import encoder as _encoder

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("gen_wire_tags", ROOT / "tools" / "gen_wire_tags.py")
gen = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("gen_wire_tags", gen)
_spec.loader.exec_module(gen)


def test_the_c_tags_are_the_format_modules():
    # by hand: Trace.packet is field 1, length-delimited (2); TracePacket.timestamp field 8, varint
    assert w.C_TAGS["TRACE_PACKET"][0] == (1 << 3) | 2 == 0x0A
    assert w.C_TAGS["PACKET_TIMESTAMP"][0] == (8 << 3) | 0 == 0x40


def test_the_generated_header_is_current():
    assert gen.HEADER.read_text() == gen.render()


@pytest.mark.skipif(_recorder.fast is None, reason="the C extension is not built")
def test_the_built_extension_carries_the_header_tags():
    fast = _recorder.fast
    assert {n: getattr(fast, f"TAG_{n}") for n in w.C_TAGS} == \
        {n: tag for n, (tag, _) in w.C_TAGS.items()}
    # and writes them: one packet with a timestamp delta of 5 around a 2-byte template
    out = fast.assemble(np.array([5], dtype=np.int64), np.array([0], dtype=np.int64),
                        [b"\x58\x01"])
    assert out == bytes([0x0A, 4, 0x40, 5, 0x58, 0x01])
    assert out == _encoder.assemble_numpy(np.array([5], dtype=np.int64),
                                          np.array([0], dtype=np.int64), [b"\x58\x01"])
