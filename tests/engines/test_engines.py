"""The peer engines (reference, sdpa) against each other, and the guarantees they share."""

import numpy as np
import pytest
import torch

import causalattn as ca


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"lengths": [7, 3]},
        {"key_padding_mask": torch.tensor([[True] * 7, [True] * 4 + [False] * 3])},
    ],
)
def test_sdpa_and_reference_agree(kw):
    torch.manual_seed(2)
    q, k, v = torch.randn(2, 6, 5, 8), torch.randn(2, 3, 7, 8), torch.randn(2, 3, 7, 6)
    ref = ca.attention(q.double(), k.double(), v.double(), engine="reference", **kw)
    got = ca.attention(q, k, v, engine="sdpa", **kw)
    assert (got.double() - ref).abs().max() < 1e-5


def test_unknown_engine_is_named():
    q = torch.randn(1, 1, 3, 4)
    with pytest.raises(ValueError, match="unknown engine 'fast'"):
        ca.attention(q, q, q, engine="fast")


def test_trace_with_heads_reads_mask_axes_by_x_and_refuses_extra_ones():
    import numpy as np

    X = np.random.default_rng(0).normal(size=(4, 6))
    W = np.eye(6)
    with pytest.raises(ValueError, match="mask: with n_heads=2"):
        ca.trace(X, W, W, W, n_heads=2, mask=np.ones((3, 2, 4, 4), bool))
    per_head = np.ones((2, 4, 4), bool)
    per_head[1] = ca.masks.causal(4)
    tr = ca.trace(X, W, W, W, n_heads=2, mask=per_head)  # X has no batch axis: (h, T, T)
    assert tr.A.shape == (2, 4, 4) and tr.A[0, 0, 3] > 0 and tr.A[1, 0, 3] == 0


# ---- the Problem every engine is handed ---------------------------------------------------
def _qkv(B=2, Hq=4, Hkv=2, Tq=5, Tk=7, d=3, dv=2, dtype=torch.float32):
    return torch.zeros(B, Hq, Tq, d, dtype=dtype), *(
        torch.zeros(B, Hkv, Tk, n, dtype=dtype) for n in (d, dv)
    )


def test_problem_geometry_placement_and_the_legacy_view():
    from causalattn.engines import make_problem
    from causalattn.masks import Pattern

    q, k, v = _qkv()
    p = make_problem(q, k, v)
    assert (p.dims, p.group, p.offset, p.scale) == ((2, 4, 5, 7), 2, 2, 1 / 3**0.5)
    assert p.dropout_rows().tolist() == [2, 3, 4, 5, 6] and p.dropout_rows(1, 3).tolist() == [3, 4]
    assert p.dropout_cols().tolist() == list(range(7)) and p.dropout_cols(2, 4).tolist() == [2, 3]
    assert p.causal and p.lengths is None and p.key_padding_mask is None and p.cu_seqlens is None
    assert p.is_legacy and p.allowed().shape == (1, 1, 5, 7)
    placed = make_problem(q, k, v, pattern=Pattern(q_start=10, k_start=4))
    assert placed.offset == 6 and not placed.is_legacy
    assert placed.dropout_rows().tolist() == [10, 11, 12, 13, 14]
    assert placed.dropout_cols(0, 2).tolist() == [4, 5]
    assert not make_problem(q, k, v, pattern=Pattern(k_start=3)).is_legacy
    kpm = torch.ones(2, 7, dtype=torch.bool)
    p = make_problem(q, k, v, lengths=[7, 3], key_padding_mask=kpm, causal=False)
    assert not p.causal and p.lengths.tolist() == [7, 3] and p.lengths.device == q.device
    assert torch.equal(p.key_padding_mask, kpm) and p.is_legacy
    q1, k1, v1 = _qkv(B=1, Tq=7)
    p = make_problem(q1, k1, v1, cu_seqlens=[0, 3, 7])
    assert p.cu_seqlens.tolist() == [0, 3, 7] and p.is_legacy
    for kw in (
        {"window": 2},
        {"chunk": 2},
        {"prefix_lengths": [1, 1]},
        {"mask": torch.ones(5, 7, dtype=torch.bool)},
        {"softcap": 2.0},
        {"sinks": torch.zeros(4)},
        {"alibi_slopes": torch.ones(4)},
        {"dropout_p": 0.1},
    ):
        assert not make_problem(q, k, v, **kw).is_legacy, kw


def test_dropout_keep_of_a_problem_is_keep_mask_at_its_global_positions():
    from causalattn import dropout
    from causalattn.engines import exact, make_problem
    from causalattn.masks import Pattern

    q, k, v = _qkv()
    g = torch.Generator().manual_seed(3)
    p = make_problem(q, k, v, pattern=Pattern(q_start=10, k_start=4), dropout_p=0.4, generator=g)
    seed, off = p.dropout_seed
    assert (seed, off) == dropout.seed_from(torch.Generator().manual_seed(3))
    want = dropout.keep_mask(seed, off, 1, 2, torch.arange(11, 13), torch.arange(5, 8), 0.4)
    assert torch.equal(p.keep(1, 2, 1, 3, 1, 4), want)
    full = exact.dropout_mask(p)
    assert full.shape == (2, 4, 5, 7) and torch.equal(full[1, 2, 1:3, 1:4], want)
    assert exact.dropout_mask(make_problem(q, k, v)) is None


@pytest.mark.parametrize(
    "make,message",
    [
        (
            lambda q, k, v: (q.numpy(), k, v),
            "attention: q must be a torch.Tensor (B, H, T, d), got ndarray",
        ),
        (
            lambda q, k, v: (q, k[0], v),
            "attention: k must be 4-D (B, H, T, d), got shape (2, 7, 3)",
        ),
        (
            lambda q, k, v: (q, k, v.long()),
            "attention: v (2, 2, 7, 2) has dtype torch.int64; expected one of fp64, fp32, bf16, "
            "fp16",
        ),
        (
            lambda q, k, v: (q, k.double(), v.double()),
            "attention: q, k, v dtypes differ: torch.float32, torch.float64, torch.float64",
        ),
        (
            lambda q, k, v: (q, k, v.to("meta")),
            "attention: q, k, v devices differ: cpu, cpu, meta",
        ),
        (
            lambda q, k, v: (q, k[:1], v[:1]),
            "attention: batch sizes differ: q (2, 4, 5, 3), k (1, 2, 7, 3), v (1, 2, 7, 2)",
        ),
        (
            lambda q, k, v: (q, k, v[:1]),
            "attention: batch sizes differ: q (2, 4, 5, 3), k (2, 2, 7, 3), v (1, 2, 7, 2)",
        ),
        (
            lambda q, k, v: (q[..., :2], k, v),
            "scores: q is (B, H, T_q, d_k) = (2, 4, 5, 2) but k is (2, 2, 7, 3); the inner d_k "
            "axes must match",
        ),
        (
            lambda q, k, v: (q, k, v[:, :1]),
            "attention: k (2, 2, 7, 3) and v (2, 1, 7, 2) must agree on (B, H_kv, T_k)",
        ),
        (
            lambda q, k, v: (q, k, v[:, :, :6]),
            "attention: k (2, 2, 7, 3) and v (2, 2, 6, 2) must agree on (B, H_kv, T_k)",
        ),
        (
            lambda q, k, v: (q[..., :0], k[..., :0], v),
            "attention: q (2, 4, 5, 0) and v (2, 2, 7, 2) need d_k >= 1 and d_v >= 1 (a head of "
            "width 0 has no scores or values)",
        ),
        (lambda q, k, v: (q, k, v[..., :0]), "need d_k >= 1 and d_v >= 1"),
        (
            lambda q, k, v: (q[:, :3], k, v),
            "attention: q has H_q=3 heads and k, v have H_kv=2; grouped-query attention needs H_q "
            "to be a multiple of H_kv",
        ),
        (lambda q, k, v: (q, k[:, :0], v[:, :0]), "k, v have H_kv=0"),
        (
            lambda q, k, v: (q, k[:, :, :4], v[:, :, :4]),
            "attention: q has T_q=5 positions but k has T_k=4; queries are the last T_q "
            "positions, so T_q must be <= T_k",
        ),
    ],
)
def test_bad_tensors_are_refused_naming_them_and_their_shapes(make, message):
    from causalattn.engines import make_problem

    with pytest.raises(ValueError) as e:
        make_problem(*make(*_qkv()))
    assert message in str(e.value)
    if "need d_k" not in message and "H_kv=0" not in message:
        assert str(e.value) == message


def test_bad_arguments_beside_the_tensors():
    from causalattn.engines import make_problem
    from causalattn.masks import Pattern

    q, k, v = _qkv()
    for kw, message in (
        ({"pattern": Pattern(), "window": 2}, "not both (got window)"),
        ({"pattern": Pattern(), "causal": False}, "not both (got causal)"),
        ({"pattern": Pattern(), "lengths": [1, 2], "chunk": 2}, "(got lengths, chunk)"),
        ({"pattern": "causal"}, "attention: pattern must be a causalattn.masks.Pattern, got str"),
        ({"scale": True}, "attention: scale must be a number, got True"),
        ({"scale": "0.5"}, "attention: scale must be a number, got '0.5'"),
        ({"scale": float("inf")}, "attention: scale must be finite, got inf"),
        ({"scale": float("nan")}, "attention: scale must be finite, got nan"),
    ):
        with pytest.raises(ValueError) as e:
            make_problem(q, k, v, **kw)
        assert message in str(e.value), (kw, str(e.value))
    assert (
        make_problem(q, k, v, scale=2).scale == 2.0
        and type(make_problem(q, k, v, scale=2).scale) is float
    )
    assert make_problem(q, k, v, scale=np.float32(0.5)).scale == 0.5
    q1, k1, v1 = _qkv(B=1, Tq=5)
    with pytest.raises(ValueError) as e:
        make_problem(q1, k1, v1, cu_seqlens=[0, 7])
    assert str(e.value) == (
        "cu_seqlens: packed sequences need q, k, v of shape (1, H, T, d) with one T; got q "
        "(1, 4, 5, 3), k (1, 2, 7, 3)"
    )
    placed = make_problem(q1, k1, v1, pattern=Pattern(cu_seqlens=[0, 9, 12], q_start=0, k_start=0))
    assert placed.pattern.cu_seqlens.tolist() == [0, 9, 12]  # placed: T_q and T_k may differ
    assert make_problem(q, k[:, :, :4], v[:, :, :4], pattern=Pattern(q_start=3)).dims == (
        2,
        4,
        5,
        4,
    )


def test_generators_and_compute_dtypes():
    from causalattn.engines.problem import check_generator, compute_dtype

    check_generator(None)
    check_generator(torch.Generator())
    for bad in (3, "seed", np.random.default_rng(0)):
        with pytest.raises(
            ValueError, match=r"^attention: generator must be a CPU torch.Generator"
        ):
            check_generator(bad)
    assert compute_dtype(torch.float64) == torch.float64
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        assert compute_dtype(dt) == torch.float32


def test_the_reference_reads_sinks_given_to_the_problem_as_a_list():
    from causalattn.engines.exact import attend
    from causalattn.engines.problem import make_problem

    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 5, 4, generator=g, dtype=torch.float64) for _ in range(3))
    sinks = [0.7, -1.5]
    want = ca.attention(q, k, v, sinks=torch.tensor(sinks, dtype=torch.float64), engine="reference")
    got = attend(make_problem(q, k, v, sinks=sinks))  # the Pattern holds them as NumPy
    got = got[0] if isinstance(got, tuple) else got
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    plain = ca.attention(q, k, v, engine="reference")
    assert not torch.allclose(got, plain)  # the sinks took weight


def _qkv64(T=5, H=1, d=3, seed=5):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, H, T, d, generator=g, dtype=torch.float64) for _ in range(3)]


@pytest.mark.parametrize("how", ["bias", "score_mod"])
def test_a_row_the_score_terms_leave_nothing_to_read_is_a_zero_row_with_lse_minus_inf(how):
    """Row 2's every readable key gets -inf from a bias (or a score_mod): like a row with no
    readable key, it is zero (not NaN), its lse -inf; the other rows are as without it."""
    q, k, v = _qkv64()
    if how == "bias":
        bias = torch.zeros(5, 5, dtype=torch.float64)
        bias[2] = float("-inf")
        kw = {"bias": bias}
    else:
        kw = {"score_mod": lambda s, b, h, qi, kj: torch.where(qi == 2, float("-inf"), s)}
    out, lse = ca.attention(q, k, v, engine="reference", return_lse=True, **kw)
    plain, plain_lse = ca.attention(q, k, v, engine="reference", return_lse=True)
    assert (out[0, 0, 2] == 0).all() and lse[0, 0, 2] == float("-inf")
    rows = [0, 1, 3, 4]
    torch.testing.assert_close(out[0, 0, rows], plain[0, 0, rows], rtol=0, atol=0)
    torch.testing.assert_close(lse[0, 0, rows], plain_lse[0, 0, rows], rtol=0, atol=0)


def test_the_reference_at_dropout_1_gives_zeros_and_zero_gradients():
    q, k, v = (t.requires_grad_() for t in _qkv64())
    out = ca.attention(q, k, v, engine="reference", dropout_p=1.0)
    assert out.shape == v.shape and (out == 0).all()
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert all((g == 0).all() for g in grads)


def test_the_reference_computes_in_float64_whatever_the_inputs():
    """The oracle: float32 inputs give the float64 result rounded once, bit for bit."""
    q, k, v = (t.float() for t in _qkv64(T=9, d=16, seed=6))
    got = ca.attention(q, k, v, engine="reference", sinks=torch.tensor([0.25]))
    want = ca.attention(
        q.double(), k.double(), v.double(), engine="reference", sinks=torch.tensor([0.25])
    )
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want.float(), rtol=0, atol=0)


def test_make_problem_takes_issue_24_s_four_keywords_into_its_pattern():
    """mask_mod, score_mod, bias and rel_bias reach the Problem's Pattern, and the reference
    reads each (its output moves off the plain causal one)."""
    from causalattn.engines.exact import attend
    from causalattn.engines.problem import make_problem

    q, k, v = _qkv64(T=6, H=2)
    plain = attend(make_problem(q, k, v))
    for name, value in (
        ("mask_mod", lambda b, h, qi, kj: (qi - kj) % 2 == 0),
        ("score_mod", lambda s, b, h, qi, kj: 2.0 * s),
        ("bias", torch.linspace(-1, 1, 36, dtype=torch.float64).reshape(6, 6)),
        ("rel_bias", torch.linspace(-1, 1, 22, dtype=torch.float64).reshape(2, 11)),
    ):
        p = make_problem(q, k, v, **{name: value})
        assert getattr(p.pattern, name) is not None, name
        assert not torch.allclose(attend(p), plain), name


def test_make_problem_refuses_a_generator_that_is_no_cpu_generator():
    from causalattn.engines.problem import make_problem

    q, k, v = _qkv64()
    with pytest.raises(ValueError, match=r"^attention: generator must be a CPU torch.Generator"):
        make_problem(q, k, v, dropout_p=0.1, generator=1234)
