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

VARIANTS = [  # (dtype, T, d, lengths, causal, kpm, pattern keywords)
    (torch.bfloat16, 4096, 128, False, True, False, {}),
    (torch.bfloat16, 4096, 1000, False, True, False, {}),
    (torch.float32, 1024, 64, True, True, True, {}),
    (torch.float32, 1024, 1000, True, False, False, {}),
    (torch.float16, 1024, 256, True, True, False, {}),
    # issues 11 and 12: window (host row ranges), dense mask (block table), modifiers, dropout
    (torch.bfloat16, 4096, 128, False, True, False, {"window": 512}),
    (
        torch.bfloat16,
        1024,
        128,
        False,
        True,
        False,
        {"mask": torch.ones(1, 2, 1024, 1024, dtype=torch.bool)},
    ),
    (
        torch.bfloat16,
        1024,
        128,
        False,
        True,
        False,
        {"softcap": 30.0, "alibi_slopes": [0.5, 0.25], "sinks": [0.0, 1.0], "dropout_p": 0.1},
    ),
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--quick", action="store_true", help="the two bf16 benchmark variants only")
    args = ap.parse_args()
    for dtype, T, d, lengths, causal, kpm, pat in VARIANTS[:2] if args.quick else VARIANTS:
        for name, a, kw in launches(dtype, T, d, lengths, causal, kpm, **pat):
            res = report(name, a, kw, args.arch)
            extra = " ".join(sorted(pat))
            print(
                f"{name:11s} {TYPE_NAMES[dtype]} T={T} d={d} lengths={lengths} causal={causal} "
                f"kpm={kpm} {extra}: {res}",
                flush=True,
            )


if __name__ == "__main__":
    main()
