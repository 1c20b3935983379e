"""Bad mask_mods and score_mods: each a ValueError that names the argument, the engine and
the shapes, on every engine that takes the mods; nothing computed silently wrong.

- mask_mod: impure (answers differently when asked again: random, stateful, or pure only on
  the first cells), raises (the cause kept), returns no booleans, or a shape that does not
  broadcast to the cells asked about;
- score_mod: changes the scores' shape or dtype (a wider captured tensor too: nothing is
  cast back), returns no tensor or no floats, raises.
"""

from __future__ import annotations

import re

import pytest
import torch

import causalattn as ca

ENGINES = ("reference", "tiled", "cpp")
B, H, H_KV, T_Q, T_K, D = 2, 4, 2, 20, 33, 8
OFF = T_K - T_Q  # the first query position (bottom-right)


def _qkv(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, T_Q, D, generator=g, dtype=dtype)
    k = torch.randn(B, H_KV, T_K, D, generator=g, dtype=dtype)
    v = torch.randn(B, H_KV, T_K, D, generator=g, dtype=dtype)
    return q, k, v


def _refused(engine, match, **mods):
    """The ValueError of ``attention`` on ``engine`` with ``mods``: it names the argument
    (``match`` starts with it), the engine, and shapes."""
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=match) as info:
        ca.attention(q, k, v, causal=False, engine=engine, **mods)
    msg = str(info.value)
    assert msg.startswith(("mask_mod:", "score_mod:")), msg
    assert f"(engine '{engine}')" in msg, msg
    assert re.search(r"\(\d+(, \d+)*\)", msg), f"no shape in: {msg}"
    return info.value


def _root(exc: BaseException) -> BaseException:
    """The first error of a chain (``raise ... from``): the user's function's own."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    return exc


# ---- mask_mod ---------------------------------------------------------------------------------
def _stateful():
    calls = [0]

    def flip(b, h, q, kv):  # a counter in its closure: every other call answers otherwise
        calls[0] += 1
        return (q >= kv) if calls[0] % 2 else (q > kv)

    return flip


def _late_random(b, h, q, kv):  # pure on the first 16 positions (the pattern's own check)
    noise = torch.rand(q.shape[2], kv.shape[3]) > 0.5
    return torch.where(q >= OFF + 16, noise, q >= kv)


IMPURE = {
    "random": lambda b, h, q, kv: torch.rand(q.shape[2], kv.shape[3]) > 0.5,
    "stateful": _stateful,
    "late": lambda: _late_random,  # (the same function on every engine: counts carry over)
}


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("kind", IMPURE)
def test_an_impure_mask_mod_is_refused(kind, engine):
    fn = IMPURE[kind]
    fn = fn() if kind != "random" else fn
    _refused(
        engine,
        r"mask_mod: \w+ answered differently on a second evaluation of the same cells "
        r"\(index tensors b \(2, 1, 1, 1\), h \(1, 4, 1, 1\), q_idx \(1, 1, \d+, 1\)",
        mask_mod=fn,
    )


@pytest.mark.parametrize("engine", ENGINES)
def test_a_mask_mod_that_raises_is_named_with_its_cause(engine):
    err = _refused(
        engine,
        r"mask_mod: lambda raised ZeroDivisionError: division by zero \(called on b "
        r"\(2, 1, 1, 1\), h \(1, 4, 1, 1\), q_idx \(1, 1, \d+, 1\), kv_idx \(1, 1, 1, \d+\)\)",
        mask_mod=lambda b, h, q, kv: 1 / 0,
    )
    assert isinstance(_root(err), ZeroDivisionError)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize(
    "fn,what",
    [
        (lambda b, h, q, kv: (q - kv).float(), r"Tensor \(1, 1, \d+, \d+\) of dtype torch.float32"),
        (lambda b, h, q, kv: q - kv, r"Tensor \(1, 1, \d+, \d+\) of dtype torch.int64"),
        (lambda b, h, q, kv: True, "bool of dtype bool"),
        (lambda b, h, q, kv: None, "NoneType of dtype NoneType"),
    ],
    ids=["float", "int", "python-bool", "none"],
)
def test_a_mask_mod_that_returns_no_booleans_is_refused(fn, what, engine):
    _refused(
        engine,
        rf"mask_mod: lambda returned {what} for index tensors b \(2, 1, 1, 1\), h \(1, 4, 1, 1\), "
        r"q_idx \(1, 1, \d+, 1\), kv_idx \(1, 1, 1, \d+\); it must return booleans",
        mask_mod=fn,
    )


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize(
    "fn,shape",
    [
        (lambda b, h, q, kv: torch.ones(3, 5, dtype=torch.bool), r"\(3, 5\)"),
        (lambda b, h, q, kv: (q >= kv).transpose(-1, -2), r"\(1, 1, \d+, \d+\)"),
        (lambda b, h, q, kv: (q >= kv)[..., None], r"\(1, 1, \d+, \d+, 1\)"),
    ],
    ids=["fixed", "transposed", "extra-axis"],
)
def test_a_mask_mod_of_the_wrong_shape_is_refused(fn, shape, engine):
    _refused(
        engine,
        rf"mask_mod: lambda returned shape {shape} for index tensors b \(2, 1, 1, 1\), h "
        r"\(1, 4, 1, 1\).* it must broadcast to \(nb, H, rows, cols\)",
        mask_mod=fn,
    )


# ---- score_mod --------------------------------------------------------------------------------
@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize(
    "fn,match",
    [
        (lambda s, b, h, q, kv: s.sum(-1), r"returned shape \(2, 4, \d+\) for scores of shape"),
        (lambda s, b, h, q, kv: s[..., :1], r"returned shape \(2, 4, \d+, 1\) for scores of shape"),
        (lambda s, b, h, q, kv: s.to(torch.float16), "returned dtype torch.float16 for scores"),
        (lambda s, b, h, q, kv: s > 0, "returned dtype torch.bool for scores"),
        (lambda s, b, h, q, kv: 3.0, r"returned float, not an array, for scores of shape"),
        (lambda s, b, h, q, kv: None, r"returned NoneType, not an array, for scores of shape"),
    ],
    ids=["reduced", "sliced", "half", "bool", "float", "none"],
)
def test_a_score_mod_that_changes_the_scores_kind_is_refused(fn, match, engine):
    _refused(engine, f"score_mod: lambda {match}", score_mod=fn)


@pytest.mark.parametrize("engine", ENGINES)
def test_a_score_mod_that_raises_is_named_with_its_cause(engine):
    err = _refused(
        engine,
        r"score_mod: lambda raised KeyError: 'x' \(called on score \(\d+, \d+, \d+, \d+\)",
        score_mod=lambda s, b, h, q, kv: {}["x"],
    )
    assert isinstance(_root(err), KeyError)


WIDE = torch.randn(H, dtype=torch.float64)  # a float64 table read by float32 scores


def widened(s, b, h, q, kv):
    return s + WIDE[h]


@pytest.mark.parametrize("engine", ("tiled", "cpp"))
def test_a_wider_captured_tensor_is_not_cast_back_silently(engine):
    """float32 scores + a float64 table are float64: refused on the float32 engines (the
    message says what to do), where the cast back used to be silent."""
    _refused(
        engine,
        r"score_mod: widened returned dtype torch.float64 for scores of shape \(.*\) and "
        r"dtype torch.float32; it must keep the scores' dtype \(cast what it reads",
        score_mod=widened,
    )


def test_a_wider_captured_tensor_runs_where_the_scores_are_as_wide():
    """The same function at float64 (inputs of float64; the reference engine's scores are
    float64 always): nothing is cast, so it runs, and the engines agree."""
    q, k, v = _qkv(torch.float64)
    want = ca.attention(q, k, v, causal=False, engine="reference", score_mod=widened)
    for engine in ("tiled", "cpp"):
        got = ca.attention(q, k, v, causal=False, engine=engine, score_mod=widened)
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-11)
    q32, k32, v32 = (t.float() for t in (q, k, v))
    got = ca.attention(q32, k32, v32, causal=False, engine="reference", score_mod=widened)
    torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-6)
