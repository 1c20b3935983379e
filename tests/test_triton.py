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

if not INTERPRETED:

    @pytest.mark.parametrize("dtype,d,lengths,kpm", [
        (torch.bfloat16, 128, False, False),  # the kernels' own causal intervals
        (torch.float16, 1000, True, True),  # host intervals, key mask, d-chunked
    ])
    def test_kernels_compile_for_hopper(dtype, d, lengths, kpm):
        """What the interpreter cannot show: the kernels compile for sm_90 (no GPU needed),
        fit its shared memory, use wgmma and pipeline their loads."""
        sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
        import compile_check as cc

        for name, args, kw in cc.launches(dtype, 256, d, lengths, True, kpm):
            k = cc.compile_launch(name, args, kw)
            assert k.metadata.shared <= cc.SMEM_LIMIT, (name, k.metadata.shared)
            if name != "bwd_preprocess":  # the attention kernels: tensor cores, async loads
                assert "warp_group_dot" in k.asm["ttgir"], f"{name}: no wgmma"
                assert cc.pipelined(k), f"{name}: loads not pipelined"

if not INTERPRETED and not torch.cuda.is_available():

    def test_kernels_in_the_interpreter():
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        here = Path(__file__)
        cmd = [sys.executable, "-m", "pytest", str(here), "-q", "-p", "no:cacheprovider",
               "-o", "addopts=", "--rootdir", str(here.parent.parent)]
        run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        tail = (run.stdout + run.stderr)[-6000:]
        assert run.returncode == 0, f"interpreted Triton tests failed:\n{tail}"
        print(tail.strip().splitlines()[-1])
