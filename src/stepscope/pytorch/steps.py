"""Steps and data-loader waits without code changes.

* **Data-loader waits**: ``torch.utils.data.DataLoader`` iteration
  (``_BaseDataLoaderIter.__next__``, which every loader iterator uses) records each wait for
  the next batch as the profiler's ``dataloader.next`` slice and adds it to the step timer's
  reader cost, as ``prof.dataloader(loader)`` does; the first batch's wait starts where the
  iterator was made (``_BaseDataLoaderIter.__init__``: ``iter(loader)`` starts the workers).
  Where the thread recorded something between ``iter()`` and that ``next()`` (the program's
  phase around ``next()``), the slice and the reader cost start at ``next()``: a thread's events
  are written in time order (an earlier begin shifted all that followed), and ``iter()`` then
  lies outside the program's phase and before the step it would open, so a reader cost from
  there exceeded its step (and the tables' reader cost, read from the slices). Iteration
  inside ``prof.dataloader`` is left to it (no double count).
* **Steps** with ``step_on="optimizer"``: torch's global optimizer step post-hook
  (``torch.optim.optimizer.register_optimizer_step_post_hook``) ends the step at every
  ``optimizer.step()``, where it cuts no range of the thread: at the next batch wait, or
  before the next range the program begins with none open (its phase "Dataloader" around the
  wait, say; torch's zero_grad and optimizer step ranges excepted: a batch's optimizer steps,
  a GAN's two, make one step); in a loop without a DataLoader, after the end of torch's
  ``Optimizer.step#`` range, or of the program's outermost range around it (its phase
  "Optimization", say; several optimizer steps inside one such range end one step). There,
  optimizers stepped one after another with no forward between (torch's autograd sequence
  number unchanged: Muon's beside AdamW's) make one step too; one with a forward between (a
  GAN's) ends a step each. A range that spans the loop (a record_function around
  it) never ends between optimizer steps: "outermost" counts from the loop's level, the fewest
  ranges the thread had open since the last boundary (the C range count's low-water mark), so
  such a range is not waited for (the steps have a track of their own: neither is cut). A
  range begun in the step may span the loop too (the one that opened step 0, an epoch's range
  begun after the last boundary of the epoch before): whether it does is known only later. So
  where ranges of the program above it are open at the optimizer step, the time their last
  one ends is kept, and the boundary is made after the outermost ends, or, should the next
  module forward come first (it spans), back at the time kept (``Profiler._step_back``: what
  the thread began since, its next Forward phase, lies in the next step; at the forward where
  a detail window starts there, as the window's work lies between the steps).
  A step opened at a boundary that gets no work but torch's ``Optimizer.zero_grad#`` range
  (the loop's tail after its last optimizer step) is no step. Step 0 starts at the first
  batch wait or module forward, not at ``Profiler.start()``
  (under ``stepscope run`` that is interpreter start): the profiler leaves it pending
  (``start(open_step=False)``). The waits use the profiler's own wait recording
  (``Profiler._wait_begin``/``_wait_end``/``_wait_exhausted``, as ``prof.dataloader``): a step
  exists once it holds work, so an exhausted loader leaves no empty step; it also ends the epoch:
  the next epoch's first wait opens the step as batch 0 of a new epoch, or makes the step it
  finds open (a range around the epoch opened it) that batch (so the schedule's windows repeat
  per epoch). A step opened at a boundary and quiet since, with no forward with grad since the
  last optimizer step, is no step at ``stop()`` (an exception right after an optimizer step).
  Passes: see ``_new_pass`` (evaluation passes, between the steps) and ``_inner_pass`` (a
  loop inside the step); with persistent workers, iter() resets the loader's one iterator
  (``_reset``), which starts a pass as a new iterator does.
* ``step_on="auto"`` (what ``stepscope run`` uses): as "optimizer", until the program calls
  ``step()`` itself; from then on only its calls make steps. A first call that comes right after
  an optimizer step (no batch wait between) marks that same boundary and is not counted again.
"""

from __future__ import annotations

import sys
import threading
import time
import weakref
from functools import partial
from typing import Any

from ..record import recorder as rec
from .ranges import OPTIMIZER_STEP_PREFIX

# A pass's first wait starts at iter(), whose worker start-up is its reader cost, where next()
# follows it within this time (a for loop's; other loaders' iter() between, zip's, not
# counted); later, the program worked in between (an iterator made during set-up, the loop
# seconds later): the wait starts at next()
ITER_GAP_NS = 1_000_000


def _no_seq() -> None:
    """A torch without the autograd sequence number: no forward is ever seen."""
    return None


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
        self.boundary_pending = False  # an optimizer step happened; the step ends at a safe point
        # (t, base): the boundary waits for the end of the range at base, and should that range
        # span the loop, it was at t (see _on_optimizer_step)
        self._late: tuple[int, int] | None = None
        self.loader_seen = False
        # evaluation passes (see _new_pass): the loaders learnt as evaluation loaders, the
        # optimizer steps so far, and the evaluation pass under way (a weak reference to its
        # iterator; None: none)
        self._eval_loaders: weakref.WeakSet = weakref.WeakSet()
        self._opt_steps = 0
        self._eval_it: Any = None
        self._grad_enabled: Any = None
        # without a DataLoader: (optimizer, autograd sequence number, step number) at the last
        # optimizer step, and the optimizers (by id) another's step follows with no forward
        # between
        self._last_opt: tuple[Any, Any, Any] | None = None
        self._followed: dict[int, Any] = {}
        self._seq: Any = _no_seq  # torch's autograd sequence number of the calling thread
        # the autograd sequence number at the last optimizer step or the end of a pass between
        # the steps: a forward with grad since says the step in progress has training work
        self._seq_mark: Any = None
        self._epoch_ended = False
        self._iter_ns = 0  # time in DataLoader iterators' making, on the profiler's thread
        # the training pass under way whose waits make the boundaries: (weak reference to its
        # loader, optimizer steps before it), until its end (see _before_pass)
        self._outer: tuple[Any, int] | None = None
        self._opener: Any = None  # the iterator whose wait opened step 0 (see _watch_opener)
        self._replay = False  # the last pass ended, no batch wait since: batches replayed?
        # with a DataLoader: the latest begin of a program's range (none open) since the
        # optimizer step, and the loop's level then (see _before_range)
        self._range_at: int | None = None
        self._range_base = 0
        self.ranges: Any = None  # the RangeCapture (torch's ranges nest in the steps)
        # the boundary after an optimizer step: the class's step() (under step_on="auto" the
        # instance's is the program's), bound once; with the C buffer a C method, so the range
        # end that makes it (at_top) calls it without a Python frame
        self._boundary = type(prof).step.__get__(prof, type(prof))

    # -- life cycle ---------------------------------------------------------------------------
    def start(self) -> None:
        rec.reset_depth()  # (ranges still open from an earlier profiler are no concern of ours)
        self._patch_loader()
        if self.mode in ("optimizer", "auto"):
            from torch.optim.optimizer import register_optimizer_step_post_hook

            self._handles.append(register_optimizer_step_post_hook(self._on_optimizer_step))
            self._patch_scaler()
            from . import on_import

            watch = on_import(self._patch_compiled, "torch._dynamo.eval_frame")
            if watch is not None:  # (removed as the hooks are)
                self._handles.append(watch)
            try:  # the calling thread's autograd sequence number: a forward with grad adds to it
                from torch._C._autograd import _get_sequence_nr as seq
            except ImportError:  # (a torch without it: every optimizer step ends its step)
                seq = _no_seq
            self._seq = seq
            self._seq_mark = seq()
            import torch

            self._grad_enabled = torch.is_grad_enabled
            if self.mode == "auto":
                self.prof.step = self._user_step  # instance attribute: stepscope.step() too
                if getattr(self.prof, "_program_steps", False):
                    self.yield_to_program()
                    return
            if self.prof._pending:  # noqa: SLF001
                self._watch_forward()

    def stop(self) -> None:
        prof = self.prof
        if self.flush_boundary() or (  # the step it opens holds nothing (the program leaves),
                # nor does one opened at a boundary, quiet since, without a forward with grad
                # since the last optimizer step: no step, even where stop() keeps an open step
                # as the one that failed (an exception)
                self.mode in ("optimizer", "auto") and not self._user_steps
                and prof._in_step and not prof._active  # noqa: SLF001
                and self._seq_mark is not None and self._seq() == self._seq_mark):
            prof._abandon_step()  # noqa: SLF001
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._last_opt = None
        self._followed.clear()
        self._drop_forward_hook()
        for owner, name, original in reversed(self._patched):
            setattr(owner, name, original)
        self._patched.clear()
        if self.prof.__dict__.get("step") == self._user_step:
            del self.prof.step

    # -- steps --------------------------------------------------------------------------------
    def _new_epoch(self) -> None:
        """The loader ran out: the step that opens next is batch 0 of a new epoch, pending
        still, or opened since (a record_function around each epoch opened it as it began: the
        epoch counter stood still before)."""
        self._epoch_ended = False
        if not self.prof._stopped:  # noqa: SLF001
            self.prof.epoch()

    def _resume(self) -> None:
        """A module forward: a boundary still held back for the program's ranges around an
        optimizer step is made (they span the loop's iterations: nothing nests in them): back
        where the ranges above the outermost ended, once they have (a time kept), else here;
        a pending step opens here (it has work)."""
        late, self._late = self._late, None
        if rec.at_top(None) is not None:
            if late is not None:  # the range at its base spans the loop: the step ended at t
                rec.before_top(None)
                try:
                    self.prof._step_back(late[0])  # noqa: SLF001
                    self.prof._activity()  # noqa: SLF001  (the next step has work since t)
                except Exception as exc:
                    print(rec.BOUNDARY_FAILED.format(exc), file=sys.stderr)
            else:
                self.boundary_pending = True
                self.flush_boundary()
        prof = self.prof
        if self._epoch_ended:
            self._new_epoch()
        if prof._pending and not prof._stopped:  # noqa: SLF001
            prof._activity()  # noqa: SLF001
            rec.mark_low()  # step 0 opens: the next boundary's base is read from here
        self._drop_forward_hook()

    def _watch_forward(self) -> None:
        if self._fwd_handle is not None:
            return
        from torch.nn.modules.module import register_module_forward_pre_hook

        def first_forward(module: Any, args: Any) -> None:
            if threading.get_ident() != self.prof._thread:  # noqa: SLF001
                return
            if self.boundary_pending and self.loader_seen and self._replay:  # no batch
                # wait since the last pass ended: batches replayed (itertools.cycle, a list
                # made of the loader's) end the step at the next forward with grad (one
                # without, a metric of the iteration's, is its own; 20 iterations made 9
                # steps; a GAN's second forward within a batch ends nothing)
                if not self._grad_enabled():
                    return
                self.flush_boundary()
            self._resume()

        self._fwd_handle = register_module_forward_pre_hook(first_forward)

    def _patch_compiled(self) -> None:
        """``torch.compile(module)``'s wrapper warns at each call site while any global module
        hook is registered (a UserWarning the program would take for its own), and calls such
        hooks twice (for the wrapper, then for the module in it): our forward watch would
        make that warning. While it is the only global hook, a compiled module's call on the
        profiler's thread calls it itself, as torch would, and hides it for the call: no
        warning, one call, and dynamo traces the module without it. The program's own global
        hooks leave everything as torch does it."""
        if self.prof._stopped:  # noqa: SLF001
            return
        try:
            from torch._dynamo.eval_frame import OptimizedModule
            from torch.nn.modules import module as nn_module
        except ImportError:
            return
        original = OptimizedModule.__dict__.get("__call__")
        hooks = getattr(nn_module, "_global_forward_pre_hooks", None)
        any_hook = getattr(nn_module, "_has_any_global_hook", None)
        if original is None or hooks is None or any_hook is None:
            return
        driver = self

        def __call__(mod: Any, *args: Any, **kwargs: Any) -> Any:
            h = driver._fwd_handle
            if h is None or threading.get_ident() != driver.prof._thread:  # noqa: SLF001
                return original(mod, *args, **kwargs)
            fn = hooks.pop(h.id, None)
            if fn is None:
                return original(mod, *args, **kwargs)
            if any_hook():  # the program's: torch's warning is the program's
                hooks[h.id] = fn
                return original(mod, *args, **kwargs)
            try:
                fn(mod, args)
                return original(mod, *args, **kwargs)
            finally:
                if driver._fwd_handle is h:  # (still watching: this forward was not it)
                    hooks[h.id] = fn

        __call__.__wrapped__ = original  # type: ignore[attr-defined]
        self._patched.append((OptimizedModule, "__call__", original))
        OptimizedModule.__call__ = __call__

    def _drop_forward_hook(self) -> None:
        h, self._fwd_handle = self._fwd_handle, None
        if h is not None:
            h.remove()

    def _on_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._user_steps or threading.get_ident() != self.prof._thread:  # noqa: SLF001
            return
        self._opt_steps += 1
        if self._eval_it is not None:
            self._trains_after_all()
        self._auto_stepped = True
        seq = self._seq_mark = self._seq()
        # the loop's level: the fewest ranges open since the last boundary (those that span
        # the loop, a record_function around it, stay open: the boundary waits for none)
        base = rec.summary_low()
        late, self._late = self._late, None
        if late is not None:  # an earlier optimizer step of this step kept a time: its base
            base = min(base, late[1])  # holds (the time was kept at base + 1, the low since)
        if self.loader_seen:
            self.boundary_pending = True  # made at the next batch wait (back where a range
            self._range_at = None  # of the program around it began: "Dataloader")
            self._range_base = base
            rec.before_top(self._before_range, base)
            if self._replay:  # or at the next forward with grad (see first_forward)
                self._watch_forward()
            return
        # several optimizers stepped one after another (Muon's beside AdamW's: no forward
        # between, torch's autograd sequence number unchanged) make one step (see _join_last);
        # one optimizer stepped again without a forward (gradients set by hand) a step each
        last, self._last_opt = self._last_opt, (optimizer, seq, self.prof._step)  # noqa: SLF001
        if last is not None and seq == last[1] and seq is not None and last[0] is not optimizer:
            if last[2] != self.prof._step:  # noqa: SLF001  (a boundary came between)
                self._join_last(last[0])
                return
        elif self._followed and last is not None:  # a forward came after it: it ends its
            self._followed.pop(id(last[0]), None)  # step again
        if id(optimizer) in self._followed:
            return  # (the optimizer step after it ends the step)
        depth = rec.summary_depth()  # torch's Optimizer.step# range, and the program's around
        if depth > base + 1:  # the program's ranges around it: made after the end of the
            # outermost begun in the step, or, should the next module forward come first (that
            # range spans the loop), back where the ranges above it ended (a time kept then)
            rec.at_top(partial(self._keep_time, base), base + 1)
            self._watch_forward()
        elif depth > base:  # made after the end of torch's range (a C call; it replaces an
            rec.at_top(self._boundary, base)  # earlier optimizer step's boundary)
        else:
            self.boundary_pending = True
            self.flush_boundary()

    def _patch_scaler(self) -> None:
        """Mixed precision's ``GradScaler.step`` skips the optimizer step where gradients
        overflowed (its first iterations, while the scale settles; an overflow now and then):
        no optimizer hook fires, yet the iteration is over, and its step ends as if the
        optimizer had stepped (two iterations made one step; at an epoch's end, one step
        held the exhausted wait and the next epoch's first iteration)."""
        try:
            from torch.amp.grad_scaler import GradScaler
        except ImportError:  # (torch < 2.3: torch.cuda.amp's only)
            return
        original = GradScaler.__dict__.get("step")
        if original is None:
            return
        driver = self

        def step(scaler: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
            before = driver._opt_steps
            out = original(scaler, optimizer, *args, **kwargs)
            if driver._opt_steps == before and not driver.prof._stopped:  # noqa: SLF001
                driver._on_optimizer_step(optimizer, args, kwargs)
            return out

        step.__wrapped__ = original  # type: ignore[attr-defined]
        self._patched.append((GradScaler, "step", original))
        GradScaler.step = step

    def _join_last(self, last: Any) -> None:
        """Without a DataLoader, an optimizer step right after another's (no forward between)
        is of the same step. The first time, the step the boundary after ``last`` opened
        holds this optimizer step alone: it is no step (the next forward opens one), and
        ``last`` is learnt as followed: its step ends no step from then on, until a forward
        comes after it."""
        self._followed[id(last)] = last
        self.prof._abandon_step()  # noqa: SLF001
        self._watch_forward()

    def _keep_time(self, base: int) -> None:
        """The ranges above ``base`` ended after an optimizer step: the step ends here if the
        range at ``base`` spans the loop (a module forward comes before its end: ``_resume``),
        else as it ends."""
        self._late = (time.perf_counter_ns(), base)
        rec.at_top(self._late_boundary, base)

    def _late_boundary(self) -> None:
        """The range at the kept base ended: it was the step's, and the step ends with it."""
        self._late = None
        self._boundary()

    def _before_range(self, code: int) -> bool:
        """A range of the program begins, none open, after an optimizer step and before the
        next batch wait: its begin is kept; should the wait come inside it (a "Dataloader"
        range around next()), the step ended as it began (``_wait_boundary``). A range that
        ends before the wait (a checkpoint's, a log's) is the iteration's: it was made the
        next step's (and at an epoch's end, no step's). torch's zero_grad and another
        optimizer's step (a GAN's two, Muon's beside AdamW) are the batch's step's whatever
        comes. False: called again at the next such begin, until the boundary is made."""
        kind = rec.kinds[code >> 3] if 0 <= code >> 3 < len(rec.kinds) else None
        name = kind.name if kind is not None else None
        if type(name) is str and name.startswith(OPTIMIZER_STEP_PREFIX):
            return False
        if kind is not None and self.ranges is not None and self.ranges.idle(name):
            return False
        self._range_at = time.perf_counter_ns()
        return False

    def _wait_boundary(self) -> None:
        """A batch wait of a counted pass starts: the boundary an optimizer step asked for is
        made here, or back where the program's range around this wait began."""
        t, self._range_at = self._range_at, None
        if t is not None and self.boundary_pending and rec.summary_depth() > self._range_base:
            rec.before_top(None)
            self.boundary_pending = False
            try:
                self.prof._step_back(t)  # noqa: SLF001
            except Exception as exc:
                print(rec.BOUNDARY_FAILED.format(exc), file=sys.stderr)
            rec.mark_low()
            return
        self.flush_boundary()

    def flush_boundary(self) -> bool:
        """Make the step boundary an optimizer step asked for, if it is still to be made (at a
        safe point: a batch wait, stop(), the program's first step() under "auto"); True if
        made."""
        rec.before_top(None)
        self._late = self._range_at = None
        if rec.at_top(None) is not None:  # (its ranges have not ended: made here instead)
            self.boundary_pending = True
        made = self.boundary_pending
        if made:
            self.boundary_pending = False
            try:
                self._boundary()
            except Exception as exc:
                made = False
                print(rec.BOUNDARY_FAILED.format(exc), file=sys.stderr)
        rec.mark_low()  # (a boundary, or a batch wait: the loop's level, or a range above it)
        return made

    def _watch_opener(self, it: Any) -> None:
        """Step 0 opens at a wait of ``it``; should ``it`` go before any optimizer step
        (``x, y = next(iter(loader))`` to size the model: the iterator is freed as the line
        ends), that step is no step: the training loop's first wait opens it. (It held the
        model's building and all the set-up up to the first iteration's end: 3.7 s for a
        3.6 ms iteration in the audit.)"""
        try:
            self._opener = weakref.ref(it, self._opener_gone)
        except TypeError:
            self._opener = None

    def _opener_gone(self, ref: Any) -> None:
        prof = self.prof
        if (ref is self._opener and not self._opt_steps and prof._in_step  # noqa: SLF001
                and not prof._stopped and threading.get_ident() == prof._thread):  # noqa: SLF001
            self._opener = None
            try:
                prof._abandon_step()  # noqa: SLF001
            except Exception as exc:
                print(rec.BOUNDARY_FAILED.format(exc), file=sys.stderr)

    def boundary_between(self) -> None:
        """The boundary an optimizer step asked for, made between two passes (a loop left by
        a break): the step it opens waits for the next batch wait (or phase, or forward), as
        after a pass's end. (It opened at once: the first step of the next epoch held the
        workers' shutdown and all that came before its first wait, 33 ms more in the audit.)"""
        prof = self.prof
        if self.flush_boundary() and prof._in_step and not prof._active:  # noqa: SLF001
            prof._abandon_step()  # noqa: SLF001

    def yield_to_program(self) -> None:
        """``step_on="auto"``: the program makes its own steps (its first ``step()`` call, or
        a Profiler of its own that asked for no ``step_on``, joined to ``stepscope run``'s:
        from the start, so that no optimizer step ends a step before its first call)."""
        if self.mode != "auto" or self._user_steps:
            return
        self.flush_boundary()
        self._user_steps = True
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _user_step(self, num_samples: float | None = None, epoch: int | None = None) -> None:
        """``step_on="auto"``: the program makes its own steps from its first call on."""
        prof = self.prof
        if not self._user_steps:
            self.yield_to_program()
            if self._auto_stepped:  # this call marks the boundary the optimizer just made
                return
        type(prof).step(prof, num_samples, epoch)

    # -- evaluation passes --------------------------------------------------------------------
    def _new_pass(self, it: Any, loader: Any) -> None:
        """``iter(loader)`` on the profiler's thread. A pass made with gradients off (under
        ``torch.no_grad()`` or ``inference_mode()``: a validation loop), or of a loader whose
        earlier pass ended without an optimizer step, evaluates: its waits open no step and
        make no boundary, and its end ends no epoch, so its time lies between the steps (a
        validation pass was a step of its own at the run's end, with an epoch that never was,
        and each epoch's first step held the validation before it). Learnt from a pass's
        end, an evaluation loader made with gradients on is a step the first time."""
        if not self._grad_enabled() or (loader is not None and loader in self._eval_loaders):
            it._stepscope_eval = True
        else:  # (weakly: with persistent workers the loader holds its iterator, and a cycle
            # would leave the workers to be killed at exit, not shut down: their files empty)
            try:
                ref = weakref.ref(loader)
            except TypeError:
                return
            it._stepscope_pass = (ref, self._opt_steps)

    def _before_pass(self, loader: Any) -> None:
        """``iter()`` of a loader that trains, after the last pass ended the epoch: the new
        epoch starts here, before the iterator is made, so that the schedule's window work at
        an epoch's start lies before the first wait, which starts at ``iter()`` (the workers'
        start-up is its reader cost: made inside that wait, the work moved the wait's start
        past it, and that cost, tens of ms, was lost). Any pass: a boundary still to be made
        is made here."""
        if self.mode not in ("optimizer", "auto") or self._user_steps:
            return
        if self.boundary_pending:  # (a loop left by a break: the step ends before the next
            self.boundary_between()  # pass's iterator is made, an evaluation's workers too)
        outer = self._outer
        if outer is not None and outer[0]() is loader and self._opt_steps > outer[1]:
            # the loader's last pass trained and was left by a break (steps per epoch capped,
            # islice): the pass made now is the next epoch's, as after its end (all the run's
            # steps were epoch 0, and the schedule's windows never repeated)
            self._outer = None
            self._epoch_ended = True
        if self._epoch_ended and self._grad_enabled():
            try:
                if loader is not None and loader in self._eval_loaders:
                    return
            except TypeError:  # (not weakly referenceable: never learnt as one)
                pass
            self._new_epoch()

    def _pass_ended(self, it: Any) -> None:
        """A counted pass found its loader exhausted: the epoch ends (the next wait opens the
        step as batch 0 of a new one). A pass without an optimizer step evaluated: the step
        its first wait opened (or the boundary before it) holds that pass alone, and is no
        step (where a file has its begin already, it ends here: a step of its own, not the
        first of the next epoch's); its loader's next passes are evaluation passes."""
        if it.__dict__.get("_stepscope_inner"):
            return  # (a loop inside the step: its end ends nothing)
        self._outer = None
        self._replay = True
        seq = self._seq()
        trained = self._seq_mark is None or seq is None or seq != self._seq_mark
        self._seq_mark = seq
        ref, opt_steps = it.__dict__.get("_stepscope_pass", (None, -1))
        loader = ref() if ref is not None else None
        prof = self.prof
        if opt_steps == self._opt_steps and loader is not None:  # (no epoch of training)
            self._eval_loaders.add(loader)
            if prof._in_step and not prof._stopped:  # noqa: SLF001
                prof._abandon_step()  # noqa: SLF001
        else:
            self._epoch_ended = True
            if (not trained and prof._in_step and not prof._stopped  # noqa: SLF001
                    and not self.boundary_pending):
                # the step open since the last optimizer step holds batches and no forward
                # with grad: zip(a, b) took a batch of a before b ran out, dropped as the pass
                # ends (it made a phantom step at the run's end, and the first step of the
                # next epoch held it)
                prof._abandon_step()  # noqa: SLF001
        self._watch_forward()

    def _inner_pass(self) -> bool:
        """A pass's first wait comes inside a step that has training work (a forward with grad
        since the last optimizer step or the end of the last pass between the steps) and no
        boundary is to be made: a loop inside the step (a regularizer's, a teacher's batches),
        whose waits are the step's, whose end ends nothing, and which is never learnt as an
        evaluation pass (the training step it ran in was dropped as one)."""
        if self._seq_mark is None or self.boundary_pending or self._late is not None:
            return False
        return self._seq() != self._seq_mark

    def _begin_evaluation(self, it: Any) -> None:
        """An evaluation pass's first wait: a boundary an optimizer step asked for is made
        here, and a step that has had no work since (opened at that boundary) is no step: the
        next counted wait, phase or forward opens one. Its forwards open no step."""
        self._eval_it = weakref.ref(it)
        self.flush_boundary()
        prof = self.prof
        if prof._in_step and not prof._active and not prof._stopped:  # noqa: SLF001
            prof._abandon_step()  # noqa: SLF001
        self._drop_forward_hook()

    def _end_evaluation(self) -> None:
        self._eval_it = None
        self._seq_mark = self._seq()
        if self.prof._pending and self.mode in ("optimizer", "auto"):  # noqa: SLF001
            self._watch_forward()

    def _trains_after_all(self) -> None:
        """An optimizer step inside an evaluation pass: the rest of the pass counts, no
        loader is known as an evaluation loader any more (to be learnt again), and a step
        opens here (the work since its last wait is in none)."""
        it = self._eval_it()
        if it is not None:
            it.__dict__.pop("_stepscope_eval", None)
        self._eval_loaders.clear()
        self._end_evaluation()
        if self._epoch_ended:  # (the pass is the next epoch's: its step is that epoch's first)
            self._new_epoch()
        if self.prof._pending:  # noqa: SLF001
            self.prof._activity()  # noqa: SLF001

    # -- data-loader waits --------------------------------------------------------------------
    def _patch_loader(self) -> None:
        from torch.utils.data import dataloader as dl

        base = dl._BaseDataLoaderIter  # noqa: SLF001
        original = base.__dict__["__next__"]
        driver = self
        prof = self.prof
        skip_code = type(prof)._iterate.__code__  # prof.dataloader's iteration records itself
        wait_begin, wait_end = prof._wait_begin, prof._wait_end  # noqa: SLF001
        wait_exhausted = prof._wait_exhausted  # noqa: SLF001
        clock = time.perf_counter_ns
        thread_last_ts = rec.thread_last_ts
        main = prof._thread  # noqa: SLF001
        cancel = self.mode in ("optimizer", "auto")

        def __next__(self: Any) -> Any:
            ident = threading.get_ident()
            on_main = ident == main
            if prof._stopped or sys._getframe(1).f_code is skip_code:  # noqa: SLF001
                if not on_main or driver.ranges is None:
                    return original(self)
                driver.ranges.waiting = True  # (prof.dataloader's wait: see ranges.py)
                try:
                    return original(self)
                finally:
                    driver.ranges.waiting = False
            counts = on_main  # (the wait is the step's: it opens a pending one, reader cost)
            if on_main:
                d = self.__dict__
                if "_stepscope_made" in d and cancel and driver._inner_pass():  # (first wait)
                    d.pop("_stepscope_eval", None)
                    d["_stepscope_inner"] = True
                if "_stepscope_eval" in d:  # an evaluation pass: in no step
                    if driver._eval_it is None:
                        driver._begin_evaluation(self)
                    counts = False
                else:
                    if driver._eval_it is not None:
                        driver._end_evaluation()
                    if "_stepscope_inner" not in d:  # (a loop inside the step: no boundary
                        driver.loader_seen = True  # waits for its waits)
                        driver._replay = False
                        if "_stepscope_made" in d and (driver.boundary_pending
                                                       or prof._pending):  # noqa: SLF001
                            # (the first wait of a pass whose waits start the steps; not
                            # another loader's taken in the step, next(iter(aux)))
                            driver._outer = d.get("_stepscope_pass")
                    driver._wait_boundary()
                    driver._auto_stepped = False
                    if driver._epoch_ended:
                        driver._new_epoch()
            # the first batch's wait starts where the iterator was made: creating it starts
            # the worker processes (reader cost, as prof.dataloader counts it)
            made = self.__dict__.pop("_stepscope_made", None) if on_main else None
            t0 = clock()
            if made is not None and made[0] >= thread_last_ts() and made[0] >= prof._own_end:  # noqa: SLF001
                # (else the thread recorded since iter(): the program's phase around next();
                # the profiler's window work as the epoch changed here, on the steps'
                # sequence: the slice and its step start here, as a sequence's events are in
                # time order (an earlier begin shifted all that followed it, every later step
                # too), and so does the reader cost: iter() is in no wait, maybe in no step)
                if t0 - made[1] - (driver._iter_ns - made[2]) <= ITER_GAP_NS:
                    t0 = made[0]  # (else the program worked between iter() and next(), e.g.
                    # an iterator made during set-up: that work is no reader cost, no step's)
            if counts and not driver._opt_steps and prof._pending:  # noqa: SLF001
                driver._watch_opener(self)  # (step 0's: a peek, next(iter(loader))?)
            placed = wait_begin(t0, ident, counts)  # a pending step opens here (main thread)
            if on_main and driver.ranges is not None:
                driver.ranges.waiting = True
            try:
                batch = original(self)
            except StopIteration:  # the step just opened had no work: it is no step
                wait_exhausted(placed, t0, clock(), ident, counts)
                if counts and cancel and not driver._user_steps:
                    driver._pass_ended(self)
                elif not counts and on_main:
                    driver._end_evaluation()
                raise
            except BaseException:
                wait_end(placed, t0, clock(), ident, counts, counts is not on_main)
                raise
            finally:
                if on_main and driver.ranges is not None:
                    driver.ranges.waiting = False
            t1 = clock()
            if counts:
                prof.timer.add_reader(t1 - t0)
                wait_end(placed, t0, t1, ident, True)
            else:  # (another thread's wait, or, on the profiler's, an evaluation pass's)
                wait_end(placed, t0, t1, ident, False, on_main)
            return batch

        __next__.__wrapped__ = original  # type: ignore[attr-defined]
        self._patched.append((base, "__next__", original))
        base.__next__ = __next__

        original_init = base.__dict__["__init__"]

        def start_pass(it: Any, loader: Any, made: int) -> None:
            """A pass begins (iter() made at ``made``), on the profiler's thread: its first
            wait starts there, and what it is (evaluation, training) is looked at."""
            d = it.__dict__
            for key in ("_stepscope_eval", "_stepscope_inner", "_stepscope_pass"):
                d.pop(key, None)  # (an iterator reset for another pass: the last one's)
            ready = clock()
            d["_stepscope_made"] = (made, ready, driver._iter_ns)
            if cancel and not driver._user_steps:
                driver._new_pass(it, loader)

        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            on_main = threading.get_ident() == main and not prof._stopped  # noqa: SLF001
            loader = args[0] if args else kwargs.get("loader")
            if on_main:
                driver._before_pass(loader)
            made = clock()
            original_init(self, *args, **kwargs)
            if on_main:
                start_pass(self, loader, made)

        __init__.__wrapped__ = original_init  # type: ignore[attr-defined]
        self._patched.append((base, "__init__", original_init))
        base.__init__ = __init__

        mp = dl._MultiProcessingDataLoaderIter  # noqa: SLF001
        original_shutdown = mp.__dict__["_shutdown_workers"]

        def _shutdown_workers(self: Any) -> None:
            """A pass left by a break (max_steps) shuts its workers down as its iterator goes
            (tens of ms): between the steps, as at a pass's end (the last step held it, and
            what came after, up to the next batch wait)."""
            if (driver.boundary_pending and threading.get_ident() == main
                    and not prof._stopped):  # noqa: SLF001
                driver.boundary_between()
            return original_shutdown(self)

        _shutdown_workers.__wrapped__ = original_shutdown  # type: ignore[attr-defined]
        self._patched.append((mp, "_shutdown_workers", original_shutdown))
        mp._shutdown_workers = _shutdown_workers

        original_reset = base.__dict__["_reset"]

        def _reset(self: Any, *args: Any, **kwargs: Any) -> None:
            """A pass of a loader with persistent workers: iter() resets its one iterator (the
            first pass is made by __init__): a new pass as __init__ starts one."""
            first = kwargs.get("first_iter", args[1] if len(args) > 1 else False)
            if first or not args or threading.get_ident() != main or prof._stopped:  # noqa: SLF001
                return original_reset(self, *args, **kwargs)
            driver._before_pass(args[0])
            made = clock()
            original_reset(self, *args, **kwargs)
            start_pass(self, args[0], made)
            return None

        _reset.__wrapped__ = original_reset  # type: ignore[attr-defined]
        self._patched.append((base, "_reset", original_reset))
        base._reset = _reset

        original_iter = dl.DataLoader.__dict__["__iter__"]

        def __iter__(self: Any) -> Any:
            """iter(loader): the iterator is ready when this returns (the multiprocessing
            iterator's __init__ and _reset start and resume the workers after the base's);
            the time is noted for the first wait (see ITER_GAP_NS)."""
            if threading.get_ident() != main or prof._stopped:  # noqa: SLF001
                return original_iter(self)
            t = clock()
            try:
                it = original_iter(self)
            finally:
                driver._iter_ns += clock() - t
            d = getattr(it, "__dict__", None)
            made = d.get("_stepscope_made") if d is not None else None
            if made is not None:
                d["_stepscope_made"] = (made[0], clock(), driver._iter_ns)
            return it

        __iter__.__wrapped__ = original_iter  # type: ignore[attr-defined]
        self._patched.append((dl.DataLoader, "__iter__", original_iter))
        dl.DataLoader.__iter__ = __iter__
