"""Build the optional C hot path (``stepscope._fast``); everything else is in pyproject.toml.

The extension is optional: where it cannot be compiled (no compiler, another platform) the install
goes on and stepscope records through its pure-Python twin in ``_recorder.py``.
"""

import sys

from setuptools import Extension, setup

ext_modules = []
if sys.platform.startswith("linux"):  # CLOCK_MONOTONIC is what perf_counter_ns reads there
    ext_modules.append(Extension("stepscope._fast", ["src/stepscope/_fast.c"], optional=True))

setup(ext_modules=ext_modules)
