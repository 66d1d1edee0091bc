"""core.native_threads: a C++ thread's ``pthread_t`` (CUPTI's 32-bit thread id) → its system tid,
read from the thread's own struct pthread (Linux x86-64 glibc), in a process with real threads."""

from __future__ import annotations

import threading

import pytest

from raw_thread import RawThread
from stepscope.core import native_threads as nt

pytestmark = pytest.mark.skipif(not nt.supported(), reason="Linux x86-64 only")


def test_a_live_cpp_thread_and_this_one_are_found_by_their_32_bit_ids():
    t = RawThread()
    try:
        assert t.ident not in {x.ident for x in threading.enumerate()}  # unknown to Python
        mine = threading.get_ident() & 0xFFFFFFFF
        got = nt.tids_of_pthreads([t.ident & 0xFFFFFFFF, mine, 0x1234])
        assert got == {t.ident & 0xFFFFFFFF: t.tid, mine: threading.get_native_id()}
        assert nt.tids_of_pthreads([t.ident]) == {t.ident & 0xFFFFFFFF: t.tid}  # cut here
    finally:
        t.end()


def test_an_ended_thread_is_not_found():
    nt.tids_of_pthreads([threading.get_ident()])  # (its probe thread, once, not on t's stack)
    t = RawThread()
    t.end()
    for _ in range(100):  # its exit clears the tid in its struct (CLONE_CHILD_CLEARTID)
        if str(t.tid) not in nt.os.listdir("/proc/self/task"):
            break
        threading.Event().wait(0.01)
    assert nt.tids_of_pthreads([t.ident]) == {}


def test_thread_name_is_the_threads_own():
    t = RawThread(b"pt_autograd_0")
    try:
        assert nt.thread_name(t.tid) == "pt_autograd_0"
    finally:
        t.end()
    assert nt.thread_name(2**31 - 1) == ""


def test_elsewhere_nothing_is_resolved(monkeypatch):
    monkeypatch.setattr(nt.platform, "machine", lambda: "aarch64")
    assert nt.tids_of_pthreads([threading.get_ident()]) == {}
