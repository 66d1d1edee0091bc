"""The operator converter on hand-made columns (no torch needed): forward→backward pairing and
blob sharing, with every expected value worked out by hand."""

from __future__ import annotations

import numpy as np

from stepscope.core import session as _session
from stepscope.pytorch.events import OpColumns
from stepscope.pytorch.operators import _EVAL, OperatorCapture, _flow_pairs
from stepscope.record.recorder import BEGIN, END


def _a(*v):
    return np.array(v, dtype=np.int64)


def test_flow_pairs_as_kineto_links_them():
    # row: 0     1     2     3     4      5      6     7     8
    #      fwd5  fwd5  fwd5  fwd6  bwd5   bwd5E  bwd6  bwd6  fwd7 (+ row 9: bwd8, row 10: none)
    start = _a(10, 20, 20, 30, 40, 50, 60, 70, 80, 90, 95)
    start_tid = _a(1, 1, 1, 1, 2, 2, 2, 2, 1, 2, 0)
    seq = _a(5, 5, 5, 6, 5, 5, 6, 6, 7, 8, -1)
    fwd_tid = _a(0, 0, 0, 0, 1, 1, 1, 1, 0, 1, 0)
    is_eval = np.array([0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0], dtype=bool)
    out, into = _flow_pairs(start, start_tid, seq, fwd_tid, is_eval)
    # seq 5: the last forward op (latest start 20; of rows 1 and 2, the later: 2) links to the
    # evaluate_function row 5, not to the earlier plain row 4; seq 6: the only forward op 3 to
    # the first backward row 6 (no evaluate_function); 7 has no backward, 8 no forward
    assert out.tolist() == [2, 3] and into.tolist() == [5, 6]


def test_flow_pairs_keep_threads_apart():
    # the same sequence number on two forward threads: each backward names its own
    start = _a(0, 1, 2, 3)
    start_tid = _a(1, 3, 9, 9)
    seq = _a(4, 4, 4, 4)
    fwd_tid = _a(0, 0, 3, 1)
    out, into = _flow_pairs(start, start_tid, seq, fwd_tid, np.zeros(4, dtype=bool))
    assert out.tolist() == [1, 0] and into.tolist() == [2, 3]


def test_write_shares_blobs_and_gives_flowed_ops_their_own():
    sess = _session.Session(None, detail=True)
    cap = OperatorCapture(sess)
    cap.skip_names = lambda: {"user range"}
    names = ["aten::mm", "user range", _EVAL + "MmBackward0"]
    # rows: mm (seq 1) | user range (skipped) | mm, same inputs, no seq | backward of seq 1
    cols = OpColumns(names, ["[[2, 2], [2, 2]]"], ["float, float"],
                     name=np.array([0, 1, 0, 2], dtype=np.int32),
                     inputs=np.array([0, -1, 0, -1], dtype=np.int32),
                     start=_a(100, 150, 200, 300), dur=_a(10, 5, 10, -1),
                     tid=_a(7, 7, 7, 7), start_tid=_a(1, 0, 0, 2), seq=_a(1, -1, -1, 1),
                     fwd_tid=_a(0, 0, 0, 1))
    assert cap.write(cols, lambda t: t - 100) == 3
    ts, idx, blobs = cap._em.take_columns()
    # 3 slices: 6 events; begins at 0, 100, 200; ends at 10, 110, 200 (a negative duration: 0)
    assert sorted(ts.tolist()) == [0, 10, 100, 110, 200, 200]
    begins = [blobs[i] for i in idx.tolist() if blobs[i].kind == BEGIN]
    assert len(begins) == 3
    by_ts = dict(zip(ts.tolist(), (blobs[i] for i in idx.tolist()), strict=False))
    first, plain = by_ts[0], by_ts[100]
    back = [b for b in begins if b.tflows][0]
    assert first.flows and back.tflows == first.flows  # the flow: mm (seq 1) -> its backward
    assert plain.flows is None and plain is not first  # same op and inputs, but first flows
    assert first.args == plain.args == {"input_shapes": "[[2, 2], [2, 2]]",
                                        "input_dtypes": "float, float"}
    assert back.args is None
    assert len({id(blobs[i]) for i in idx.tolist() if blobs[i].kind == END}) == 1  # one end
