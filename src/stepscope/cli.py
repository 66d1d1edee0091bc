"""The ``stepscope`` command: each area adds its own subcommands (``add_parsers``)."""

from __future__ import annotations

import argparse
import importlib
import sys
import warnings

from . import __version__
from ._inflate import TraceDamageWarning

# modules that define add_parsers(subparsers); each subcommand sets func=handler(args) -> int
_COMMAND_MODULES = (
    "stepscope.analysis.cli.summary",  # summary
    "stepscope.analysis.cli.sql",  # sql, export-csv
    "stepscope.profiler.cli_profiler",  # run, merge
    "stepscope.pytorch.cli",  # build-torch
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="stepscope",
        description="Perfetto-native tracing for ML training: summaries, SQL, merge, run.",
    )
    parser.add_argument("--version", action="version", version=f"stepscope {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _COMMAND_MODULES:
        importlib.import_module(name).add_parsers(sub)
    return parser


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """Skipped trace data is news for the user, not a code location: one stderr line."""
    if issubclass(category, TraceDamageWarning):
        print(f"stepscope: {message}", file=sys.stderr, flush=True)
    else:
        _default_showwarning(message, category, filename, lineno, file, line)


_default_showwarning = warnings.showwarning


def main(argv: list[str] | None = None) -> int:
    warnings.showwarning = _show_warning
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # positionals after an option (`sql run -q "SELECT ..."`): a command's list
        # of paths (set_defaults(trailing=...)) takes them; an unknown option stays an error
        trailing = getattr(args, "trailing", None)
        if trailing is None or any(a.startswith("-") and a != "-" for a in extra):
            parser.error("unrecognized arguments: " + " ".join(extra))
        getattr(args, trailing).extend(extra)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    try:
        return int(func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # e.g. piped into head
        return 0


if __name__ == "__main__":
    sys.exit(main())
