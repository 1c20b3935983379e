"""Compile the Triton engine's kernels for a GPU without having one (default sm_90, H100/H200).

    PYTHONPATH=src python benchmarks/compile_check.py [--arch 90] [--quick]

For each variant the engine would launch (dtype, head size, mask mode, tiles from
``engines.triton._configs``) it prints shared memory against the 227 KiB limit, registers
and spills (from the bundled ptxas) and whether the dots became Hopper wgmma instructions.
It catches compile errors and tiles that cannot fit before any GPU time is spent. The work
is done by :mod:`causalattn.engines.triton_compile`; this is its command line.
"""

from __future__ import annotations

import argparse

import torch

from causalattn.engines.triton_compile import TYPE_NAMES, launches, report


def _variant(dtype, T, d, lengths=False, causal=True, key_padding=False, **pattern):
    """One row of VARIANTS: launches' arguments (pattern: attention's other keywords)."""
    return dtype, T, d, lengths, causal, key_padding, pattern


MODIFIERS = dict(softcap=30.0, alibi_slopes=[0.5, 0.25], sinks=[0.0, 1.0], dropout_p=0.1)
VARIANTS = [
    _variant(torch.bfloat16, 4096, 128),  # the two benchmark shapes (--quick)
    _variant(torch.bfloat16, 4096, 1000),
    _variant(torch.float32, 1024, 64, lengths=True, key_padding=True),
    _variant(torch.float32, 1024, 1000, lengths=True, causal=False),
    _variant(torch.float16, 1024, 256, lengths=True),
    # issues 11 and 12: window (host intervals), dense mask (tile kinds), modifiers, dropout
    _variant(torch.bfloat16, 4096, 128, window=512),
    _variant(torch.bfloat16, 1024, 128, mask=torch.ones(1, 2, 1024, 1024, dtype=torch.bool)),
    _variant(torch.bfloat16, 1024, 128, **MODIFIERS),
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--quick", action="store_true", help="the two bf16 benchmark variants only")
    args = ap.parse_args()
    for dtype, T, d, lengths, causal, key_padding, pat in VARIANTS[:2] if args.quick else VARIANTS:
        for name, a, kw in launches(dtype, T, d, lengths, causal, key_padding, **pat):
            res = report(name, a, kw, args.arch)
            extra = " ".join(sorted(pat))
            print(
                f"{name:11s} {TYPE_NAMES[dtype]} T={T} d={d} lengths={lengths} causal={causal} "
                f"key_padding={key_padding} {extra}: {res}",
                flush=True,
            )


if __name__ == "__main__":
    main()
