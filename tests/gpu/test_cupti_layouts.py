"""The raw decoder's record layouts against ``cupti_activity.h``, as measured by gcc, and, for the
struct versions newer than those headers, against cupti-python's numpy dtypes of each record.

``tests/data/cupti_layouts.json`` comes from ``tools/cupti_layouts.py`` (run it again with newer
CUDA headers or cupti-python); these tests only read it, so they run without CUDA. The
synthetic-buffer tests in ``test_cupti_buffers.py`` are built from the decoder's own constants
and cannot catch a wrong one.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stepscope.gpu import cupti_buffers as cb

DATA = json.loads((Path(__file__).parents[1] / "data" / "cupti_layouts.json").read_text())
LAYOUT_NAMES = ["RAW_KERNEL", "RAW_MEMCPY", "RAW_MEMSET", "RAW_API", "RAW_SYNC"]


def header_fields(layout_name: str, struct: str) -> dict[str, list | None]:
    """Decoder field -> [offset, size, "i"|"u"|"p"] in ``struct`` (None: not a member)."""
    members = DATA["layouts"][layout_name]["fields"]
    return {f: DATA["structs"][struct]["fields"][m] for f, m in members.items()}


def decoder_fields(layout_name: str) -> dict[str, list]:
    layout = getattr(cb, layout_name)
    out = {}
    for name in layout.names:
        ftype, off = layout.fields[name][:2]
        out[name] = [off, ftype.itemsize, ftype.kind]
    return out


def matches(layout_name: str, struct: str) -> bool:
    """Every field the decoder reads is in ``struct`` at the decoder's offset, width and sign."""
    want = header_fields(layout_name, struct)
    for name, (off, size, kind) in decoder_fields(layout_name).items():
        h = want[name]
        if h is None or h[:2] != [off, size] or kind != {"p": "u"}.get(h[2], h[2]):
            return False
    return True


def test_json_is_from_a_header():
    assert DATA["header"].endswith("cupti_activity.h") and DATA["cupti_api_version"] >= 130000
    assert set(DATA["layouts"]) == set(LAYOUT_NAMES)
    # the structs CUPTI 13.4 delivers, newer than the CUDA 13.0 headers, are covered
    assert DATA["newer_structs_from"] == "cupti-python 13.4.0"
    assert {"CUpti_ActivityKernel13", "CUpti_ActivityMemcpy7", "CUpti_ActivityMemset5"} <= {
        s for v in DATA["layouts"].values() for s in v["structs"]}  # fmt: skip


@pytest.mark.parametrize("layout_name", LAYOUT_NAMES)
def test_decoder_reads_only_mapped_fields(layout_name):
    assert set(getattr(cb, layout_name).names) == set(DATA["layouts"][layout_name]["fields"])


@pytest.mark.parametrize("layout_name", LAYOUT_NAMES)
def test_every_accepted_struct_version_has_the_decoders_layout(layout_name):
    """A record is decoded when its size is at least the layout's itemsize: every struct version
    that large must hold each field at the decoder's offset, width and signedness, and every
    version that does must be that large (or it would be dropped for nothing)."""
    layout = getattr(cb, layout_name)
    accepted = []
    for struct in DATA["layouts"][layout_name]["structs"]:
        size = DATA["structs"][struct]["sizeof"]
        if size >= layout.itemsize:
            accepted.append(struct)
            assert matches(layout_name, struct), (
                f"{layout_name} vs {struct}: decoder {decoder_fields(layout_name)}, "
                f"header {header_fields(layout_name, struct)}"
            )
        else:
            assert not matches(layout_name, struct), f"{struct} ({size} B) dropped for nothing"
    assert accepted, f"no struct version of {layout_name} is decoded"


@pytest.mark.parametrize("layout_name", LAYOUT_NAMES)
def test_record_size_is_the_prefix_or_the_smallest_version(layout_name):
    """itemsize: the end of the fields read, or the size of the smallest struct holding them."""
    layout = getattr(cb, layout_name)
    prefix = max(off + size for off, size, _ in decoder_fields(layout_name).values())
    versions = DATA["layouts"][layout_name]["structs"]
    smallest = min(DATA["structs"][s]["sizeof"] for s in versions if matches(layout_name, s))
    assert layout.itemsize in (prefix, smallest), (layout.itemsize, prefix, smallest)


def test_kind_values_and_the_structs_cupti_13_delivers():
    """CUpti_ActivityKind values; each kind's current struct (per the header's enum comments)
    is decoded, with a size CUPTI can step by (a multiple of 8, see RecordSizes.learn_size)."""
    for kind, value in DATA["kind_values"].items():
        assert getattr(cb, f"KIND_{kind}") == value, kind
    assert set(DATA["delivered"]) == set(DATA["kind_values"])
    names = {id(getattr(cb, n)): n for n in LAYOUT_NAMES}
    for kind, struct in DATA["delivered"].items():
        layout_name = names[id(cb._TABLES[DATA["kind_values"][kind]][1])]
        assert struct in DATA["layouts"][layout_name]["structs"], (kind, struct)
        size = DATA["structs"][struct]["sizeof"]
        assert size >= getattr(cb, layout_name).itemsize and size % 8 == 0, (kind, struct, size)
        assert matches(layout_name, struct), (kind, struct)
