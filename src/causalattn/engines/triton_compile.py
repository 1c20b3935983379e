"""Compile the Triton engine's kernels for a GPU without having one (default sm_90, H100/H200).

What a compile check needs, shared by ``benchmarks/compile_check.py`` (the command line)
and ``tests/engines/test_triton.py``: :func:`launches` records the kernel launches of one forward
and backward (CPU tensors; nothing runs), :func:`compile_launch` compiles one of them with
triton's own compiler and bundled ptxas, :func:`pipelined` and :data:`SMEM_LIMIT` judge the
result, :func:`report` says it in one line (shared memory, registers, spills, wgmma,
pipelining). Like ``_triton_kernels``, this module imports only where triton is installed.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
import time

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from . import triton as engine
from .problem import make_problem
from .triton_plan import Plan

SMEM_LIMIT = 232448  # bytes of shared memory per block on sm_90
TYPE_NAMES = {
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
            sig[n], attrs[(i,)] = "*" + TYPE_NAMES[a.dtype], [["tt.divisibility", 16]]
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


def ptxas_usage(ptx: str, arch: int) -> str:
    """Registers and spills from triton's bundled ptxas (the newer "ptxas-blackwell" where
    the plain one is older than the PTX triton writes)."""
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    for name in ("ptxas", "ptxas-blackwell"):
        if not os.path.exists(os.path.join(bin_dir, name)):
            continue
        out = subprocess.run(
            [os.path.join(bin_dir, name), f"-arch=sm_{arch}a", "-v", f.name, "-o", os.devnull],
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


def launches(
    dtype, T: int, d: int, lengths: bool, causal: bool, key_padding: bool, over=None, **pattern
):
    """The kernel launches of one forward + backward, recorded (CPU tensors, nothing runs)
    -> [(kernel name, args, keywords)]. ``lengths``/``key_padding``: a length T - 3 / an all-True
    key padding mask; ``over``: tile overrides per kernel; ``pattern``: more keywords of
    :func:`causalattn.attention` (window, mask, softcap, alibi_slopes, sinks, dropout_p, ...)."""
    rec = _Recorder()
    q, k, v = (torch.zeros(1, 2, T, d, dtype=dtype) for _ in range(3))
    p = make_problem(
        q,
        k,
        v,
        causal=causal,
        lengths=torch.tensor([T - 3]) if lengths else None,
        key_padding_mask=torch.ones(1, T, dtype=torch.bool) if key_padding else None,
        **pattern,
    )
    cfg = engine._configs(d, d, dtype, interpret=False)
    for name, o in (over or {}).items():
        cfg[name] = {**cfg[name], **o}
    plan = Plan(p)
    kernels = engine._kernels
    engine._kernels = lambda: rec
    try:
        o, lse = engine._launch_fwd(q, k, v, plan, p.scale, cfg)
        D = engine._launch_preprocess(o, o, lse, None, cfg)
        engine._launch_bwd(q, k, v, o, lse, D, plan, p.scale, cfg)
    finally:
        engine._kernels = kernels
    return rec.calls


def compile_launch(name, args, kw, arch=90):
    """Compile one recorded launch for sm_<arch> -> triton's CompiledKernel (no GPU needed)."""
    from . import _triton_kernels

    kw = dict(kw)
    opts = dict(num_warps=kw.pop("num_warps", 4), num_stages=kw.pop("num_stages", 3))
    source = _source(getattr(_triton_kernels, name), args, kw)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=opts)


def pipelined(k) -> bool:
    """Whether the compiled kernel's loads are asynchronous copies (software pipelining)."""
    return "async_copy_global_to_local" in k.asm["ttgir"] or "async_tma" in k.asm["ttgir"]


def report(name, args, kw, arch=90) -> str:
    """One line on one recorded launch: shared memory (against SMEM_LIMIT), registers,
    spills, wgmma, pipelining, compile time and tiles; or why it failed to compile."""
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
        f"smem {smem} B{' OVER LIMIT' if smem > SMEM_LIMIT else ''}, "
        f"{ptxas_usage(k.asm['ptx'], arch)}, "
        f"wgmma {'yes' if 'warp_group_dot' in ttgir else 'no'}, "
        f"pipelined {'yes' if pipelined(k) else 'no'}, "
        f"{time.time() - t:.0f} s, {tiles}"
    )
