"""KVCache on its own: what it holds after each append, how its storage grows, what it
refuses (naming the argument and the shapes), and that a refused append changes nothing."""

from __future__ import annotations

import pytest
import torch

from causalattn.engines import KVCache, attention
from causalattn.engines import cache as cache_mod


def _kv(B=2, H=3, t=4, d_k=5, d_v=6, start=0, dtype=torch.float32):
    """k, v whose entries say their position: k[..., i, :] = start + i (v: the negative)."""
    pos = torch.arange(start, start + t, dtype=dtype)[None, None, :, None]
    return pos.expand(B, H, t, d_k).clone(), (-pos).expand(B, H, t, d_v).clone()


def test_appends_hold_every_position_in_order_and_views_are_the_filled_part():
    c = KVCache(capacity=3)
    assert len(c) == 0
    t0 = 0
    for t in (2, 1, 4, 1, 9):  # within capacity, exactly filling it, past it, far past it
        k, v = _kv(t=t, start=t0)
        K, V = c.append(k, v)
        t0 += t
        assert len(c) == t0 and K.shape == (2, 3, t0, 5) and V.shape == (2, 3, t0, 6)
        want = torch.arange(t0, dtype=torch.float32)
        assert torch.equal(K[0, 0, :, 0], want) and torch.equal(V[1, 2, :, 5], -want)
        assert torch.equal(c.k, K) and torch.equal(c.v, V)
    # the views share the cache's storage: one step copies only the new token
    assert c.k.data_ptr() == c._k.data_ptr() and c.v.data_ptr() == c._v.data_ptr()


@pytest.mark.parametrize(
    "capacity,steps,sizes",
    [
        (4, [1, 1, 1, 1], [4, 4, 4, 4]),  # fits: no growth
        (4, [1, 1, 1, 1, 1], [4, 4, 4, 4, 8]),  # one past: doubles
        (2, [1] * 9, [2, 2, 4, 4, 8, 8, 8, 8, 16]),  # doubling each time it is full
        (4, [3, 10], [4, 13]),  # more than twice the storage: exactly what it needs
        (3, [5], [5]),  # the first append larger than the capacity: exactly what it needs
        (3, [5, 1], [5, 10]),  # then twice the storage, not capacity·2ⁿ
        (1, [1, 2], [1, 3]),  # 3 needed, more than 2·1: exactly that
    ],
)
def test_storage_grows_by_doubling(capacity, steps, sizes):
    c = KVCache(capacity=capacity)
    got = []
    for t in steps:
        c.append(*_kv(B=1, H=1, t=t, d_k=2, d_v=2))
        got.append(c._k.shape[2])
        assert c._v.shape[2] == c._k.shape[2]
    assert got == sizes


def test_a_cache_feeds_attention_like_the_whole_sequence():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 7, 4, generator=g, dtype=torch.float64) for _ in range(3))
    c = KVCache(capacity=1)
    c.append(k[:, :, :3], v[:, :, :3])
    out = [attention(q[:, :, :3], c.k, c.v, engine="reference")]
    for t in range(3, 7):
        out.append(attention(q[:, :, t : t + 1], *c.append(k[:, :, t : t + 1], v[:, :, t : t + 1])))
    whole = attention(q, k, v, engine="reference")
    torch.testing.assert_close(torch.cat(out, 2), whole, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("name", ["capacity", "max_bytes"])
@pytest.mark.parametrize("value", [0, -1, 2.0, "8", True, None])
def test_sizes_must_be_positive_integers(name, value):
    with pytest.raises(ValueError, match=f"^KVCache: {name} must be a positive integer, got "):
        KVCache(**{name: value})


def test_empty_cache_has_no_views():
    c = KVCache()
    for view in ("k", "v"):
        with pytest.raises(ValueError, match="^KVCache: empty; append keys and values first$"):
            getattr(c, view)


def test_max_bytes_bounds_the_storage_and_names_the_sizes():
    k, v = _kv(B=1, H=2, t=4, d_k=3, d_v=5)  # (3 + 5) · 4 bytes a position and head
    need = 1 * 2 * 8 * 8 * 4  # capacity 8
    assert KVCache(capacity=8, max_bytes=need).append(k, v)[0].shape[2] == 4  # exactly fits
    c = KVCache(capacity=8, max_bytes=need - 1)
    with pytest.raises(ValueError) as e:
        c.append(k, v)
    msg = str(e.value)
    for word in ("KVCache: 8 positions", "(1, 2, 8, 3)", "d_v = 5", "torch.float32", "max_bytes"):
        assert word in msg, msg
    assert len(c) == 0 and c._k is None  # nothing was allocated
    c = KVCache(capacity=4, max_bytes=need - 1)
    c.append(k, v)
    with pytest.raises(ValueError, match="KVCache: 8 positions"):  # growing is bounded too
        c.append(*_kv(B=1, H=2, t=1, d_k=3, d_v=5))
    assert len(c) == 4 and c._k.shape[2] == 4
    assert cache_mod.MAX_BYTES == 16 * 2**30


@pytest.mark.parametrize(
    "make,words",
    [
        (lambda k, v: (k.numpy(), v), ["k must be a torch.Tensor", "ndarray", "from_numpy"]),
        (lambda k, v: (k, [1.0]), ["v must be a torch.Tensor", "list"]),
        (lambda k, v: (k, v.double()), ["k is torch.float32", "v is torch.float64"]),
        (lambda k, v: (k[0], v[0]), ["(B, H_kv, t, d)", "k (3, 4, 5)", "v (3, 4, 6)"]),
        (lambda k, v: (k, v[:, :, :3]), ["same (B, H_kv, t)", "k (2, 3, 4, 5)", "v (2, 3, 3, 6)"]),
        (lambda k, v: (k, v[:, :2]), ["k (2, 3, 4, 5)", "v (2, 2, 4, 6)"]),
        (lambda k, v: (k, v[:1]), ["k (2, 3, 4, 5)", "v (1, 3, 4, 6)"]),
    ],
)
def test_bad_appends_name_the_argument_and_shapes(make, words):
    c = KVCache()
    with pytest.raises(ValueError) as e:
        c.append(*make(*_kv()))
    for w in words:
        assert w in str(e.value), str(e.value)
    assert len(c) == 0


@pytest.mark.parametrize(
    "make,words",
    [
        (
            lambda k, v: (k[:1], v[:1]),
            ["(B, H_kv, T, d_k) = (2, 3, 4, 5)", "d_v = 6", "k (1, 3, 1, 5)"],
        ),
        (lambda k, v: (k[:, :2], v[:, :2]), ["(2, 3, 4, 5)", "k (2, 2, 1, 5)", "another layer"]),
        (lambda k, v: (k[..., :4], v), ["(2, 3, 4, 5)", "k (2, 3, 1, 4)"]),
        (lambda k, v: (k, v[..., :5]), ["d_v = 6", "v (2, 3, 1, 5)"]),
        (lambda k, v: (k.double(), v.double()), ["cache is torch.float32 on cpu", "torch.float64"]),
    ],
)
def test_an_append_that_does_not_fit_what_the_cache_holds_is_refused_and_changes_nothing(
    make, words
):
    c = KVCache()
    K0, V0 = (t.clone() for t in c.append(*_kv()))
    with pytest.raises(ValueError) as e:
        c.append(*make(*_kv(t=1, start=4)))
    for w in words:
        assert w in str(e.value), str(e.value)
    assert len(c) == 4 and torch.equal(c.k, K0) and torch.equal(c.v, V0)


def test_claim_keeps_one_owner():
    c = KVCache()
    assert c.owner is None
    c.claim(7)
    c.claim(7)  # the same owner again: fine
    assert c.owner == 7
    with pytest.raises(ValueError, match="^kv_cache: this KVCache already holds .* another layer"):
        c.claim(8)
    with pytest.raises(ValueError, match="another model; give every model its own KVCache"):
        c.claim(9, what="model")
    assert c.owner == 7


def test_the_default_capacity_is_256_positions():
    c = KVCache()
    c.append(*_kv(B=1, H=1, t=3))
    assert c._k.shape[2] == c._v.shape[2] == 256 and len(c) == 3


def test_messages_in_full():
    k, v = _kv(B=1, H=2, t=1, d_k=1, d_v=1)
    with pytest.raises(ValueError) as e:  # 2 · 2²⁷ positions · 2 · 4 bytes = 2 GiB
        KVCache(capacity=2**27, max_bytes=2**30).append(k, v)
    assert str(e.value) == (
        "KVCache: 134217728 positions of k (B, H_kv, T, d_k) = (1, 2, 134217728, 1) and v "
        "(d_v = 1) in torch.float32 would take 2.0 GiB (max_bytes 1.0 GiB); give a smaller "
        "capacity or a larger max_bytes"
    )
    with pytest.raises(ValueError) as e:
        KVCache().append(k, v.double())
    assert str(e.value) == (
        "KVCache.append: k is torch.float32 on cpu but v is torch.float64 on cpu; they must match"
    )
    with pytest.raises(ValueError) as e:
        KVCache().append(k, v[..., None])  # v 5-D with k's (B, H_kv, t)
    assert str(e.value) == (
        "KVCache.append: k and v must be (B, H_kv, t, d) with the same (B, H_kv, t); "
        "got k (1, 2, 1, 1), v (1, 2, 1, 1, 1)"
    )
    with pytest.raises(ValueError, match=r"got k \(1, 2, 1\), v \(1, 2, 1, 1\)$"):
        KVCache().append(k[..., 0], v)  # k 3-D
    c = KVCache()
    c.append(k, v)
    with pytest.raises(ValueError) as e:
        c.append(*_kv(B=2, H=2, t=1, d_k=1, d_v=1))
    assert str(e.value) == (
        "KVCache.append: cache holds (B, H_kv, T, d_k) = (1, 2, 1, 1) and d_v = 1; got k "
        "(2, 2, 1, 1), v (2, 2, 1, 1) (another layer or batch?)"
    )
