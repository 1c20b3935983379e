"""The engines as two PyTorch operators, so compile, export, meta tensors and torch.func work.

    causalattn::fwd(q, k, v, <pattern tensors>, dropout_seed, <scalars>, engine, return_lse)
        -> (out, lse)
    causalattn::bwd(dout, dlse, q, k, v, out, lse, <pattern tensors>, dropout_seed, <scalars>,
                    engine, want_dsinks) -> (dq, dk, dv, dsinks)

q ``(B, H_q, T_q, d_k)``, k ``(B, H_kv, T_k, d_k)``, v ``(B, H_kv, T_k, d_v)``; out
``(B, H_q, T_q, d_v)`` in q's dtype; lse ``(B, H_q, T_q)`` in the compute dtype (fp64 for
fp64 inputs, else fp32), or ``(0,)`` for an engine that does not compute it (sdpa).

Dynamo and torch.export see one opaque operator whose output shapes come from the fake
implementations and whose backward is registered on it: no graph break, no guard on data.
Everything that reads data — the range of ``lengths``, the order of ``cu_seqlens``,
finiteness — runs inside the operator, where the :class:`Problem` is rebuilt from the
arguments and checked by :func:`make_problem`. The forward's 19 arguments are one
:class:`OpArgs`: built by name, unpacked by name.

Engines with raw passes (tiled, cpp, triton) run them; the others (reference, sdpa) are run
under autograd inside the operator and differentiated there (recomputation).
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import NamedTuple

import torch
from torch import Tensor

from .. import dropout as _dropout
from .problem import compute_dtype as lse_dtype
from .problem import make_problem
from .registry import ENGINES, TENSORS, engine, of_problem

__all__ = ["OpArgs", "ENGINES", "TENSORS", "fwd", "bwd", "refusal", "engine_module"]


class OpArgs(NamedTuple):
    """The forward operator's arguments, in its order: the one place that knows it."""

    q: Tensor
    k: Tensor
    v: Tensor
    lengths: Tensor | None
    key_padding_mask: Tensor | None
    cu_seqlens: Tensor | None
    prefix_lengths: Tensor | None
    mask: Tensor | None
    alibi_slopes: Tensor | None
    sinks: Tensor | None
    dropout_seed: Tensor | None
    causal: bool
    window: int | None
    chunk: int | None
    softcap: float | None
    scale: float
    dropout_p: float
    engine: str
    return_lse: bool

    def tensors(self) -> tuple:
        """The pattern tensors, in TENSORS order."""
        return tuple(getattr(self, n) for n in TENSORS)

    def scalars(self) -> tuple:
        """causal .. engine: what the backward operator takes after the tensors."""
        return (
            self.causal,
            self.window,
            self.chunk,
            self.softcap,
            self.scale,
            self.dropout_p,
            self.engine,
        )

    @classmethod
    def grads(cls, dq, dk, dv, dsinks) -> tuple:
        """The backward's return: a gradient per argument (None where there is none)."""
        none = cls(*[None] * len(cls._fields))
        return tuple(none._replace(q=dq, k=dk, v=dv, sinks=dsinks))


assert TENSORS == OpArgs._fields[3:10]


def engine_module(name: str):
    """The engine's module; ValueError naming it when unknown or not importable here."""
    return engine(name).load()


def refusal(name: str, p, return_lse: bool) -> str:
    """Why engine ``name`` does not run ``p`` ("" when it does)."""
    return engine(name).refusal(of_problem(p, return_lse))


def _problem(tensors, dropout_seed, q, k, v, causal, window, chunk, softcap, scale, dropout_p):
    """The checked :class:`Problem` of the operators' arguments (this is where data is read)."""
    given = {n: t for n, t in zip(TENSORS, tensors) if t is not None}
    p = make_problem(
        q, k, v, causal=causal, window=window, chunk=chunk, softcap=softcap, scale=scale, **given
    )
    if dropout_p:
        p = replace(
            p,
            dropout_p=_dropout.check_p(dropout_p),
            dropout_seed=(int(dropout_seed[0]), int(dropout_seed[1])),
        )
    return p


def _sdpa_rng(p):
    """SDPA draws its own dropout from torch's RNG: seeded from the problem's seed, so the
    backward's recomputation draws the same pattern."""
    if not p.dropout_p:
        return contextlib.nullcontext()
    devices = [p.q.device] if p.q.device.type == "cuda" else []
    ctx = torch.random.fork_rng(devices=devices)

    @contextlib.contextmanager
    def seeded():
        with ctx:
            torch.manual_seed(p.dropout_seed[0] * 2**31 + p.dropout_seed[1])
            yield

    return seeded()


def _run_fwd(name: str, p, want_lse: bool) -> tuple[Tensor, Tensor]:
    e = engine(name)
    mod = e.load()
    cd = lse_dtype(p.q.dtype)
    why = e.refusal(of_problem(p, want_lse and e.lse, grad=False))
    if why:
        raise ValueError(why)
    if e.raw:
        out, lse = mod.fwd(p)
        return out, lse.to(cd)
    with torch.no_grad(), _sdpa_rng(p):
        if not e.lse:
            return mod.forward(p, False), p.q.new_empty((0,), dtype=cd)
        out, lse = mod.forward(p, True)
    return out, lse.to(cd)


def _run_bwd(name: str, p, out, lse, dout, dlse, want_dsinks: bool):
    """(dq, dk, dv, dsinks or None)."""
    e = engine(name)
    mod = e.load()
    sinks = p.pattern.sinks
    if e.raw:
        dq, dk, dv = mod.bwd(p, out, lse, dout, dlse)
        ds = mod.sinks_grad(p, out, lse, dout, dlse) if want_dsinks and sinks is not None else None
        return dq, dk, dv, ds
    # recompute under autograd (the materializing engines are differentiable themselves)
    with _autograd_inside(), torch.enable_grad(), _sdpa_rng(p):
        q, k, v = (t.detach().requires_grad_(True) for t in (p.q, p.k, p.v))
        leaves = [q, k, v]
        pt = p.pattern
        if want_dsinks and isinstance(sinks, Tensor):
            s = sinks.detach().requires_grad_(True)
            pt = replace(pt, sinks=s)
            leaves.append(s)
        want_lse = dlse is not None and e.lse
        res = mod.forward(replace(p, q=q, k=k, v=v, pattern=pt), want_lse)
        outs, grads = ([res[0], res[1]], [dout, dlse.float()]) if want_lse else ([res], [dout])
        g = torch.autograd.grad(outs, leaves, grads, allow_unused=True)
    g = [torch.zeros_like(t) if x is None else x for x, t in zip(g, leaves)]
    return g[0], g[1], g[2], (g[3] if len(g) > 3 else None)


def _autograd_inside():
    """Re-enable autograd dispatch inside an operator's implementation, which runs below the
    Autograd keys (they are excluded from this thread's dispatch set there)."""
    C = torch._C
    ex = C._dispatch_tls_local_exclude_set()
    for key in ("AutogradFunctionality", "AutogradOther", "AutogradNestedTensor"):
        if hasattr(C.DispatchKey, key):
            ex = ex.remove(getattr(C.DispatchKey, key))
    return C._ForceDispatchKeyGuard(C._dispatch_tls_local_include_set(), ex)


# ---- the operators ------------------------------------------------------------------------


@torch.library.custom_op("causalattn::fwd", mutates_args=())
def fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    lengths: Tensor | None,
    key_padding_mask: Tensor | None,
    cu_seqlens: Tensor | None,
    prefix_lengths: Tensor | None,
    mask: Tensor | None,
    alibi_slopes: Tensor | None,
    sinks: Tensor | None,
    dropout_seed: Tensor | None,
    causal: bool,
    window: int | None,
    chunk: int | None,
    softcap: float | None,
    scale: float,
    dropout_p: float,
    engine: str,
    return_lse: bool,
) -> tuple[Tensor, Tensor]:
    """One engine's forward: ``(out (B, H_q, T_q, d_v), lse (B, H_q, T_q) or (0,))``.

    ``dropout_seed``: int64 (2,) = (seed, offset) when dropout_p > 0 (a tensor, so that a
    compiled graph draws it on every call); ``return_lse``: whether the caller asked for
    the log-sum-exp (an engine may refuse it)."""
    a = OpArgs(
        q,
        k,
        v,
        lengths,
        key_padding_mask,
        cu_seqlens,
        prefix_lengths,
        mask,
        alibi_slopes,
        sinks,
        dropout_seed,
        causal,
        window,
        chunk,
        softcap,
        scale,
        dropout_p,
        engine,
        return_lse,
    )
    p = _problem(a.tensors(), a.dropout_seed, q, k, v, *a.scalars()[:-1])
    out, lse = _run_fwd(engine, p, return_lse)
    # outputs are contiguous (as the fake ones) and never alias an input
    out = out.contiguous()
    return out.clone() if out is q else out, lse.contiguous()


@fwd.register_fake
def _fwd_fake(*args):
    a = OpArgs(*args)
    B, H_q, T_q, _ = a.q.shape
    out = a.q.new_empty((B, H_q, T_q, a.v.shape[-1]))
    shape = (B, H_q, T_q) if engine(a.engine).lse else (0,)
    return out, a.q.new_empty(shape, dtype=lse_dtype(a.q.dtype))


@torch.library.custom_op("causalattn::bwd", mutates_args=())
def bwd(
    dout: Tensor,
    dlse: Tensor | None,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    lengths: Tensor | None,
    key_padding_mask: Tensor | None,
    cu_seqlens: Tensor | None,
    prefix_lengths: Tensor | None,
    mask: Tensor | None,
    alibi_slopes: Tensor | None,
    sinks: Tensor | None,
    dropout_seed: Tensor | None,
    causal: bool,
    window: int | None,
    chunk: int | None,
    softcap: float | None,
    scale: float,
    dropout_p: float,
    engine: str,
    want_dsinks: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One engine's backward from the saved ``out`` and ``lse``: ``(dq, dk, dv, dsinks)``;
    dsinks is shaped as sinks, or (0,) without them (or when not wanted)."""
    tensors = (lengths, key_padding_mask, cu_seqlens, prefix_lengths, mask, alibi_slopes, sinks)
    scalars = (causal, window, chunk, softcap, scale, dropout_p)
    p = _problem(tensors, dropout_seed, q, k, v, *scalars)
    dq, dk, dv, ds = _run_bwd(engine, p, out, lse, dout, dlse, want_dsinks and sinks is not None)
    ds = q.new_zeros((0,)) if ds is None else ds.to(sinks.dtype).reshape(sinks.shape)
    return (
        dq.to(q.dtype).contiguous(),
        dk.to(k.dtype).contiguous(),
        dv.to(v.dtype).contiguous(),
        ds,
    )


@bwd.register_fake
def _bwd_fake(dout, dlse, q, k, v, out, lse, *rest):
    sinks, want = rest[6], rest[-1]
    ds = sinks.new_empty(sinks.shape) if want and sinks is not None else q.new_empty((0,))
    # contiguous, as the real ones (not empty_like: q may be a transposed view)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), ds


def _setup_context(ctx, inputs, output):
    a = OpArgs(*inputs)
    out, lse = output
    ctx.save_for_backward(a.q, a.k, a.v, out, lse, *a.tensors(), a.dropout_seed)
    ctx.args = a._replace(
        q=None, k=None, v=None, **{n: None for n in TENSORS}, dropout_seed=None
    )  # the plain arguments
    ctx.sinks_index = OpArgs._fields.index("sinks")


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, *tensors, seed = ctx.saved_tensors
    a = ctx.args
    if dlse is not None and dlse.numel() == 0:  # an engine without lse
        dlse = None
    sinks = tensors[TENSORS.index("sinks")]
    want_ds = bool(ctx.needs_input_grad[ctx.sinks_index]) and sinks is not None
    with torch.no_grad():  # the backward is not differentiable again (no double backward)
        dq, dk, dv, ds = bwd(dout, dlse, q, k, v, out, lse, *tensors, seed, *a.scalars(), want_ds)
    return OpArgs.grads(dq, dk, dv, ds if want_ds else None)


fwd.register_autograd(_backward, setup_context=_setup_context)


# ---- torch.func: grad through an autograd.Function, vmap by a loop over the mapped axis --


class FuncAttention(torch.autograd.Function):
    """The forward operator with the same backward, for torch.func transforms (grad, vjp,
    vmap), which need an autograd.Function with setup_context (an operator's registered
    autograd does not compose with them)."""

    generate_vmap_rule = True  # both operators have vmap rules (below)

    @staticmethod
    def forward(*args):
        return fwd(*args)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _setup_context(ctx, inputs, output)

    @staticmethod
    def backward(ctx, dout, dlse):
        return _backward(ctx, dout, dlse)


def _loop_vmap(op, n_out: int):
    """A vmap rule for ``op``: the mapped axis moved to the front, one call per entry."""

    def rule(info, in_dims, *args):
        size = info.batch_size
        outs = []
        for i in range(size):
            call = [a if d is None else a.select(d, i) for a, d in zip(args, in_dims)]
            outs.append(op(*call))
        stacked = tuple(torch.stack([o[j] for o in outs]) for j in range(n_out))
        return stacked, (0,) * n_out

    return rule


torch.library.register_vmap(fwd, _loop_vmap(fwd, 2))
torch.library.register_vmap(bwd, _loop_vmap(bwd, 4))
