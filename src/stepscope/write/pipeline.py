"""The write pipeline's two threads: recorded events → (writer thread: the session's flush
encodes them into each sink) → bytes → (I/O thread: compressed chunks written) → files.

* The **writer thread** wakes every 100 ms (down to 2 ms while events pour in), and every
  ``flush_interval_s`` (or when the buffer is a quarter full) runs the flush it was given, with
  short GIL turns meanwhile.
* The **I/O thread** writes what the sinks produced, so a slow disk never stalls encoding;
  ``pending`` (bytes queued for the disk) tells the flush when to drop instead.

``request_flush``/``wait`` and ``stop_writer``/``shutdown`` pass flush and shutdown down the
chain, as OpenTelemetry's span processor → exporter does with ``force_flush``/``shutdown``.
"""

from __future__ import annotations

import contextlib
import queue
import sys
import threading
import time
from collections.abc import Callable

from ..record import recorder as _recorder
from .sink import Sink

# bytes a recorded event holds (for the buffer cap): 3 int64 words in the C buffer; list slots
# and int objects in the pure-Python one
RAW_EVENT_BYTES = 24 if _recorder.fast is not None else 88
BLOB_BYTES = 400  # a Blob with a small args dict
_MIN_WAKE_S = 0.002
_FLUSH_SWITCH_S = 0.0002  # GIL switch interval while the writer flushes
_WAKE_S = 0.1  # a wake costs ~100 us of CPU on small VMs: 20 ms wakes were 0.5% of a core


def recorded_bytes() -> int:
    """Bytes the events recorded and not drained yet hold."""
    return _recorder.pending_words() // 3 * RAW_EVENT_BYTES + len(_recorder.blobs) * BLOB_BYTES


@contextlib.contextmanager
def short_gil_turns():
    """Shorten the GIL switch interval while the writer flushes.

    numpy releases the GIL inside most operations; with a program thread busy in Python, each
    release costs the writer a whole switch interval (5 ms) to get the GIL back, so a flush of a
    few dozen operations took 300 ms instead of 30 and the buffer overflowed. The program loses
    no more CPU than the flush needs; the value it had is restored after (unless it changed it
    meanwhile).
    """
    old = sys.getswitchinterval()
    sys.setswitchinterval(min(old, _FLUSH_SWITCH_S))
    short = sys.getswitchinterval()  # as stored (whole microseconds), for the comparison below
    global _switch_to_restore
    _switch_to_restore = (old, short)
    try:
        yield
    finally:
        restore_switch()


# (value before, value set) of a flush in progress that shortened the interval
_switch_to_restore: tuple[float, float] | None = None


def restore_switch() -> None:
    """The interval back as it was before the flush, unless the program changed it meanwhile.
    Also run in a child forked during a flush (no writer there to end it)."""
    global _switch_to_restore
    if _switch_to_restore is not None:
        old, short = _switch_to_restore
        _switch_to_restore = None
        if sys.getswitchinterval() == short:
            sys.setswitchinterval(old)


class WritePipeline:
    """The writer and I/O threads of one session. ``flush()`` (run under ``lock``) drains and
    encodes; ``error(message)`` reports a background failure."""

    def __init__(self, flush: Callable[[], None], lock: threading.RLock,
                 flush_interval_s: float, buffer_bytes: int, error: Callable[[str], None]):
        self._flush = flush
        self._lock = lock
        self.flush_interval_s = flush_interval_s
        self.buffer_bytes = buffer_bytes
        self._error = error
        self._io: queue.Queue = queue.Queue()
        self._io_pending = 0  # bytes queued for the disk
        self._io_cv = threading.Condition()
        self._flush_requested = threading.Event()
        self._stopping = threading.Event()
        self._writer: threading.Thread | None = None
        self._io_thread: threading.Thread | None = None
        self.last_flush = 0.0

    @property
    def pending(self) -> int:
        """Bytes queued for the disk, not written yet."""
        return self._io_pending

    def start(self) -> None:
        self.last_flush = time.monotonic()
        self._io_thread = threading.Thread(target=self._io_loop, name="stepscope-io",
                                           daemon=True)
        self._writer = threading.Thread(target=self._writer_loop, name="stepscope-writer",
                                        daemon=True)
        self._io_thread.start()
        self._writer.start()

    def request_flush(self) -> None:
        """Have the writer flush at its next wake (now)."""
        self._flush_requested.set()

    def stopping(self) -> bool:
        return self._stopping.is_set()

    def begin_stop(self) -> None:
        """The writer flushes no more from its next wake on (the session's stop flushes)."""
        self._stopping.set()

    def stop_writer(self, timeout: float = 30) -> None:
        """Wake the writer and wait for it to end; the I/O thread goes on (the sinks' closing
        writes still pass through it)."""
        self._flush_requested.set()
        if self._writer is not None and self._writer is not threading.current_thread():
            self._writer.join(timeout=timeout)

    def shutdown(self, timeout: float = 30) -> None:
        """Write everything queued, then end the I/O thread."""
        self._io.put((None, None))
        if self._io_thread is not None and self._io_thread is not threading.current_thread():
            self._io_thread.join(timeout=timeout)

    def _writer_loop(self) -> None:
        # a shorter flush interval wakes more often (never busily)
        top = max(_MIN_WAKE_S, min(_WAKE_S, self.flush_interval_s))
        wait = top
        while not self._stopping.is_set():
            self._flush_requested.wait(wait)
            if self._stopping.is_set():
                break
            raw = recorded_bytes()
            # wake often while events pour in (a burst reaches the early-flush mark between two
            # 100 ms wakes, and then the cap: drops), rarely while the program is quiet
            wait = (max(_MIN_WAKE_S, wait / 2) if raw >= self.buffer_bytes // 16
                    else min(top, wait * 2))
            due = (self._flush_requested.is_set()
                   or time.monotonic() - self.last_flush >= self.flush_interval_s
                   or raw >= self.buffer_bytes // 4)  # early: drops only for a real backlog
            self._flush_requested.clear()
            if due:
                try:
                    with self._lock, short_gil_turns():
                        self._flush()
                except Exception as exc:  # never let the writer die silently
                    self._error(f"flush failed: {exc!r}")

    # -- the I/O thread -----------------------------------------------------------------------
    def enqueue(self, sink: Sink, data: bytes) -> None:
        with self._io_cv:
            self._io_pending += len(data)
        self._io.put((sink, data))

    def send(self, sink: Sink) -> None:
        for data in sink.take():
            self.enqueue(sink, data)

    def _io_loop(self) -> None:
        while True:
            sink, data = self._io.get()
            if sink is None:
                break
            size = len(data)
            try:
                sink.write_chunk(data)  # a failed write is cut back and counted there
            except Exception as exc:
                self._error(f"writing {sink.path} failed: {exc!r}")
            finally:
                with self._io_cv:
                    self._io_pending -= size
                    self._io_cv.notify_all()

    def wait(self, timeout: float | None = None) -> None:
        """Wait until everything queued so far is on disk (or the timeout passes)."""
        if self._io_thread is None or not self._io_thread.is_alive():
            self._drain_io_inline()
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._io_cv:
            while self._io_pending > 0 or not self._io.empty():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return
                self._io_cv.wait(0.05 if left is None else min(left, 0.05))

    def _drain_io_inline(self) -> None:
        """Write what is queued in this thread (no I/O thread: not started, or exiting)."""
        while True:
            try:
                sink, data = self._io.get_nowait()
            except queue.Empty:
                return
            if sink is None:
                continue
            self._io_pending -= len(data)
            try:
                sink.write_chunk(data)
            except OSError as exc:
                self._error(f"writing {sink.path} failed: {exc!r}")
