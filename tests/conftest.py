"""Suite-wide: every trace a test writes under its ``tmp_path`` is checked for what Perfetto's
trace processor would reject (tracecheck.py); a test that writes such a trace on purpose says
so with ``@pytest.mark.rejected_trace_ok``."""

from __future__ import annotations

import pytest

from tracecheck import problems


@pytest.fixture(autouse=True)
def _traces_trace_processor_accepts(request):
    checked = "tmp_path" in request.fixturenames and not request.node.get_closest_marker(
        "rejected_trace_ok")
    tmp = request.getfixturevalue("tmp_path") if checked else None  # the test's own
    yield
    if tmp is None:
        return
    bad = {}
    for path in sorted(tmp.rglob("*.pftrace")):
        if path.is_file() and (found := problems(path)):
            bad[path.name] = found
    if bad:
        pytest.fail(f"traces that trace processor would reject: {bad}", pytrace=False)
