"""Steps and data-loader waits without code changes.

* **Data-loader waits**: ``torch.utils.data.DataLoader`` iteration
  (``_BaseDataLoaderIter.__next__``, which every loader iterator uses) records each wait for
  the next batch as the profiler's ``dataloader.next`` slice and adds it to the step timer's
  reader cost, as ``prof.dataloader(loader)`` does. Iteration inside ``prof.dataloader`` is
  left to it (no double count).
* **Steps** with ``step_on="optimizer"``: torch's global optimizer step post-hook
  (``torch.optim.optimizer.register_optimizer_step_post_hook``) ends the step at every
  ``optimizer.step()`` (several optimizers: one step each). Step 0 starts at the first batch
  wait or module forward, not at ``Profiler.start()`` (under ``stepscope run`` that is interpreter
  start). An exhausted loader withdraws the step just opened, as ``prof.dataloader`` does, and
  ends the epoch: the next epoch's first wait opens the step again as batch 0 of a new epoch
  (so the schedule's windows repeat per epoch).
* ``step_on="auto"`` (what ``stepscope run`` uses): as "optimizer", until the program calls
  ``step()`` itself; from then on only its calls make steps. A first call that comes right after
  an optimizer step (no batch wait between) marks that same boundary and is not counted again.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any

from .. import _recorder as rec
from .. import _schema as S


class StepDriver:
    """Optimizer-step hooks and DataLoader wait recording for one profiler."""

    def __init__(self, prof: Any, step_on: str | None) -> None:
        self.prof = prof
        self.mode = step_on
        self._handles: list[Any] = []
        self._fwd_handle: Any = None
        self._patched: list[tuple[Any, str, Any]] = []
        self._auto_stepped = False  # the last boundary was ours, and no wait came since
        self._user_steps = False
        self._in_hook = False
        self.boundary_pending = False  # an optimizer step happened; the step ends at a safe point
        self.loader_seen = False
        self._epoch_ended = False
        self.ranges: Any = None  # the RangeCapture, whose Optimizer.step# exit makes boundaries

    # -- life cycle ---------------------------------------------------------------------------
    def start(self) -> None:
        self._patch_loader()
        if self.mode in ("optimizer", "auto"):
            from torch.optim.optimizer import register_optimizer_step_post_hook

            self._handles.append(register_optimizer_step_post_hook(self._on_optimizer_step))
            if self.mode == "auto":
                self.prof.step = self._user_step  # instance attribute: stepscope.step() too
            self._defer_step()

    def stop(self) -> None:
        self.flush_boundary()
        if self.ranges is not None:
            self.ranges.after_optimizer = None
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._drop_forward_hook()
        for owner, name, original in reversed(self._patched):
            setattr(owner, name, original)
        self._patched.clear()
        if self.prof.__dict__.get("step") == self._user_step:
            del self.prof.step

    # -- steps --------------------------------------------------------------------------------
    def _defer_step(self) -> None:
        """Withdraw the open step; it opens again at the next batch wait or module forward."""
        prof = self.prof
        if prof._stopped or threading.get_ident() != prof._thread:  # noqa: SLF001
            return
        if not prof._pending:  # noqa: SLF001
            prof._cancel_step(None)  # noqa: SLF001
        self._watch_forward()

    def _resume(self) -> None:
        prof = self.prof
        if prof._pending and not prof._stopped:  # noqa: SLF001
            if self._epoch_ended:  # the loader ran out: the next epoch starts with this step
                self._epoch_ended = False
                prof.epoch()  # opens the step too
            else:
                prof._resume()  # noqa: SLF001
        self._drop_forward_hook()

    def _watch_forward(self) -> None:
        if self._fwd_handle is not None:
            return
        from torch.nn.modules.module import register_module_forward_pre_hook

        def first_forward(module: Any, args: Any) -> None:
            if threading.get_ident() == self.prof._thread:  # noqa: SLF001
                self._resume()

        self._fwd_handle = register_module_forward_pre_hook(first_forward)

    def _drop_forward_hook(self) -> None:
        h, self._fwd_handle = self._fwd_handle, None
        if h is not None:
            h.remove()

    def _on_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._user_steps or threading.get_ident() != self.prof._thread:  # noqa: SLF001
            return
        self._auto_stepped = True
        if self.loader_seen or (self.ranges is not None and self.ranges.installed):
            self.boundary_pending = True  # made at the next wait / the Optimizer.step# exit
            if self.ranges is not None and not self.loader_seen:
                self.ranges.after_optimizer = self.flush_boundary
        else:
            self._make_step()

    def flush_boundary(self) -> None:
        """Make the step boundary an optimizer step asked for (at a safe point)."""
        if self.boundary_pending:
            self.boundary_pending = False
            self._make_step()

    def _make_step(self) -> None:
        try:
            self._in_hook = True
            type(self.prof).step(self.prof)
        except Exception as exc:
            print(f"stepscope: optimizer step boundary failed: {exc!r}", file=sys.stderr)
        finally:
            self._in_hook = False

    def _user_step(self, num_samples: float | None = None, epoch: int | None = None) -> None:
        """``step_on="auto"``: the program makes its own steps from its first call on."""
        prof = self.prof
        if not self._user_steps:
            self.flush_boundary()
            self._user_steps = True
            for h in self._handles:
                h.remove()
            self._handles.clear()
            if self._auto_stepped:  # this call marks the boundary the optimizer just made
                return
        type(prof).step(prof, num_samples, epoch)

    # -- data-loader waits --------------------------------------------------------------------
    def _patch_loader(self) -> None:
        from torch.utils.data import dataloader as dl

        base = dl._BaseDataLoaderIter  # noqa: SLF001
        original = base.__dict__["__next__"]
        driver = self
        prof = self.prof
        skip_code = type(prof).dataloader.__code__
        wait_code = rec.code(rec.event_id(S.DATALOADER_WAIT_NAME, (S.CAT_DATALOADER,)),
                             S.LEVEL_SUMMARY, rec.BEGIN)
        record, end = rec.record, rec.end_summary
        clock = time.perf_counter_ns
        main = prof._thread  # noqa: SLF001
        cancel = self.mode in ("optimizer", "auto")

        def __next__(self: Any) -> Any:
            if prof._stopped or sys._getframe(1).f_code is skip_code:  # noqa: SLF001
                return original(self)
            on_main = threading.get_ident() == main
            if on_main:
                driver.loader_seen = True
                driver.flush_boundary()
                driver._auto_stepped = False
                if cancel and not driver._user_steps and _exhausted(self):
                    # the epoch ends here: withdraw the step just opened now, while its begin
                    # is surely unwritten (the workers' shutdown inside next() can take long)
                    if not prof._pending:  # noqa: SLF001
                        prof._cancel_step(None)  # noqa: SLF001
                        driver._epoch_ended = True
                        driver._watch_forward()
                    return original(self)
                if prof._pending:  # noqa: SLF001
                    driver._resume()
            recording = prof._recording and rec.ON  # noqa: SLF001
            ev = record(wait_code) if recording else None
            t0 = clock()
            try:
                batch = original(self)
            except StopIteration:
                if cancel and on_main and not driver._user_steps:
                    prof._cancel_step(ev)  # noqa: SLF001
                    driver._epoch_ended = True
                    driver._watch_forward()
                elif recording:
                    end()
                raise
            except BaseException:
                if recording:
                    end()
                raise
            if on_main:
                prof.timer.add_reader(clock() - t0)
            if recording:
                end()
            return batch

        def _exhausted(it: Any) -> bool:
            try:
                return it._num_yielded >= len(it)  # noqa: SLF001
            except Exception:  # an IterableDataset without __len__
                return False

        __next__.__wrapped__ = original  # type: ignore[attr-defined]
        self._patched.append((base, "__next__", original))
        base.__next__ = __next__
