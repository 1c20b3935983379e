"""FlexAttention's own catalogue of score_mods and mask_mods, against ``flex_attention``.

The mods FlexAttention tests itself with (PyTorch's test/inductor/test_flex_attention.py),
each written anew here: score_mods (identity, times two, squared, a head offset, trig, a
relative bias, ALiBi, softcap, captured buffers on every axis) and mask_mods (causal, inverse
causal, sliding windows, prefix LM, documents, and_masks / or_masks). Each runs on the
reference, tiled and cpp engines and is compared with ``flex_attention`` in eager mode on the
CPU, in float64: the output, and the gradients of q, k, v and the captured tensors.

Shapes: B = 2, H = 4 query heads over 2 key/value heads (GQA), T_q = 70 < T_k = 101 (a
multiple of no block size). Two doors: ``attention(..., mask_mod=, score_mod=)``, whose
q_idx is the query's position (bottom-right: query i at i + T_k - T_q, the keyword rules'
convention), so Flex is given the same function of positions; and a :class:`Pattern` placed
at ``q_start=0``, whose indices are Flex's own.

Gradients: on the CPU ``flex_attention`` refuses a backward when q, k or v need a gradient
(checked below), so the q, k, v gradients are compared with central differences of Flex's own
forward along random directions; the captured tensors' gradients with Flex's backward, which
it runs when only they need one.
"""

from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass

import pytest
import torch

import causalattn as ca
from causalattn import masks
from causalattn.engines import run
from causalattn.engines.problem import make_problem

fx = pytest.importorskip("torch.nn.attention.flex_attention")

B, H, H_KV, T_Q, T_K, D = 2, 4, 2, 70, 101, 16
OFF = T_K - T_Q  # the keyword door's first query position
ENGINES = ("reference", "tiled", "cpp")
NEG_INF = float("-inf")
DIRS = 1  # random directions per q, k, v along which Flex's forward is differentiated


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---- captured tensors (float ones learn; int ones are data) ---------------------------------
HEAD_SCALE = torch.rand(H, generator=_gen(1), dtype=torch.float64) + 0.5
BATCH_BIAS = torch.randn(B, generator=_gen(2), dtype=torch.float64)
HEAD_BIAS = torch.randn(H, generator=_gen(3), dtype=torch.float64)
QUERY_BIAS = torch.randn(T_K, generator=_gen(4), dtype=torch.float64)  # by position
KEY_BIAS = torch.randn(T_K, generator=_gen(5), dtype=torch.float64)
FULL_BIAS = torch.randn(B, H, T_K, T_K, generator=_gen(6), dtype=torch.float64)
REL_TABLE = torch.randn(2 * T_K, generator=_gen(7), dtype=torch.float64)
SLOPES = torch.exp2(-8.0 * torch.arange(1, H + 1, dtype=torch.float64) / H)  # ALiBi's
BIDIRECTIONAL = torch.tensor([40, 75])  # per batch row: positions read both ways up to here
PREFIX = torch.tensor([12, 50])  # per batch row: the prefix every query reads
# documents per batch row: runs of positions, row 1 with a one-token document
DOC_IDS = torch.stack(
    [
        torch.repeat_interleave(torch.arange(4), torch.tensor([30, 25, 26, 20])),
        torch.repeat_interleave(torch.arange(5), torch.tensor([45, 1, 20, 15, 20])),
    ]
)


# ---- score_mods --------------------------------------------------------------------------------
def identity(score, b, h, q, kv):
    return score


def times_two(score, b, h, q, kv):
    return score * 2


def squared(score, b, h, q, kv):
    return score * score


def head_offset(score, b, h, q, kv):
    return score * HEAD_SCALE[h]


def trig(score, b, h, q, kv):
    return torch.sin(torch.cos(score)) + torch.tan(b)


def trig_branching(score, b, h, q, kv):
    c, s = torch.cos(score), torch.sin(score)
    return c * s + torch.tan(b)


def relative_bias(score, b, h, q, kv):
    return score + (q - kv)


def relative_causal(score, b, h, q, kv):  # a score_mod that masks
    return torch.where(q >= kv, score + (q - kv), NEG_INF)


def alibi(score, b, h, q, kv):
    slope = torch.exp2(-((h + 1) * 8.0 / H))
    return score + (kv - q) * slope


def alibi_table(score, b, h, q, kv):  # ALiBi with its slopes as a (learned) table
    return score + (kv - q) * SLOPES[h]


def softcap(score, b, h, q, kv):
    return 20.0 * torch.tanh(score / 20.0)


def silu(score, b, h, q, kv):
    return torch.nn.functional.silu(score)


def buffers_every_axis(score, b, h, q, kv):
    return score + BATCH_BIAS[b] + HEAD_BIAS[h] + QUERY_BIAS[q] + KEY_BIAS[kv]


def bias_table(score, b, h, q, kv):
    return score + FULL_BIAS[b, h, q, kv]


def relative_table(score, b, h, q, kv):
    return score + REL_TABLE[q - kv + T_K]


def dependent_bidirectional(score, b, h, q, kv):
    n = BIDIRECTIONAL[b]
    return torch.where((q >= kv) | ((q <= n) & (kv <= n)), score, NEG_INF)


# ---- mask_mods ---------------------------------------------------------------------------------
def causal(b, h, q, kv):
    return q >= kv


def inverse_causal(b, h, q, kv):
    return q <= kv


def inverse_causal_strict(b, h, q, kv):  # the keyword door's last query reads nothing
    return q < kv


def far_future(b, h, q, kv):  # every query from position 80 on reads nothing
    return kv > q + 20


def sliding_window(b, h, q, kv):
    return (q >= kv) & (q - kv < 24)


def band(b, h, q, kv):
    return (q - kv).abs() <= 8


def prefix_lm(b, h, q, kv):
    return (kv < PREFIX[b]) | (q >= kv)


def documents(b, h, q, kv):
    return (DOC_IDS[b, q] == DOC_IDS[b, kv]) & (q >= kv)


def early_queries(b, h, q, kv):  # a rule of q_idx alone (its answer has one column)
    return q < 60


def early_keys(b, h, q, kv):  # a rule of kv_idx alone
    return kv < 5


def even_heads(b, h, q, kv):
    return (h % 2 == 0) | (q >= kv)


@dataclass(frozen=True)
class Case:
    name: str
    mask_mod: object = None  # ours (a function of positions)
    score_mod: object = None
    flex_mask: object = None  # Flex's form when it differs from ours (its own combinators)
    learned: tuple = ()  # the captured float tensors whose gradients are compared
    refused_by: tuple = ()  # engines that refuse it (they must name who runs it)


def _flex_and(*mods):
    return ("and", mods)


def _flex_or(*mods):
    return ("or", mods)


CASES = [
    Case("identity", score_mod=identity),
    Case("times_two", score_mod=times_two),
    Case("squared", score_mod=squared),
    Case("head_offset", score_mod=head_offset, learned=("HEAD_SCALE",)),
    Case("trig", score_mod=trig, refused_by=("cpp",)),
    Case("trig_branching", score_mod=trig_branching, refused_by=("cpp",)),
    Case("relative_bias", score_mod=relative_bias),
    Case("relative_causal", score_mod=relative_causal),
    Case("alibi", score_mod=alibi, refused_by=("cpp",)),  # exp2: not in its program
    Case("alibi_table", score_mod=alibi_table, learned=("SLOPES",)),
    Case("softcap", score_mod=softcap),
    Case("silu", score_mod=silu, refused_by=("cpp",)),
    Case(
        "buffers_every_axis",
        score_mod=buffers_every_axis,
        learned=("BATCH_BIAS", "HEAD_BIAS", "QUERY_BIAS", "KEY_BIAS"),
    ),
    Case("bias_table", score_mod=bias_table, learned=("FULL_BIAS",)),
    Case("relative_table", score_mod=relative_table, learned=("REL_TABLE",)),
    Case("dependent_bidirectional", score_mod=dependent_bidirectional),
    Case("causal", mask_mod=causal),
    Case("inverse_causal", mask_mod=inverse_causal),
    Case("inverse_causal_strict", mask_mod=inverse_causal_strict),
    Case("far_future", mask_mod=far_future),
    Case("sliding_window", mask_mod=sliding_window),
    Case("band", mask_mod=band),
    Case("prefix_lm", mask_mod=prefix_lm),
    Case("documents", mask_mod=documents),
    Case("even_heads", mask_mod=even_heads),
    Case("early_queries", mask_mod=early_queries),
    Case("early_keys", mask_mod=early_keys),
    Case(
        "and_masks",
        mask_mod=masks.and_masks(causal, band),
        flex_mask=_flex_and(causal, band),
    ),
    Case(
        "or_masks",
        mask_mod=masks.or_masks(inverse_causal_strict, early_keys),
        flex_mask=_flex_or(inverse_causal_strict, early_keys),
    ),
    Case("and_masks_of_none", mask_mod=masks.and_masks(), flex_mask=_flex_and()),
    Case("or_masks_of_none", mask_mod=masks.or_masks(), flex_mask=_flex_or()),
    Case("window_alibi", mask_mod=sliding_window, score_mod=alibi, refused_by=("cpp",)),
    Case("window_alibi_table", mask_mod=sliding_window, score_mod=alibi_table),
    Case(
        "documents_head_offset",
        mask_mod=documents,
        score_mod=head_offset,
        learned=("HEAD_SCALE",),
    ),
]
BY_NAME = {c.name: c for c in CASES}


# ---- the two sides -----------------------------------------------------------------------------
def _inputs():
    g = _gen(0)
    q = torch.randn(B, H, T_Q, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, H_KV, T_K, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, H_KV, T_K, D, generator=g, dtype=torch.float64)
    d_out = torch.randn(B, H, T_Q, D, generator=g, dtype=torch.float64)
    return q, k, v, d_out


def _learned(case: Case) -> list[torch.Tensor]:
    return [globals()[n] for n in case.learned]


def _shift(fn, door: str, *, score: bool):
    """``fn`` as Flex calls it: Flex's q_idx is the query's index; the keyword door's is its
    position (i + T_k - T_q), so Flex's index is moved there first."""
    if fn is None or door == "pattern":
        return fn
    if score:
        return lambda s, b, h, q, kv: fn(s, b, h, q + OFF, kv)
    return lambda b, h, q, kv: fn(b, h, q + OFF, kv)


def _flex_mask_mod(case: Case, door: str):
    if case.flex_mask is not None:
        op, mods = case.flex_mask
        parts = [_shift(m, door, score=False) for m in mods]
        return fx.and_masks(*parts) if op == "and" else fx.or_masks(*parts)
    return _shift(case.mask_mod, door, score=False)


@functools.cache
def _flex_block_mask(name: str, door: str):
    mm = _flex_mask_mod(BY_NAME[name], door)
    return None if mm is None else fx.create_block_mask(mm, B, H, T_Q, T_K, device="cpu")


def _flex(case: Case, door: str, q, k, v):
    bm = _flex_block_mask(case.name, door)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager flex_attention warns that it is unfused
        return fx.flex_attention(
            q,
            k,
            v,
            score_mod=_shift(case.score_mod, door, score=True),
            block_mask=bm,
            enable_gqa=True,
        )


@functools.cache
def _flex_truth(name: str, door: str):
    """Flex's output, its directional derivatives of <out, d_out> along DIRS random
    directions per q, k, v (central differences of its forward), and its gradients of the
    captured tensors (its own backward)."""
    case = BY_NAME[name]
    q, k, v, d_out = _inputs()
    with torch.no_grad():
        out = _flex(case, door, q, k, v)
    eps = 1e-5
    g = _gen(11)
    slopes = []
    for which in range(3):
        for _ in range(DIRS):
            x = [q, k, v]
            u = torch.randn(x[which].shape, generator=g, dtype=torch.float64)
            hi, lo = list(x), list(x)
            hi[which], lo[which] = x[which] + eps * u, x[which] - eps * u
            with torch.no_grad():
                f_hi = (_flex(case, door, *hi) * d_out).sum()
                f_lo = (_flex(case, door, *lo) * d_out).sum()
            slopes.append((which, u, float((f_hi - f_lo) / (2 * eps))))
    captured = []
    for t in _learned(case):
        t.requires_grad_(True)
        try:
            (grad,) = torch.autograd.grad((_flex(case, door, q, k, v) * d_out).sum(), [t])
        finally:
            t.requires_grad_(False)
        captured.append(grad)
    return out, slopes, captured


def _ours(case: Case, door: str, engine: str, q, k, v):
    if door == "keywords":
        return ca.attention(
            q,
            k,
            v,
            causal=False,
            mask_mod=case.mask_mod,
            score_mod=case.score_mod,
            engine=engine,
        )
    pattern = masks.Pattern(
        causal=False, q_start=0, mask_mod=case.mask_mod, score_mod=case.score_mod
    )
    return run(make_problem(q, k, v, pattern=pattern), engine=engine)


# ---- the tests ---------------------------------------------------------------------------------
def test_flex_on_the_cpu_refuses_a_backward_through_q_k_v():
    """Why the q, k, v gradients are compared with differences of Flex's forward: a backward
    on the CPU is refused (when a later torch runs it, compare with it directly)."""
    q, k, v, _ = _inputs()
    with pytest.raises(NotImplementedError, match="does not support backward on CPU"):
        fx.flex_attention(q.requires_grad_(), k, v, enable_gqa=True)


# the placed Pattern's door on the cases whose indices matter (tables and rules read by
# position; one refusal): Flex's indices unmoved
PLACED = (
    "trig",
    "relative_bias",
    "alibi_table",
    "buffers_every_axis",
    "relative_table",
    "causal",
    "inverse_causal_strict",
    "prefix_lm",
    "documents",
    "or_masks",
    "window_alibi_table",
)
CALLS = [(c.name, "keywords") for c in CASES] + [(n, "pattern") for n in PLACED]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("name,door", CALLS)
def test_the_catalogue_matches_flex_attention(name, door, engine):
    case = BY_NAME[name]
    q, k, v, d_out = _inputs()
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    learned = _learned(case)
    for t in learned:
        t.requires_grad_(True)
    try:
        if engine in case.refused_by:
            with pytest.raises(ValueError, match=f"engine '{engine}'") as info:
                _ours(case, door, engine, q, k, v)
            runs = [e for e in ENGINES if e not in case.refused_by]
            assert all(repr(e) in str(info.value) for e in runs), str(info.value)
            return
        out = _ours(case, door, engine, q, k, v)
        grads = torch.autograd.grad((out * d_out).sum(), [q, k, v, *learned])
    finally:
        for t in learned:
            t.requires_grad_(False)
    want, slopes, want_captured = _flex_truth(name, door)
    torch.testing.assert_close(out.detach(), want, rtol=1e-7, atol=1e-9)
    for which, u, slope in slopes:
        got = float((grads[which] * u).sum())
        assert math.isclose(got, slope, rel_tol=1e-6, abs_tol=1e-7), ("qkv"[which], got, slope)
    for n, got, w in zip(case.learned, grads[3:], want_captured):
        torch.testing.assert_close(got, w, rtol=1e-7, atol=1e-9, msg=f"gradient of {n}")


def test_fully_masked_rows_are_zero_as_in_flex():
    """Rows that read nothing (the keyword door's queries from position 80 on, under
    far_future): Flex gives zeros there and a log-sum-exp of -inf, and so do we, with zero
    gradients."""
    q, k, v, _ = _inputs()
    rows = (torch.arange(T_Q) + OFF) >= T_K - 21  # kv > pos + 20 finds no key
    assert rows.any()
    want, _, _ = _flex_truth("far_future", "keywords")
    assert bool((want[:, :, rows] == 0).all())
    bm = _flex_block_mask("far_future", "keywords")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, flex_lse = fx.flex_attention(q, k, v, block_mask=bm, enable_gqa=True, return_lse=True)
    assert bool((flex_lse[:, :, rows] == NEG_INF).all())
    for engine in ENGINES:
        qg = q.clone().requires_grad_()
        out, lse = ca.attention(
            qg, k, v, causal=False, mask_mod=far_future, engine=engine, return_lse=True
        )
        assert bool((out[:, :, rows] == 0).all()), engine
        assert bool((lse[:, :, rows] == NEG_INF).all()), engine  # Flex's -inf, as ours
        torch.testing.assert_close(lse[:, :, ~rows], flex_lse[:, :, ~rows].float())
        (dq,) = torch.autograd.grad(out.sum(), [qg])
        assert bool((dq[:, :, rows] == 0).all()), engine


@pytest.mark.parametrize(
    "ours,theirs", [(masks.and_masks, "and_masks"), (masks.or_masks, "or_masks")]
)
def test_and_masks_or_masks_are_flexs(ours, theirs):
    b = torch.arange(B).view(B, 1, 1, 1)
    h = torch.arange(H).view(1, H, 1, 1)
    q = torch.arange(T_Q).view(1, 1, T_Q, 1)
    kv = torch.arange(T_K).view(1, 1, 1, T_K)
    flex_of = getattr(fx, theirs)
    for mods in [(), (causal,), (causal, band), (prefix_lm, even_heads, early_keys)]:
        got = ours(*mods)(b, h, q, kv)
        want = flex_of(*mods)(b, h, q, kv)
        assert bool((got.expand(B, H, T_Q, T_K) == want.expand(B, H, T_Q, T_K)).all())
    with pytest.raises(ValueError, match=rf"{theirs}: argument 1 must be a mask_mod .* got int"):
        ours(causal, 3)
