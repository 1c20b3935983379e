"""The Triton engine, forward and gradients, against the float64 reference.

With a GPU (and TRITON_INTERPRET unset) the cases in ``_triton_cases.py`` run compiled on
CUDA. Without one they run in Triton's interpreter on CPU tensors: TRITON_INTERPRET=1 must
be set before triton is first imported (torch imports it), so they run in a subprocess
with that setting, and this process's other tests keep the compiled kernels.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"

if INTERPRETED or torch.cuda.is_available():
    from _triton_cases import *  # noqa: F403

if not INTERPRETED:
    EVERYTHING = dict(
        window=64, softcap=30.0, alibi_slopes=[0.5, 0.25], sinks=[0.0, 1.0], dropout_p=0.1
    )

    @pytest.mark.parametrize(
        "dtype,d,lengths,key_padding,pattern",
        [
            (torch.bfloat16, 128, False, False, {}),  # the kernels' own causal intervals
            (torch.float16, 1000, True, True, {}),  # host intervals, key mask, d-chunked
            (torch.bfloat16, 128, False, False, EVERYTHING),  # window, modifiers, dropout
            (torch.bfloat16, 64, False, False, {"mask": torch.ones(256, 256, dtype=torch.bool)}),
        ],
        ids=["causal", "wide-padded", "window-modifiers-dropout", "dense-mask"],
    )
    def test_kernels_compile_for_hopper(dtype, d, lengths, key_padding, pattern):
        """What the interpreter cannot show: the kernels compile for sm_90 (no GPU needed),
        fit its shared memory, use wgmma and pipeline their loads (the dense mask's tiles
        are visited behind a branch on the tile kinds, which the pipeliner leaves alone)."""
        from causalattn.engines import triton_compile

        for name, args, kw in triton_compile.launches(
            dtype, 256, d, lengths, True, key_padding, **pattern
        ):
            k = triton_compile.compile_launch(name, args, kw)
            assert k.metadata.shared <= triton_compile.SMEM_LIMIT, (name, k.metadata.shared)
            if name != "bwd_preprocess":  # the attention kernels: tensor cores, async loads
                assert "warp_group_dot" in k.asm["ttgir"], f"{name}: no wgmma"
                if "mask" not in pattern:
                    assert triton_compile.pipelined(k), f"{name}: loads not pipelined"


if not INTERPRETED and not torch.cuda.is_available():

    def test_kernels_in_the_interpreter():
        from _helpers import run_in_triton_interpreter

        print(run_in_triton_interpreter(__file__, timeout=840))
