"""The engines as two PyTorch operators, so compile, export, meta tensors and torch.func work.

    causalattn::fwd(q, k, v, <pattern tensors>, captured, dropout_seed, <scalars>, mods,
                    engine, return_lse) -> (out, lse)
    causalattn::bwd(dout, dlse, q, k, v, out, lse, <pattern tensors>, captured, dropout_seed,
                    <scalars>, mods, engine, want) -> [dq, dk, dv, d<learned>..., d<captured>...]

q ``(B, H_q, T_q, d_k)``, k ``(B, H_kv, T_k, d_k)``, v ``(B, H_kv, T_k, d_v)``; out
``(B, H_q, T_q, d_v)`` in q's dtype; lse ``(B, H_q, T_q)`` in the compute dtype (fp64 for
fp64 inputs, else fp32), or ``(0,)`` for an engine that does not compute it (sdpa).

Dynamo and torch.export see one opaque operator whose output shapes come from the fake
implementations and whose backward is registered on it: no graph break, no guard on data.
Everything that reads data — the range of ``lengths``, the order of ``cu_seqlens``,
finiteness — runs inside the operator, where the :class:`Problem` is rebuilt from the
arguments and checked by :func:`make_problem`. The forward's 23 arguments are one
:class:`OpArgs`: built by name, unpacked by name.

A ``mask_mod`` or ``score_mod`` is a Python function, which no operator argument can be: the
pair goes in by number (:func:`mods_id`, a constant while tracing: Dynamo calls it at trace
time) and runs inside the operator, block by block, at run time — so a compiled graph reads
the tensors the functions capture as they are when it runs. The tensors a score_mod reads
that need a gradient go in as ``captured`` (found by
:func:`causalattn.masks_mod.captured_tensors`), so that autograd knows the operator depends
on them and the backward returns their gradients. The number lives in this process only: an
exported program with a mask_mod runs here, not after a reload.

Engines with raw passes (tiled, cpp, triton) run them; the others (reference, sdpa) are run
under autograd inside the operator and differentiated there (recomputation).
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from dataclasses import replace
from typing import NamedTuple

import torch
from torch import Tensor

from .. import dropout as _dropout
from .._internals.torch import autograd_inside, constant_result
from . import autograd as _autograd
from .problem import compute_dtype as lse_dtype
from .problem import make_problem
from .registry import ENGINES, LEARNED, TENSORS, captured_of, engine, of_problem

__all__ = ["OpArgs", "ENGINES", "TENSORS", "fwd", "bwd", "refusal", "engine_module", "mods_id"]


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
    bias: Tensor | None
    rel_bias: Tensor | None
    captured: list  # the tensors a score_mod reads that need a gradient
    dropout_seed: Tensor | None
    causal: bool
    window: int | None
    chunk: int | None
    softcap: float | None
    scale: float
    dropout_p: float
    mods: int  # the mask_mod and score_mod, by number (mods_id); 0 for neither
    engine: str
    return_lse: bool

    def tensors(self) -> tuple:
        """The pattern tensors, in TENSORS order."""
        return tuple(getattr(self, n) for n in TENSORS)

    def scalars(self) -> tuple:
        """causal .. engine: what the backward operator takes after the dropout seed."""
        return (
            self.causal,
            self.window,
            self.chunk,
            self.softcap,
            self.scale,
            self.dropout_p,
            self.mods,
            self.engine,
        )

    @classmethod
    def grads(cls, dq, dk, dv, named: dict, captured) -> tuple:
        """The backward's return: a gradient per argument (None where there is none)."""
        none = cls(*[None] * len(cls._fields))
        return tuple(none._replace(q=dq, k=dk, v=dv, captured=captured, **named))


assert TENSORS == OpArgs._fields[3:12]
CAPTURED = len(LEARNED)  # the bit of `want` that asks for the captured tensors' gradients


# ---- mask_mod and score_mod, by number ---------------------------------------------------
# At most MODS_MAX pairs are held (the oldest dropped): a number outlives its function only
# in a graph compiled more than MODS_MAX functions ago, which then says so.
_MODS: OrderedDict[int, tuple] = OrderedDict()
MODS_MAX = 1024
_NEXT = [1]


@constant_result
def mods_id(mask_mod, score_mod) -> int:
    """The number of a (mask_mod, score_mod) pair (0 for neither); the same pair keeps its
    number while it is held."""
    if mask_mod is None and score_mod is None:
        return 0
    for key, pair in _MODS.items():
        if pair[0] is mask_mod and pair[1] is score_mod:
            _MODS.move_to_end(key)
            return key
    key = _NEXT[0]
    _NEXT[0] += 1
    _MODS[key] = (mask_mod, score_mod)
    while len(_MODS) > MODS_MAX:
        _MODS.popitem(last=False)
    return key


def mods_of(key: int) -> tuple:
    """(mask_mod, score_mod) of a number from :func:`mods_id`."""
    if key == 0:
        return None, None
    try:
        return _MODS[key]
    except KeyError:
        raise ValueError(
            f"attention: mask_mod/score_mod number {key} is no longer held (more than "
            f"{MODS_MAX} other functions since it was traced); call attention again, or "
            "recompile"
        ) from None


def engine_module(name: str):
    """The engine's module; ValueError naming it when unknown or not importable here."""
    return engine(name).load()


def refusal(name: str, p, return_lse: bool) -> str:
    """Why engine ``name`` does not run ``p`` ("" when it does)."""
    return engine(name).refusal(of_problem(p, return_lse))


@contextlib.contextmanager
def naming(engine_name: str):
    """A user's mask_mod or score_mod refused inside (its ValueError, which names the
    argument) says which engine was running it."""
    try:
        yield
    except ValueError as exc:
        msg = str(exc)
        if msg.startswith(("mask_mod:", "score_mod:")) and " (engine '" not in msg:
            raise ValueError(f"{msg} (engine {engine_name!r})") from exc
        raise


def _problem(tensors, seed, q, k, v, causal, window, chunk, softcap, scale, dropout_p, mods):
    """The checked :class:`Problem` of the operators' arguments (this is where data is read)."""
    given = {n: t for n, t in zip(TENSORS, tensors) if t is not None}
    mask_mod, score_mod = mods_of(mods)
    p = make_problem(
        q,
        k,
        v,
        causal=causal,
        window=window,
        chunk=chunk,
        softcap=softcap,
        scale=scale,
        mask_mod=mask_mod,
        score_mod=score_mod,
        **given,
    )
    if dropout_p:
        p = replace(
            p, dropout_p=_dropout.check_p(dropout_p), dropout_seed=(int(seed[0]), int(seed[1]))
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


def _wanted(p, want: int) -> list[str]:
    """What ``want`` asks gradients for: LEARNED names, "captured" once per captured tensor."""
    pt = p.pattern
    names = [n for i, n in enumerate(LEARNED) if want >> i & 1 and getattr(pt, n) is not None]
    if want >> CAPTURED & 1:
        names += ["captured"] * len(captured_of(pt.score_mod))
    return names


def _run_bwd(name: str, p, out, lse, dout, dlse, names: list[str]):
    """(dq, dk, dv, [a gradient per entry of names])."""
    e = engine(name)
    mod = e.load()
    if e.raw:
        with autograd_inside():  # a score_mod's tiles are differentiated by autograd
            return _autograd.backward(mod, p, out, lse, dout, dlse, names)
    # recompute under autograd (the materializing engines are differentiable themselves)
    with autograd_inside(), torch.enable_grad(), _sdpa_rng(p):
        q, k, v = (t.detach().requires_grad_(True) for t in (p.q, p.k, p.v))
        swap = {
            n: torch.as_tensor(getattr(p.pattern, n)).detach().requires_grad_(True)
            for n in dict.fromkeys(names)
            if n != "captured"
        }
        pt = replace(p.pattern, **swap)
        caps = captured_of(pt.score_mod) if "captured" in names else []
        leaves = [q, k, v, *swap.values(), *caps]
        want_lse = dlse is not None and e.lse
        res = mod.forward(replace(p, q=q, k=k, v=v, pattern=pt), want_lse)
        outs, grads = ([res[0], res[1]], [dout, dlse.float()]) if want_lse else ([res], [dout])
        g = torch.autograd.grad(outs, leaves, grads, allow_unused=True)
    g = [torch.zeros_like(t) if x is None else x for x, t in zip(g, leaves)]
    named = dict(zip(swap, g[3 : 3 + len(swap)]))
    it = iter(g[3 + len(swap) :])
    return g[0], g[1], g[2], [next(it) if n == "captured" else named[n] for n in names]


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
    bias: Tensor | None,
    rel_bias: Tensor | None,
    captured: list[Tensor],
    dropout_seed: Tensor | None,
    causal: bool,
    window: int | None,
    chunk: int | None,
    softcap: float | None,
    scale: float,
    dropout_p: float,
    mods: int,
    engine: str,
    return_lse: bool,
) -> tuple[Tensor, Tensor]:
    """One engine's forward: ``(out (B, H_q, T_q, d_v), lse (B, H_q, T_q) or (0,))``.

    ``dropout_seed``: int64 (2,) = (seed, offset) when dropout_p > 0 (a tensor, so that a
    compiled graph draws it on every call); ``return_lse``: whether the caller asked for
    the log-sum-exp (an engine may refuse it); ``mods``, ``captured``: see the module doc."""
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
        bias,
        rel_bias,
        captured,
        dropout_seed,
        causal,
        window,
        chunk,
        softcap,
        scale,
        dropout_p,
        mods,
        engine,
        return_lse,
    )
    with naming(engine):
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
    bias: Tensor | None,
    rel_bias: Tensor | None,
    captured: list[Tensor],
    dropout_seed: Tensor | None,
    causal: bool,
    window: int | None,
    chunk: int | None,
    softcap: float | None,
    scale: float,
    dropout_p: float,
    mods: int,
    engine: str,
    want: int,
) -> list[Tensor]:
    """One engine's backward from the saved ``out`` and ``lse``: ``[dq, dk, dv]``, one
    gradient per LEARNED tensor (sinks, alibi_slopes, bias, rel_bias: shaped as it, or (0,)
    where absent or not asked for; bit i of ``want`` asks for LEARNED[i]), then, with bit
    CAPTURED, one per captured tensor."""
    tensors = (
        lengths,
        key_padding_mask,
        cu_seqlens,
        prefix_lengths,
        mask,
        alibi_slopes,
        sinks,
        bias,
        rel_bias,
    )
    scalars = (causal, window, chunk, softcap, scale, dropout_p, mods)
    with naming(engine):
        p = _problem(tensors, dropout_seed, q, k, v, *scalars)
        names = _wanted(p, want)
        dq, dk, dv, grads = _run_bwd(engine, p, out, lse, dout, dlse, names)
    named = {n: g for n, g in zip(names, grads) if n != "captured"}
    caps = [g for n, g in zip(names, grads) if n == "captured"]
    res = [dq.to(q.dtype).contiguous(), dk.to(k.dtype).contiguous(), dv.to(v.dtype).contiguous()]
    for n, t in zip(LEARNED, (sinks, alibi_slopes, bias, rel_bias)):
        g = named.get(n)
        res.append(q.new_zeros((0,)) if g is None else g.to(t.dtype).reshape(t.shape).contiguous())
    if want >> CAPTURED & 1:
        if len(caps) != len(captured):
            raise ValueError(
                f"score_mod: it reads {len(caps)} tensors that need a gradient now but read "
                f"{len(captured)} when it was called; keep what it captures fixed"
            )
        res += [g.to(c.dtype).reshape(c.shape).contiguous() for g, c in zip(caps, captured)]
    return res


@bwd.register_fake
def _bwd_fake(dout, dlse, q, k, v, out, lse, *rest):
    pattern = dict(zip(TENSORS, rest[: len(TENSORS)]))
    captured, want = rest[len(TENSORS)], rest[-1]
    res = [q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)]
    for i, n in enumerate(LEARNED):
        t = pattern[n]
        res.append(t.new_empty(t.shape) if want >> i & 1 and t is not None else q.new_empty((0,)))
    if want >> CAPTURED & 1:
        res += [c.new_empty(c.shape) for c in captured]
    return res


def _setup_context(ctx, inputs, output):
    a = OpArgs(*inputs)
    out, lse = output
    ctx.save_for_backward(a.q, a.k, a.v, out, lse, *a.tensors(), a.dropout_seed, *a.captured)
    ctx.args = a._replace(
        q=None, k=None, v=None, **{n: None for n in TENSORS}, captured=None, dropout_seed=None
    )  # the plain arguments


def _asks(flag) -> bool:
    """needs_input_grad of an argument: a bool, or one per entry of a list argument."""
    return any(flag) if isinstance(flag, (list, tuple)) else bool(flag)


def _backward(ctx, dout, dlse, needs=None):
    """The forward operator's gradients, one per OpArgs field; ``needs``: needs_input_grad
    per field (the context's own by default)."""
    needs = ctx.needs_input_grad if needs is None else needs
    q, k, v, out, lse, *rest = ctx.saved_tensors
    n = len(TENSORS)
    tensors, seed, captured = rest[:n], rest[n], list(rest[n + 1 :])
    if dlse is not None and dlse.numel() == 0:  # an engine without lse
        dlse = None
    fields = OpArgs._fields
    want = 0
    for i, name in enumerate(LEARNED):
        if tensors[TENSORS.index(name)] is not None and _asks(needs[fields.index(name)]):
            want |= 1 << i
    if captured and _asks(needs[fields.index("captured")]):
        want |= 1 << CAPTURED
    with torch.no_grad():  # the backward is not differentiable again (no double backward)
        res = bwd(
            dout, dlse, q, k, v, out, lse, *tensors, captured, seed, *ctx.args.scalars(), want
        )
    named = {name: (res[3 + i] if want >> i & 1 else None) for i, name in enumerate(LEARNED)}
    caps = list(res[3 + len(LEARNED) :]) if want >> CAPTURED & 1 else [None] * len(captured)
    return OpArgs.grads(res[0], res[1], res[2], named, caps)


fwd.register_autograd(_backward, setup_context=_setup_context)


# ---- torch.func: grad through an autograd.Function, vmap by a loop over the mapped axis --


class FuncAttention(torch.autograd.Function):
    """The forward operator with the same backward, for torch.func transforms (grad, vjp,
    vmap), which need an autograd.Function with setup_context (an operator's registered
    autograd does not compose with them). Called as ``apply(*flat(args))``: an
    autograd.Function gives no gradient to a list argument, so the captured tensors go in
    one by one after the other fields."""

    generate_vmap_rule = True  # both operators have vmap rules (below)

    @staticmethod
    def flat(a: OpArgs) -> tuple:
        """``a``'s fields with ``captured`` as its count, then the captured tensors."""
        return (*a._replace(captured=len(a.captured)), *a.captured)

    @staticmethod
    def _args(flat: tuple) -> OpArgs:
        n = len(OpArgs._fields)
        return OpArgs(*flat[:n])._replace(captured=list(flat[n:]))

    @staticmethod
    def forward(*flat):
        return fwd(*FuncAttention._args(flat))

    @staticmethod
    def setup_context(ctx, inputs, output):
        _setup_context(ctx, FuncAttention._args(inputs), output)

    @staticmethod
    def backward(ctx, dout, dlse):
        n, i = len(OpArgs._fields), OpArgs._fields.index("captured")
        needs = list(ctx.needs_input_grad[:n])
        needs[i] = tuple(ctx.needs_input_grad[n:])
        g = OpArgs(*_backward(ctx, dout, dlse, needs))
        return (*g._replace(captured=None), *g.captured)


def _select(a, d, i):
    """Entry i of argument a mapped along d (a list argument: per element)."""
    if isinstance(d, (list, tuple)):
        return [x if di is None else x.select(di, i) for x, di in zip(a, d)]
    return a if d is None else a.select(d, i)


def _loop_vmap(op, n_out: int | None):
    """A vmap rule for ``op``: the mapped axis moved to the front, one call per entry
    (``n_out`` outputs, or a list of them for None)."""

    def rule(info, in_dims, *args):
        size = info.batch_size
        outs = []
        for i in range(size):
            call = [_select(a, d, i) for a, d in zip(args, in_dims)]
            outs.append(op(*call))
        n = len(outs[0]) if outs else (n_out or 0)
        stacked = [torch.stack([o[j] for o in outs]) for j in range(n)]
        out = tuple(stacked) if n_out is not None else stacked
        return out, ((0,) * n if n_out is not None else [0] * n)

    return rule


torch.library.register_vmap(fwd, _loop_vmap(fwd, 2))
torch.library.register_vmap(bwd, _loop_vmap(bwd, None))
