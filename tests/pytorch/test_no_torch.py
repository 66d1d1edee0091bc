"""The core and the integration's package import without torch; torch=None leaves it off."""

import os
import subprocess
import sys


def test_import_stepscope_never_imports_torch(tmp_path):
    code = ("import sys, stepscope, stepscope.pytorch, stepscope.profiler\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n"
            "p = stepscope.Profiler(dir=sys.argv[1], schedule=None, host_metrics=False,"
            " report=False, use_env=False)\n"
            "p.start(); p.step(); p.stop()\n"
            "assert p.hooks == [] and 'torch' not in sys.modules\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)],
                         capture_output=True, text=True, env=env, timeout=60,
                         cwd=os.path.dirname(__file__))
    assert out.returncode == 0, out.stderr
