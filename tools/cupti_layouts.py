"""Measure CUPTI activity record layouts from ``cupti_activity.h`` with a C compiler.

Why: ``stepscope.gpu.cupti_buffers`` decodes raw CUPTI buffers with hard-coded byte offsets
(``RAW_KERNEL`` … ``RAW_SYNC``), and its synthetic-buffer tests are built from those same
constants, so nothing there can catch a wrong offset (garbage values or, for the kernel ``name``
pointer, a segfault). This script asks gcc, against the real headers, for ``sizeof`` of every
record struct version of the kinds the decoder reads and for ``offsetof``/``sizeof``/signedness
of each member it reads; versions newer than the headers come from cupti-python's numpy dtypes
when cupti-python is importable (run it with that Python). It writes
``tests/data/cupti_layouts.json``;
``tests/gpu/test_cupti_layouts.py`` checks the decoder against that file (no CUDA needed there).

    python tools/cupti_layouts.py [--include-dir /usr/local/cuda-13.0/include] [--out PATH]
    # with the struct versions of CUPTI 13.4 too:
    python -m venv /tmp/c && /tmp/c/bin/pip install cupti-python==13.4.0 numpy
    /tmp/c/bin/python tools/cupti_layouts.py
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# decoder layout -> (struct versions of its kinds, decoder field -> C member). Every version in
# the header is listed (names past the newest are skipped), old ones too: those must be too small
# for the decoder's size check.
KERNEL = ["CUpti_ActivityKernel"] + [f"CUpti_ActivityKernel{i}" for i in range(2, 16)]
LAYOUTS: dict[str, tuple[list[str], dict[str, str]]] = {
    "RAW_KERNEL": (KERNEL, {
        "kind": "kind", "registers": "registersPerThread", "start": "start", "end": "end",
        "device": "deviceId", "context": "contextId", "stream": "streamId", "grid_x": "gridX",
        "grid_y": "gridY", "grid_z": "gridZ", "block_x": "blockX", "block_y": "blockY",
        "block_z": "blockZ", "static_smem": "staticSharedMemory",
        "dynamic_smem": "dynamicSharedMemory", "correlation": "correlationId", "name": "name",
        "graph_node_id": "graphNodeId", "graph_id": "graphId"}),
    "RAW_MEMCPY": (["CUpti_ActivityMemcpy"] + [f"CUpti_ActivityMemcpy{i}" for i in range(3, 10)], {
        "kind": "kind", "copy_kind": "copyKind", "src_kind": "srcKind", "dst_kind": "dstKind",
        "bytes": "bytes", "start": "start", "end": "end", "device": "deviceId",
        "context": "contextId", "stream": "streamId", "correlation": "correlationId",
        "graph_node_id": "graphNodeId", "graph_id": "graphId"}),
    "RAW_MEMSET": (["CUpti_ActivityMemset"] + [f"CUpti_ActivityMemset{i}" for i in range(2, 8)], {
        "kind": "kind", "value": "value", "bytes": "bytes", "start": "start", "end": "end",
        "device": "deviceId", "context": "contextId", "stream": "streamId",
        "correlation": "correlationId", "graph_node_id": "graphNodeId", "graph_id": "graphId"}),
    "RAW_API": (["CUpti_ActivityAPI"], {
        "kind": "kind", "cbid": "cbid", "start": "start", "end": "end", "process": "processId",
        "thread": "threadId", "correlation": "correlationId"}),
    "RAW_SYNC": (["CUpti_ActivitySynchronization"]
                 + [f"CUpti_ActivitySynchronization{i}" for i in range(2, 5)], {
        "kind": "kind", "type": "type", "start": "start", "end": "end",
        "correlation": "correlationId", "context": "contextId", "stream": "streamId",
        "event": "cudaEventId"}),
}  # fmt: skip
# the kinds the decoder reads: their enum values, and the struct the header says CUPTI delivers
KINDS = ["MEMCPY", "MEMSET", "KERNEL", "DRIVER", "RUNTIME", "CONCURRENT_KERNEL", "SYNCHRONIZATION"]

PRELUDE = r"""#include <stdio.h>
#include <stddef.h>
#include <stdint.h>
#include <cupti_activity.h>
#define SIGN(x) _Generic((x), signed char: "i", short: "i", int: "i", long: "i", long long: "i", \
    unsigned char: "u", unsigned short: "u", unsigned int: "u", unsigned long: "u", \
    unsigned long long: "u", default: "p")
#define F(S, m) printf("F %s %s %zu %zu %s\n", #S, #m, offsetof(S, m), sizeof(((S *)0)->m), \
    SIGN(((S *)0)->m))
int main(void) {
"""


def probe(include_dir: Path) -> tuple[dict, dict]:
    """({struct: {"sizeof": n, "fields": {member: [offset, size, "i"|"u"|"p"] or None}}},
    {kind: CUPTI_ACTIVITY_KIND_ value}).

    One C program for everything; a line naming a struct or member this header lacks is
    dropped (gcc's error gives its line) and the program compiled again."""
    text = "".join(p.read_text() for p in include_dir.glob("cupti_activity*.h"))
    lines = {f'printf("K {k} %d\\n", (int)CUPTI_ACTIVITY_KIND_{k});': (k, None) for k in KINDS}
    structs = {}
    for versions, fields in LAYOUTS.values():
        for s in (s for s in versions if re.search(rf"}}\s*{s}\s*;", text)):
            structs[s] = {"sizeof": None, "fields": dict.fromkeys(fields.values())}
            lines[f'printf("S {s} %zu\\n", sizeof({s}));'] = (s, None)
            lines.update({f"F({s}, {m});": (s, m) for m in fields.values()})
    code = list(lines)
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp, "probe.c"), Path(tmp, "probe")
        while True:
            src.write_text(PRELUDE + "\n".join(code) + "\nreturn 0; }\n")
            cc = subprocess.run(["gcc", "-std=c11", "-I", str(include_dir), "-o", str(exe),
                                 str(src)], capture_output=True, text=True)  # fmt: skip
            if not cc.returncode:
                break
            first = PRELUDE.count("\n") + 1  # errors point into F or at the line using it
            found = re.findall(r"probe\.c:(\d+):\d+: (?:error|note: in expansion)", cc.stderr)
            bad = {int(n) for n in found if int(n) >= first}
            if not bad:
                sys.exit(f"gcc failed:\n{cc.stderr}")
            code = [c for i, c in enumerate(code, first) if i not in bad]
        run = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout
    kinds = {}
    for tag, name, *rest in (row.split() for row in run.splitlines()):
        if tag == "K":
            kinds[name] = int(rest[0])
        elif tag == "S":
            structs[name]["sizeof"] = int(rest[0])
        else:
            structs[name]["fields"][rest[0]] = [int(rest[1]), int(rest[2]), rest[3]]
    return structs, kinds


def delivered(include_dir: Path) -> dict[str, str]:
    """Activity kind -> "The corresponding activity record structure is \\ref X" of the header."""
    text = (include_dir / "cupti_activity.h").read_text()
    out = {}
    for kind in KINDS:
        m = re.search(r"\\ref[\s*]+(CUpti_Activity\w+)\.?\s*\*/\s*CUPTI_ACTIVITY_KIND_"
                      rf"{kind}\s*=", text)  # fmt: skip
        if m:
            out[kind] = m.group(1)
    return out


def from_cupti_python(structs: dict) -> tuple[dict, str | None]:
    """Struct versions newer than the header, from the numpy dtypes cupti-python ships for
    every record (``activity_kernel13_dtype`` ...), where cupti-python is installed: CUPTI
    delivers its newest struct, which may postdate the headers here. A member keeps the
    signedness the header gives it in older versions (cupti-python types enums as signed)."""
    try:
        from importlib.metadata import version

        from cupti import cupti  # type: ignore[import-not-found]
    except Exception:
        return {}, None
    out = {}
    for versions, fields in LAYOUTS.values():
        known = [structs[v]["fields"] for v in versions if v in structs]
        for s in versions:
            if s in structs:
                continue
            snake = re.sub(r"(?<!^)(?=[A-Z])", "_", s.removeprefix("CUpti_")).lower()
            dt = getattr(cupti, snake + "_dtype", None)  # activity_kernel13_dtype
            if dt is None:
                continue
            got: dict[str, list | None] = {}
            for m in fields.values():
                f = dt.fields.get(re.sub(r"(?<!^)(?=[A-Z])", "_", m).lower())
                sign = next((k[m][2] for k in known if k.get(m)), None)
                got[m] = None if f is None else [f[1], f[0].itemsize, sign or f[0].kind]
            out[s] = {"sizeof": dt.itemsize, "fields": got}
    return out, f"cupti-python {version('cupti-python')}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--include-dir", type=Path, default=Path("/usr/local/cuda-13.0/include"))
    ap.add_argument("--out", type=Path, default=ROOT / "tests/data/cupti_layouts.json")
    a = ap.parse_args()
    version = re.search(r"#define\s+CUPTI_API_VERSION\s+(\d+)",
                        (a.include_dir / "cupti_version.h").read_text())  # fmt: skip
    structs, kinds = probe(a.include_dir)
    newer, source = from_cupti_python(structs)
    structs.update(newer)
    result = {
        "header": str(a.include_dir / "cupti_activity.h"),
        "cupti_api_version": int(version.group(1)) if version else None,
        "compiler": subprocess.run(
            ["gcc", "--version"], capture_output=True, text=True
        ).stdout.splitlines()[0],  # fmt: skip
        "kind_values": kinds,
        "delivered": delivered(a.include_dir),
        "newer_structs_from": source,  # versions past the header: cupti-python's dtypes
        "layouts": {  # only the versions the header or cupti-python has
            k: {"structs": [s for s in v[0] if s in structs], "fields": v[1]}
            for k, v in LAYOUTS.items()
        },
        "structs": structs,
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {a.out} ({len(result['structs'])} structs)")


if __name__ == "__main__":
    main()
