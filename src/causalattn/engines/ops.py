"""The engines as two PyTorch operators, so compile, export, meta tensors and torch.func work.

    causalattn::fwd(q, k, v, <pattern tensors>, <scalars>, engine) -> (out, lse)
    causalattn::bwd(dout, dlse, q, k, v, out, lse, <pattern tensors>, <scalars>, engine)
        -> (dq, dk, dv, dsinks)

q ``(B, H_q, T_q, d_k)``, k ``(B, H_kv, T_k, d_k)``, v ``(B, H_kv, T_k, d_v)``; out
``(B, H_q, T_q, d_v)`` in q's dtype; lse ``(B, H_q, T_q)`` in the compute dtype (fp64 for
fp64 inputs, else fp32), or ``(0,)`` for an engine that does not compute it (sdpa).

Dynamo and torch.export see one opaque operator whose output shapes come from the fake
implementations and whose backward is registered on it: no graph break, no guard on data.
Everything that reads data — the range of ``lengths``, the order of ``cu_seqlens``,
finiteness — runs inside the operator, where the :class:`Problem` is rebuilt from the
arguments and checked by :func:`make_problem`. Tensors of the pattern are operator
arguments; its scalars (causal, scale, engine) are plain arguments.

Engines with raw passes (tiled, triton) run them; the others (reference, sdpa) are run
under autograd inside the operator and differentiated there (recomputation).
"""

from __future__ import annotations

import importlib

import torch
from torch import Tensor

from ..masks import PATTERN_KEYWORDS
from .problem import compute_dtype as lse_dtype
from .problem import constant_result, make_problem

ENGINES = {
    "reference": "causalattn.engines.exact",  # the engine named "reference"
    "sdpa": "causalattn.engines.sdpa",
    "tiled": "causalattn.engines.tiled",
    "triton": "causalattn.engines.triton",
}
RAW = ("tiled", "triton")  # engines with raw fwd/bwd passes (the rest: autograd recompute)
NO_LSE = ("sdpa",)  # engines that do not compute the log-sum-exp


def engine_module(name: str):
    """The engine's module; ValueError naming it when unknown or not importable here."""
    if name not in ENGINES:
        raise ValueError(f"attention: unknown engine {name!r}; choose from {['auto', *ENGINES]}")
    try:
        return importlib.import_module(ENGINES[name])
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ValueError(f"attention: engine {name!r} is not available here ({exc})") from exc


@constant_result
def engine_problem(name: str) -> str:
    """Why engine ``name`` cannot run here ("" when it can): a constant while tracing."""
    try:
        engine_module(name)
    except ValueError as exc:
        return str(exc)
    return ""


# the pattern's tensors, in the operators' argument order (after q, k, v): Pattern's order
TENSORS = tuple(n for n in PATTERN_KEYWORDS if n not in ("causal", "window", "chunk", "softcap"))


def _problem(q, k, v, tensors, dropout_seed, causal, window, chunk, softcap, scale, dropout_p):
    """The checked :class:`Problem` of the operators' arguments (this is where data is read)."""
    from dataclasses import replace

    from .. import dropout as _dropout

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


def _supports(mod, p, return_lse: bool) -> bool:
    """An engine module's own ``supports(p, return_lse)``; without one, the legacy patterns."""
    fn = getattr(mod, "supports", None)
    if fn is None:  # the reference runs every pattern; an engine without supports(): legacy
        return mod.__name__ == ENGINES["reference"] or p.is_legacy
    return fn(p, return_lse)


def refusal(name: str, p, return_lse: bool) -> str:
    """Why engine ``name`` does not run ``p`` ("" when it does)."""
    mod = engine_module(name)
    if _supports(mod, p, return_lse):
        return ""
    dtypes = getattr(mod, "DTYPES", None)
    if dtypes is not None and p.q.dtype not in dtypes:
        return f"engine {name!r}: dtype {p.q.dtype} not supported; use {mod.DTYPE_NAMES}"
    drop = f" with dropout_p={p.dropout_p}" if p.dropout_p else ""
    lse = " with return_lse" if return_lse and name in NO_LSE else ""
    return (
        f"engine {name!r}: {p.pattern.describe()}{drop}{lse} is not supported; "
        "use engine='reference' (or 'auto')"
    )


def _sdpa_rng(p):
    """SDPA draws its own dropout from torch's RNG: seeded from the problem's seed, so the
    backward's recomputation draws the same pattern."""
    import contextlib

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
    mod = engine_module(name)
    cd = lse_dtype(p.q.dtype)
    if name in RAW:  # the raw passes do not check; the other engines' forward refuses itself
        why = refusal(name, p, want_lse)
        if why:
            raise ValueError(why)
        out, lse = mod.fwd(p)
        return out, lse.to(cd)
    with torch.no_grad(), _sdpa_rng(p):
        if name in NO_LSE:
            return mod.forward(p, False), p.q.new_empty((0,), dtype=cd)
        out, lse = mod.forward(p, True)
    return out, lse.to(cd)


def _run_bwd(name: str, p, out, lse, dout, dlse, want_dsinks: bool):
    """(dq, dk, dv, dsinks or None)."""
    mod = engine_module(name)
    sinks = p.pattern.sinks
    if name in RAW:
        dq, dk, dv = mod.bwd(p, out, lse, dout, dlse)
        ds = mod.sinks_grad(p, out, lse, dout, dlse) if want_dsinks and sinks is not None else None
        return dq, dk, dv, ds
    # recompute under autograd (the materializing engines are differentiable themselves)
    from dataclasses import replace

    with _autograd_inside(), torch.enable_grad(), _sdpa_rng(p):
        q, k, v = (t.detach().requires_grad_(True) for t in (p.q, p.k, p.v))
        leaves = [q, k, v]
        pt = p.pattern
        if want_dsinks and isinstance(sinks, Tensor):
            s = sinks.detach().requires_grad_(True)
            pt = replace(pt, sinks=s)
            leaves.append(s)
        want_lse = dlse is not None and name not in NO_LSE
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
    tensors = (lengths, key_padding_mask, cu_seqlens, prefix_lengths, mask, alibi_slopes, sinks)
    p = _problem(q, k, v, tensors, dropout_seed, causal, window, chunk, softcap, scale, dropout_p)
    out, lse = _run_fwd(engine, p, return_lse)
    # outputs are contiguous (as the fake ones) and never alias an input
    out = out.contiguous()
    return out.clone() if out is q else out, lse.contiguous()


@fwd.register_fake
def _fwd_fake(q, k, v, *rest):
    engine = rest[-2]
    B, H_q, T_q, _ = q.shape
    out = q.new_empty((B, H_q, T_q, v.shape[-1]))
    shape = (0,) if engine in NO_LSE else (B, H_q, T_q)
    return out, q.new_empty(shape, dtype=lse_dtype(q.dtype))


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
    p = _problem(q, k, v, tensors, dropout_seed, causal, window, chunk, softcap, scale, dropout_p)
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


N_ARGS = 19  # fwd's arguments: q, k, v, 7 pattern tensors, dropout_seed, 8 plain ones


def _setup_context(ctx, inputs, output):
    q, k, v = inputs[:3]
    tensors = inputs[3:10]
    seed = inputs[10]
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, *tensors, seed)
    ctx.scalars = inputs[11:18]  # causal .. engine (return_lse is the forward's own)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, *tensors, seed = ctx.saved_tensors
    if dlse is not None and dlse.numel() == 0:  # an engine without lse
        dlse = None
    want_ds = bool(ctx.needs_input_grad[9]) and tensors[6] is not None
    with torch.no_grad():  # the backward is not differentiable again (no double backward)
        dq, dk, dv, ds = bwd(dout, dlse, q, k, v, out, lse, *tensors, seed, *ctx.scalars, want_ds)
    return (
        dq,
        dk,
        dv,
        None,
        None,
        None,
        None,
        None,
        None,
        ds if want_ds else None,
        *([None] * (N_ARGS - 10)),
    )


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
