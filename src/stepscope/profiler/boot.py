"""Run a Python program under the profiler: ``python -m stepscope.profiler.boot script.py args``.

``stepscope run -- python train.py`` rewrites its command to this; under a launcher use it
directly, e.g. ``torchrun --nproc-per-node 8 -m stepscope.profiler.boot train.py``. Options come
from ``STEPSCOPE_OPTIONS``. Steps come from ``stepscope.step()`` calls in the program, or, with the
``step_range`` option, from a named range: the profiler starts at the first begin of a range of that
name (``stepscope.annotate``/``push_range``, or ``nvtx.annotate``/``push_range``) on any thread,
and every later begin starts the next step. The profiler is stopped (files closed, report
printed) however the program ends; its exit status is kept. After the last ``stepscope.step()``
the program's tail is no step, so that open step is dropped, unless the program failed in it.
"""

from __future__ import annotations

import runpy
import sys
import threading
from typing import Any

from . import options as _options
from .profiler import Profiler

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

    def install(self) -> None:
        import stepscope

        stepscope.annotate = self.wrap_annotate(stepscope.annotate)
        stepscope.push_range = self.wrap_push(stepscope.push_range)
        try:
            import nvtx
        except Exception:
            return
        nvtx.annotate = self.wrap_annotate(nvtx.annotate)
        nvtx.push_range = self.wrap_push(nvtx.push_range)


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
    # no step_range: steps from optimizer steps until the program calls stepscope.step()
    prof = Profiler(step_on=None if opts.get("step_range") else "auto")
    hook = None
    if opts.get("step_range"):
        hook = _StepHook(prof, opts["step_range"])
        hook.install()
    else:
        prof.start()
    code = 0
    failed = False
    try:
        if argv[0] == "-m":
            if len(argv) < 2:
                print(USAGE, file=sys.stderr)
                return 2
            sys.argv = [argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        elif argv[0] == "-c":
            if len(argv) < 2:
                print(USAGE, file=sys.stderr)
                return 2
            sys.argv = ["-c", *argv[2:]]
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
        else:
            sys.argv = list(argv)
            sys.path.insert(0, _script_dir(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
        failed = True
    finally:
        if hook is None or hook.started:
            # a failed program's open step is the one that failed; with step_range the open
            # step is the last range's; otherwise it is only the program's tail
            prof._stop(keep_open_step=failed or hook is not None)  # noqa: SLF001
    return code


def _script_dir(script: str) -> str:
    import os

    return os.path.dirname(os.path.abspath(script))


if __name__ == "__main__":
    sys.exit(main())
