"""``stepscope build-torch``: compile the native module (the reader of torch's profiler events,
the collectives' completion stamps)."""

from __future__ import annotations

import argparse
import sys
from typing import Any


def add_parsers(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "build-torch",
        help="compile the native module (torch's profiler events, collectives' completions) "
        "for the installed torch",
        description="Compile stepscope's native module against the installed torch (a C++ "
        "compiler and torch's headers; about 20-60 s), into stepscope's cache directory "
        "(STEPSCOPE_CACHE_DIR, else ~/.cache/stepscope). Detail windows with operators then "
        "cost less than torch.profiler (without it they read torch's events through its "
        "Python API), and collectives are hooked in C++ (without it, Python hooks and a "
        "Python callback per op). Run it again after upgrading torch.",
    )
    p.add_argument("--verbose", action="store_true", help="print the compiler's command")
    p.set_defaults(func=_build)


def _build(args: argparse.Namespace) -> int:
    from . import native

    try:
        path = native.build(verbose=args.verbose)
    except RuntimeError as e:
        print(f"stepscope build-torch: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0
