"""Compile the Triton engine's kernels for a GPU without having one (default sm_90, H100/H200).

    PYTHONPATH=src python benchmarks/compile_check.py [--arch 90] [--quick]

For each variant the engine would launch (dtype, head size, mask mode, tiles from
``engines.triton._configs``) it prints shared memory against the 227 KiB limit, registers
and spills (from the bundled ptxas) and whether the dots became Hopper wgmma instructions.
It catches compile errors and tiles that cannot fit before any GPU time is spent.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
import time

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from causalattn.engines import _triton_kernels as K
from causalattn.engines import make_problem
from causalattn.engines import triton as tri

SMEM_LIMIT = 232448  # bytes of shared memory per block on sm_90
TY = {
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float32: "fp32",
    torch.int32: "i32",
    torch.int8: "i8",
}


class _Recorder:
    """Stands in for the kernels module: records each launch instead of running it."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        rec = self

        class _Launch:
            def __getitem__(self, grid):
                return lambda *args, **kw: rec.calls.append((name, args, kw))

        return _Launch()


def _source(fn, args, kw):
    """The JIT's specialization, by hand: tensors -> 16-byte aligned pointers, ints equal to
    1 -> constants, ints divisible by 16 -> marked so, constexpr parameters -> constants."""
    sig, consts, attrs = {}, {}, {}
    for i, (param, a) in enumerate(zip(fn.params, args)):
        n = param.name
        if param.is_constexpr or (isinstance(a, int) and not isinstance(a, bool) and a == 1):
            sig[n], consts[(i,)] = "constexpr", a
        elif isinstance(a, torch.Tensor):
            sig[n], attrs[(i,)] = "*" + TY[a.dtype], [["tt.divisibility", 16]]
        elif isinstance(a, float):
            sig[n] = "fp32"
        else:
            sig[n] = "i32" if abs(a) < 2**31 else "i64"
            if a % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    names = fn.arg_names
    for k, v in kw.items():
        if k in names:
            sig[k], consts[(names.index(k),)] = "constexpr", v
    return ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)


def _ptxas(ptx: str, arch: int) -> str:
    """Registers and spills from triton's bundled ptxas (the newer "ptxas-blackwell" where
    the plain one is older than the PTX triton writes)."""
    bin_ = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    for name in ("ptxas", "ptxas-blackwell"):
        if not os.path.exists(os.path.join(bin_, name)):
            continue
        out = subprocess.run(
            [os.path.join(bin_, name), f"-arch=sm_{arch}a", "-v", f.name, "-o", os.devnull],
            capture_output=True,
            text=True,
        )
        if out.returncode == 0:
            break
    os.unlink(f.name)
    log = out.stdout + out.stderr
    regs = re.search(r"Used (\d+) registers", log)
    spill = re.search(r"(\d+) bytes spill stores", log)
    return f"regs {regs.group(1) if regs else '?'}, spills {spill.group(1) if spill else '?'} B"


def launches(dtype, T: int, d: int, lengths: bool, causal: bool, kpm: bool, over=None, **pattern):
    """The kernel launches of one forward + backward, recorded (CPU tensors, nothing runs).
    ``pattern``: more keywords of :func:`causalattn.attention` (window, mask, softcap,
    alibi_slopes, sinks, dropout_p, ...)."""
    rec = _Recorder()
    q, k, v = (torch.zeros(1, 2, T, d, dtype=dtype) for _ in range(3))
    p = make_problem(
        q,
        k,
        v,
        causal=causal,
        lengths=torch.tensor([T - 3]) if lengths else None,
        key_padding_mask=torch.ones(1, T, dtype=torch.bool) if kpm else None,
        **pattern,
    )
    cfg = tri._configs(d, d, dtype, interpret=False)
    for name, o in (over or {}).items():
        cfg[name] = {**cfg[name], **o}
    plan = tri._Plan(p)
    orig = tri._kernels
    tri._kernels = lambda: rec
    try:
        o, lse = tri._launch_fwd(q, k, v, plan, p.scale, cfg)
        D = tri._launch_preprocess(o, o, lse, None, cfg)
        tri._launch_bwd(q, k, v, o, lse, D, plan, p.scale, cfg)
    finally:
        tri._kernels = orig
    return rec.calls


def compile_launch(name, args, kw, arch=90):
    """Compile one recorded launch for sm_<arch> -> triton's CompiledKernel (no GPU needed)."""
    kw = dict(kw)
    opts = dict(num_warps=kw.pop("num_warps", 4), num_stages=kw.pop("num_stages", 3))
    return triton.compile(
        _source(getattr(K, name), args, kw), target=GPUTarget("cuda", arch, 32), options=opts
    )


def pipelined(k) -> bool:
    return "async_copy_global_to_local" in k.asm["ttgir"] or "async_tma" in k.asm["ttgir"]


def check(name, args, kw, arch):
    t = time.time()
    try:
        k = compile_launch(name, args, kw, arch)
    except Exception as exc:
        return f"FAILED {type(exc).__name__}: ...{str(exc)[-700:]}"
    smem = k.metadata.shared
    ttgir = k.asm["ttgir"]
    opts = {"num_warps": kw.get("num_warps", 4), "num_stages": kw.get("num_stages", 3)}
    tiles = {a: kw[a] for a in ("BLOCK_M", "BLOCK_N") if a in kw} | opts
    return (
        f"smem {smem} B{' OVER LIMIT' if smem > SMEM_LIMIT else ''}, {_ptxas(k.asm['ptx'], arch)}, "
        f"wgmma {'yes' if 'warp_group_dot' in ttgir else 'no'}, "
        f"pipelined {'yes' if pipelined(k) else 'no'}, "
        f"{time.time() - t:.0f} s, {tiles}"
    )


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
            res = check(name, a, kw, args.arch)
            extra = " ".join(sorted(pat))
            print(
                f"{name:11s} {TY[dtype]} T={T} d={d} lengths={lengths} causal={causal} "
                f"kpm={kpm} {extra}: {res}",
                flush=True,
            )


if __name__ == "__main__":
    main()
