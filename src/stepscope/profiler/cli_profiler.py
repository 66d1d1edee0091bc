"""``stepscope run`` and ``stepscope merge``: subcommands the main CLI adds with
:func:`add_parsers`; each parser's ``func`` takes the parsed arguments and returns an exit code."""

from __future__ import annotations

import argparse
import re
import sys
from typing import Any

from ..analysis import merge as _merge
from . import options as _options
from . import runner as _runner
from .schedule import Schedule, coerce, from_range


def parse_schedule(text: str) -> Schedule | None:
    """``none``, ``START-END`` (Paddle range), ``k=v,...`` (skip_first, wait, warmup, active,
    repeat) or a JSON object/list."""
    text = text.strip()
    if text.lower() in ("none", "off"):
        return None
    m = re.fullmatch(r"(\d+)\s*[-:]\s*(\d+)", text)
    if m:
        return from_range(int(m.group(1)), int(m.group(2)))
    if text.startswith(("{", "[")):
        return _options.parse(f'{{"schedule": {text}}}')["schedule"]
    fields: dict[str, Any] = {}
    for part in text.split(","):
        k, sep, v = part.partition("=")
        if not sep or not re.fullmatch(r"-?\d+", v.strip()):
            raise ValueError(
                f"--schedule: {part!r} is not key=integer; use e.g. "
                "'skip_first=1,wait=1,warmup=1,active=2,repeat=1' or '3-6' or 'none'"
            )
        fields[k.strip()] = int(v)
    return coerce(fields)


def add_parsers(subparsers: Any) -> None:
    """Add ``run`` and ``merge`` to the main CLI's subparsers."""
    p = subparsers.add_parser(
        "run",
        help="run a Python program under the profiler",
        description="Run `python train.py ...` under the stepscope profiler, unchanged: "
        "stepscope run [options] -- python train.py args",
    )
    p.add_argument("--dir", help="output directory (default ./stepscope)")
    p.add_argument("--run-id", help="run directory name under --dir (default: from the launcher)")
    p.add_argument("--schedule", help="detail windows: 'skip_first=1,wait=1,warmup=1,active=2,"
                   "repeat=1', 'START-END' (record START <= batch < END), or 'none'")
    p.add_argument("--levels", help="files to write: summary, detail or summary,detail")
    p.add_argument("--timer-only", action="store_true", default=None,
                   help="only time steps and data-loader waits; no trace files")
    p.add_argument("--no-host-metrics", dest="host_metrics", action="store_false", default=None)
    p.add_argument("--sample-interval", dest="sample_interval_s", type=float,
                   help="host metric sampling interval in seconds (default 0.5)")
    p.add_argument("--step-range", help="name of a user range whose begins delimit steps")
    p.add_argument("--no-report", dest="report", action="store_false", default=None,
                   help="do not print the summary at the end")
    p.add_argument("command", nargs=argparse.REMAINDER,
                   help="-- python train.py args (the program to run)")
    p.set_defaults(func=cmd_run)

    m = subparsers.add_parser(
        "merge",
        help="merge per-rank traces into one timeline",
        description="Merge a run directory or rank trace files into one Perfetto trace with one "
        "process per rank and aligned clocks.",
    )
    m.add_argument("inputs", nargs="+", help="a run directory, or .pftrace files")
    m.add_argument("-o", "--output", required=True, help="merged .pftrace to write")
    m.add_argument("--ranks", help="ranks to keep, e.g. 0,2-5")
    m.add_argument("--level", choices=("summary", "detail"), default="summary",
                   help="which files of a run directory to merge (default summary)")
    m.set_defaults(func=cmd_merge, trailing="inputs")


def run_options(args: argparse.Namespace) -> dict[str, Any]:
    """The STEPSCOPE_OPTIONS that ``stepscope run``'s flags ask for (validated)."""
    opts: dict[str, Any] = {}
    if args.run_id is not None:
        _options.check_run_id("--run-id", args.run_id)
    for key in ("dir", "run_id", "timer_only", "host_metrics", "sample_interval_s",
                "step_range", "report"):
        value = getattr(args, key, None)
        if value is not None:
            opts[key] = value
    if args.levels:
        opts["levels"] = tuple(x.strip() for x in args.levels.split(","))
    if args.schedule is not None:
        opts["schedule"] = parse_schedule(args.schedule)
    _options.parse(_options.dumps(opts))
    return opts


def cmd_run(args: argparse.Namespace) -> int:
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    try:
        return _runner.run(command, run_options(args))
    except ValueError as exc:
        print(f"stepscope run: {exc}" if not str(exc).startswith("stepscope") else str(exc),
              file=sys.stderr)
        return 2


def cmd_merge(args: argparse.Namespace) -> int:
    try:
        result = _merge.merge(args.inputs, args.output, ranks=args.ranks, level=args.level)
    except (ValueError, OSError) as exc:
        print(f"stepscope merge: {exc}", file=sys.stderr)
        return 2
    print(result.format())
    return 0

