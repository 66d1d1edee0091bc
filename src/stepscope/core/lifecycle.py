"""Making sure a trace reaches the disk however the program ends.

* normal exit: ``atexit`` stops the session;
* SIGTERM / SIGINT / SIGHUP: flush, then hand over to whatever handler was there before (for
  the default SIGTERM or SIGHUP action: stop, restore the default and re-raise, so the exit
  status is right); SIGHUP (a closed terminal, an ssh session that dropped) is left alone where
  it is ignored (``nohup``);
* an unhandled exception: stop (main thread) or flush (other threads), then the previous hook;
* the flushes that finish the files at exit encode for at most ``EXIT_FLUSH_S`` (busy daemon
  threads compete for the GIL meanwhile); what is left is dropped and counted;
* SIGKILL cannot be caught: the writer flushes every ``flush_interval_s``, and every write ends
  on a packet boundary, so the file holds a loadable trace up to the last flush.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading

_SIGNALS = (signal.SIGTERM, signal.SIGINT, *((signal.SIGHUP,) if hasattr(signal, "SIGHUP")
                                              else ()))
_ENDING = {s for s in _SIGNALS if s != signal.SIGINT}  # whose default action ends the process
_state: dict = {}


def install(session) -> None:
    _state["session"] = session
    if not _state.get("atexit"):
        atexit.register(_at_exit)
        _state["atexit"] = True
    if "excepthook" not in _state:
        _state["excepthook"] = sys.excepthook
        sys.excepthook = _excepthook
        _state["thread_excepthook"] = threading.excepthook
        threading.excepthook = _thread_excepthook
    if threading.current_thread() is threading.main_thread() and "signals" not in _state:
        previous = {}
        for sig in _SIGNALS:
            try:
                old = signal.getsignal(sig)
                if old is None or old is _on_signal:  # set from C, or ours already
                    continue
                if old == signal.SIG_IGN and sig != signal.SIGTERM and sig != signal.SIGINT:
                    continue  # (nohup)
                signal.signal(sig, _on_signal)
                previous[sig] = old
            except (ValueError, OSError):
                continue
        _state["signals"] = previous


def uninstall(session) -> None:
    if _state.get("session") is not session:
        return
    _state["session"] = None
    if sys.excepthook is _excepthook:
        sys.excepthook = _state.pop("excepthook")
        threading.excepthook = _state.pop("thread_excepthook")
    if threading.current_thread() is not threading.main_thread():
        return  # handlers can only be restored from the main thread: keep what we saved
    previous = _state.pop("signals", None) or {}
    for sig, old in previous.items():
        try:
            if signal.getsignal(sig) is _on_signal:
                signal.signal(sig, old)
        except (ValueError, OSError):
            pass


def _session():
    sess = _state.get("session")
    if sess is None or sess.pid != os.getpid() or sess.stopped:
        return None
    return sess


def _at_exit() -> None:
    sess = _session()
    if sess is not None:
        sess.exiting()  # bounded: daemon threads may still be busy
        sess.stop()


def _on_signal(signum, frame) -> None:
    sess = _session()
    previous = _state.get("signals", {}).get(signum, signal.SIG_DFL)
    if sess is not None and sess._lock._is_owned():  # noqa: SLF001
        sess = None  # we interrupted the session's own work: the file ends on a packet boundary
    if sess is not None:
        if previous in (signal.SIG_DFL, None) and signum in _ENDING:
            sess.exiting()
            sess.stop()  # the process is about to die: finish the files properly
        else:
            sess.flush(timeout=5.0)
    if callable(previous):
        previous(signum, frame)
    elif previous == signal.SIG_DFL:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
    # SIG_IGN: nothing more to do


def _excepthook(exc_type, exc, tb) -> None:
    sess = _session()
    if sess is not None:
        try:
            sess.exiting()
            sess.stop()
        except Exception:
            pass
    _state.get("excepthook", sys.__excepthook__)(exc_type, exc, tb)


def _thread_excepthook(args) -> None:
    sess = _session()
    if sess is not None:
        try:
            sess.flush(timeout=5.0)
        except Exception:
            pass
    _state.get("thread_excepthook", threading.__excepthook__)(args)
