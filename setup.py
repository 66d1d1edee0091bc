"""Build the optional C extensions; everything else is in pyproject.toml.

``stepscope._fast`` is the hot recording path. ``stepscope.analysis.sqlimage._sqlpages`` (the row
loops of the embedded engine's database image) and ``analysis.tp._decodeloops`` (the decoder's
sequential loops)
speed up loading a trace. All are optional: where they cannot be compiled (no compiler, another
platform) the install goes on with their pure-Python / numpy twins (``_recorder.py``,
``analysis/sqlimage/``, ``analysis/tp/``).
"""

import sys

from setuptools import Extension, setup

ext_modules = []
if sys.platform.startswith("linux"):  # CLOCK_MONOTONIC is what perf_counter_ns reads there
    ext_modules.append(Extension("stepscope._fast", ["src/stepscope/_fast.c"], optional=True,
                                 depends=["src/stepscope/_wire_tags.h"]))

for name in ("sqlimage._sqlpages", "tp._decodeloops"):
    ext_modules.append(Extension(f"stepscope.analysis.{name}",
                                 [f"src/stepscope/analysis/{name.replace('.', '/')}.c"],
                                 optional=True))

setup(ext_modules=ext_modules)
