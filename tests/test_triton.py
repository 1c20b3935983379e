"""The Triton engine, forward and gradients, against the float64 reference.

With a GPU (and TRITON_INTERPRET unset) the cases in ``_triton_cases.py`` run compiled on
CUDA. Without one they run in Triton's interpreter on CPU tensors: TRITON_INTERPRET=1 must
be set before triton is first imported (torch imports it), so they run in a subprocess
with that setting, and this process's other tests keep the compiled kernels.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"

if INTERPRETED or torch.cuda.is_available():
    from _triton_cases import *  # noqa: F403
else:

    def test_kernels_in_the_interpreter():
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        here = Path(__file__)
        cmd = [sys.executable, "-m", "pytest", str(here), "-q", "-p", "no:cacheprovider",
               "-o", "addopts=", "--rootdir", str(here.parent.parent)]
        run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        tail = (run.stdout + run.stderr)[-6000:]
        assert run.returncode == 0, f"interpreted Triton tests failed:\n{tail}"
        print(tail.strip().splitlines()[-1])
