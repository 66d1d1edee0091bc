"""Run a Python program under the profiler: ``python -m stepscope.profiler.boot script.py args``.

``stepscope run -- python train.py`` rewrites its command to this; under a launcher use it
directly, e.g. ``torchrun --nproc-per-node 8 -m stepscope.profiler.boot train.py``. Options come
from ``STEPSCOPE_OPTIONS``. Steps come from ``stepscope.step()`` calls in the program, or, with the
``step_range`` option, from a named range: the profiler starts at the first begin of a range of that
name (``stepscope.annotate``/``push_range``, ``nvtx.annotate``/``push_range``, or torch's
``record_function``) on any thread,
and every later begin starts the next step. Without ``step_range``, step 0 opens at the program's
first batch wait (``stepscope.dataloader``), phase or ``stepscope.step()`` (which ends a step 0
whose start was not seen: the numbers go on from 1), never at interpreter start: start-up and
imports are no step. A run without steps says so, with the flag to use; a ``step_range`` that
names no range says so. The profiler is stopped (files closed, report printed) however the
program ends; its exit status is kept. After the last ``stepscope.step()`` the program's tail is
no step (unless it has a phase, or the program failed in it). A program that cannot be run (a
missing script or module, a syntax error) ends as under Python (its message and exit status)
before anything is started or written.
"""

from __future__ import annotations

import importlib.util
import os
import runpy
import sys
import threading
import traceback
from typing import Any

import stepscope  # the public API, which the step-range wrappers replace

from .. import pytorch as _pytorch  # (light: torch loads only once the program imports it)
from . import options as _options
from .profiler import NO_STEPS_HINT, Profiler

USAGE = "usage: python -m stepscope.profiler.boot (SCRIPT | -m MODULE | -c CODE) [ARGS...]"


class _StepHook:
    """Turns begins of the range named ``name`` into profiler steps."""

    def __init__(self, prof: Profiler, name: str) -> None:
        self.prof = prof
        self.name = name
        self.lock = threading.Lock()
        self.started = False

    def hit(self, message: Any) -> None:
        if message != self.name:
            return
        with self.lock:
            if not self.started:
                self.started = True
                self.prof.start()
            else:
                self.prof.step()

    def wrap_annotate(self, original: Any) -> Any:
        hook = self

        class _Proxy:
            """Delegates to the real range; its enter (or decorated call) counts a step."""

            def __init__(self, rng: Any, message: Any) -> None:
                self._rng, self._message = rng, message

            def __enter__(self) -> Any:
                hook.hit(self._message)
                return self._rng.__enter__()

            def __exit__(self, *exc: Any) -> Any:
                return self._rng.__exit__(*exc)

            def __call__(self, func: Any) -> Any:
                inner = self._rng(func)
                message = self._message

                def wrapper(*a: Any, **k: Any) -> Any:
                    hook.hit(message)
                    return inner(*a, **k)

                return wrapper

        def annotate(message: Any = None, *args: Any, **kwargs: Any) -> Any:
            if callable(message) and not args and not kwargs:  # bare @annotate
                return original(message)
            rng = original(message, *args, **kwargs)
            return _Proxy(rng, message) if message == hook.name else rng

        return annotate

    def wrap_push(self, original: Any) -> Any:
        def push_range(message: Any = None, *args: Any, **kwargs: Any) -> Any:
            self.hit(message)
            return original(message, *args, **kwargs)

        return push_range

    def wrap_record_function(self) -> None:
        """torch's ``record_function`` (``torch.profiler.record_function``, what a torch program
        annotates with): its class's ``__enter__``, wrapped. The profiler's range capture,
        installed as it starts, wraps this one in turn, so the range that started it is not
        recorded (its ``with`` holds torch's own ``__exit__`` already: its end would be lost),
        the ranges inside it and every later one are."""
        import torch.autograd.profiler as ap

        rf = ap.record_function
        original = rf.__dict__.get("__enter__")
        if original is None:
            return
        hit = self.hit

        def __enter__(obj: Any) -> Any:
            hit(obj.name)
            return original(obj)

        __enter__.__wrapped__ = original  # type: ignore[attr-defined]
        rf.__enter__ = __enter__

    def install(self) -> None:
        stepscope.annotate = self.wrap_annotate(stepscope.annotate)
        stepscope.push_range = self.wrap_push(stepscope.push_range)
        try:
            _pytorch.on_import(self.wrap_record_function)
        except Exception as exc:  # (the program runs on; its record_function ranges uncounted)
            print(f"stepscope: --step-range cannot watch torch's record_function ({exc!r})",
                  file=sys.stderr)
        try:
            import nvtx
        except Exception:
            return
        nvtx.annotate = self.wrap_annotate(nvtx.annotate)
        nvtx.push_range = self.wrap_push(nvtx.push_range)


class _ProgramError(Exception):
    """The program cannot be run: Python's own message and exit status for it."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


class _NoModule(ImportError):
    """What runpy raises for ``-m`` with no such module (its message is Python's)."""


def _prepare(argv: list[str]) -> Any:
    """Check, before anything is started or written, that the program can be run, as Python
    does before running it (the same message and exit status when it cannot: a missing script,
    module or __main__, a syntax error); returns a function that runs it."""
    exe = sys.executable or "python"
    if argv[0] in ("-m", "-c") and len(argv) < 2:
        raise _ProgramError(USAGE, 2)
    if argv[0] == "-m":
        name = argv[1]
        try:
            get = getattr(runpy, "_get_module_details", None)
            if get is not None:
                get(name, _NoModule)
            elif importlib.util.find_spec(name) is None:
                raise ImportError(f"No module named {name}")
        except ImportError as exc:  # (also one raised by a parent package's import)
            raise _ProgramError(f"{exe}: {exc}", 1) from None
        except Exception:  # a package that fails to import: it fails again in the run, with
            pass  # its traceback

        def run() -> None:
            sys.argv = [argv[1], *argv[2:]]
            runpy.run_module(name, run_name="__main__", alter_sys=True)

        return run
    if argv[0] == "-c":
        try:
            code = compile(argv[1], "<string>", "exec")
        except (SyntaxError, ValueError) as exc:
            raise _ProgramError("".join(traceback.format_exception_only(exc)).rstrip(), 1) from None

        def run() -> None:
            sys.argv = ["-c", *argv[2:]]
            exec(code, {"__name__": "__main__"})

        return run
    path = argv[0]
    full = os.path.abspath(path)
    if os.path.isdir(path):
        if not any(os.path.exists(os.path.join(path, f"__main__.{x}")) for x in ("py", "pyc")):
            raise _ProgramError(f"{exe}: can't find '__main__' module in {full!r}", 1)
    else:
        try:
            with open(path, "rb") as f:
                source = f.read()
        except OSError as exc:
            raise _ProgramError(f"{exe}: can't open file {full!r}: [Errno {exc.errno}] "
                                f"{exc.strerror}", 2) from None
        if path.endswith(".py"):
            try:
                compile(source, full, "exec")
            except (SyntaxError, ValueError) as exc:
                raise _ProgramError(
                    "".join(traceback.format_exception_only(exc)).rstrip(), 1) from None

    def run() -> None:
        sys.argv = list(argv)
        sys.path.insert(0, _script_dir(path))
        runpy.run_path(full, run_name="__main__")

    return run


def _program_traceback(tb: Any) -> Any:
    """The traceback from the program's first frame on (Python's, without the boot's and
    runpy's frames)."""
    mine = globals()
    while tb is not None and (tb.tb_frame.f_globals is mine
                              or tb.tb_frame.f_globals.get("__name__") == "runpy"):
        tb = tb.tb_next
    return tb


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        print(USAGE, file=sys.stderr)
        return 2
    try:
        opts = _options.from_env()
    except ValueError as exc:
        print(f"stepscope: {exc}", file=sys.stderr)
        return 2
    try:
        program = _prepare(argv)
    except _ProgramError as exc:  # nothing started, nothing written
        print(exc, file=sys.stderr)
        return exc.code
    # no step_range: steps from optimizer steps until the program calls stepscope.step()
    try:  # (a bad STEPSCOPE_RUN_ID: one line, as a bad STEPSCOPE_OPTIONS above)
        prof = Profiler(step_on=None if opts.get("step_range") else "auto")
    except ValueError as exc:
        print(f"stepscope: {exc}", file=sys.stderr)
        return 2
    prof._adopts_nested = True  # noqa: SLF001  (the program's own Profiler records into it)
    hook = None
    if opts.get("step_range"):
        hook = _StepHook(prof, opts["step_range"])
        hook.install()
    else:
        # step 0 opens at the first batch wait (prof.dataloader), phase or step() call, not
        # here: the interpreter's and the program's start-up (imports) is no step. Automatic
        # step boundaries for unchanged programs (e.g. a framework's optimizer-step hooks) are
        # installed here, once the profiler runs.
        prof.start(open_step=False)
    code = 0
    failed: BaseException | None = None
    try:
        program()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
    except BaseException as exc:
        code = 130 if isinstance(exc, KeyboardInterrupt) else 1  # 130: as a shell reports ^C
        failed = exc.with_traceback(_program_traceback(exc.__traceback__))
    finally:
        if hook is None or hook.started:
            # a failed program's open step is the one that failed; with step_range the open
            # step is the last range's; otherwise it is only the program's tail
            prof._stop(keep_open_step=failed is not None or hook is not None)  # noqa: SLF001
            if prof.timer.steps == 0 and not prof.options["report"]:
                print(NO_STEPS_HINT, file=sys.stderr)  # (the report says it otherwise)
        else:
            print(f"stepscope: no range named {hook.name!r} began, so the profiler never "
                  "started: no step was recorded and nothing was written (--step-range must "
                  "name a stepscope.annotate/push_range, nvtx.annotate/push_range or torch "
                  "record_function message exactly)", file=sys.stderr)
    if failed is not None:  # as Python reports it, from the program's frames on; after the
        # profiler stopped (stepscope's own hook would stop the session first, ending the
        # failed step without its args)
        sys.excepthook(type(failed), failed, failed.__traceback__)
    return code


def _script_dir(script: str) -> str:
    return os.path.dirname(os.path.abspath(script))


if __name__ == "__main__":
    sys.exit(main())
