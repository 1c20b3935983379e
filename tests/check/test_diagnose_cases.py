"""diagnose on fresh attention code: several ALiBi heads, grouped-query modules, scales that
equal one size only by coincidence, Aᵀ V, code that is random in eval, normalizations no
softmax gives, long fp16 rows that read nothing, rows that read no key."""

from __future__ import annotations

import importlib
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from causalattn import diagnose, masks
from causalattn.check.probes import Plan
from causalattn.layer import CausalSelfAttention

SLOPES = masks.alibi_slopes(4)
diagnose_module = importlib.import_module("causalattn.check.diagnose")


def _positions(T_q, T_k):
    """Query positions (bottom-right: the last T_q of T_k) and key positions."""
    return torch.arange(T_k - T_q, T_k)[:, None], torch.arange(T_k)[None, :]


# -- several ALiBi heads --------------------------------------------------------------------
def alibi_heads(q, k, v):
    """(B, H, T, d) torch, four heads, ALiBi slopes per head, bottom-right causal."""
    T_q, T_k = q.shape[-2], k.shape[-2]
    i, j = _positions(T_q, T_k)
    slopes = torch.as_tensor(SLOPES, dtype=q.dtype).view(-1, 1, 1)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]) - slopes * (i - j).abs()
    scores = scores.masked_fill(j > i, float("-inf"))
    return torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v


def alibi_heads_no_mask(q, k, v):
    T_q, T_k = q.shape[-2], k.shape[-2]
    i, j = _positions(T_q, T_k)
    slopes = torch.as_tensor(SLOPES, dtype=q.dtype).view(-1, 1, 1)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]) - slopes * (i - j).abs()
    return torch.softmax(scores, dim=-1) @ v  # fault: nothing blocks j > i


def test_multi_head_alibi_function_is_clean_on_every_probe():
    d = diagnose(alibi_heads, alibi_slopes=SLOPES)  # isolated, as a user runs it
    assert d.ok, str(d)
    ran = d.details["probes"]
    assert "long fp16 rows" in ran and "decoding probe (T_q < T_k)" in ran, ran
    assert not d.details.get("dropped probes")


def test_multi_head_alibi_fault_is_named():
    d = diagnose(alibi_heads_no_mask, alibi_slopes=SLOPES, isolate=False)
    assert d.fault == "no-mask" and d.stage == "M", str(d)


def test_library_alibi_layer_is_clean():
    layer = CausalSelfAttention(16, 4, alibi_slopes=True)
    d = diagnose(layer, alibi_slopes=masks.alibi_slopes(4))
    assert d.ok, str(d)


def test_per_head_declaration_that_does_not_fit_the_code_is_refused():
    def one_head(x, w_q, w_k, w_v):
        q, k = x @ w_q, x @ w_k
        s = q @ k.T / np.sqrt(q.shape[-1])
        s = np.where(np.tril(np.ones(s.shape, bool)), s, -np.inf)
        e = np.exp(s - s.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True) @ (x @ w_v)

    with pytest.raises(ValueError, match=r"alibi_slopes are for 4 heads.*x-weights.* 1"):
        diagnose(one_head, alibi_slopes=SLOPES, isolate=False)
    with pytest.raises(ValueError, match=r"sinks are for 2 heads, but the module has 4"):
        diagnose(CausalSelfAttention(16, 4, sinks=True), sinks=[0.0, 0.0], isolate=False)


# -- grouped-query modules ------------------------------------------------------------------
class GroupedQuery(nn.Module):
    """Llama-style: narrower k_proj/v_proj, each key/value head read by H / H_kv query heads
    (``wrong_groups``: query head i reads key/value head i % H_kv instead of i // (H / H_kv))."""

    def __init__(self, d_model=24, num_heads=6, num_key_value_heads=2, wrong_groups=False):
        super().__init__()
        self.num_heads, self.kv, self.d = num_heads, num_key_value_heads, d_model // num_heads
        self.wrong_groups = wrong_groups
        self.q_proj = nn.Linear(d_model, num_heads * self.d, bias=False)
        self.k_proj = nn.Linear(d_model, self.kv * self.d, bias=False)
        self.v_proj = nn.Linear(d_model, self.kv * self.d, bias=False)
        self.o_proj = nn.Linear(num_heads * self.d, d_model, bias=False)

    def forward(self, x):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, self.d)
        k = self.k_proj(x).view(B, T, self.kv, self.d)
        v = self.v_proj(x).view(B, T, self.kv, self.d)
        g = self.num_heads // self.kv
        if self.wrong_groups:
            k, v = k.repeat(1, 1, g, 1), v.repeat(1, 1, g, 1)
        else:
            k, v = k.repeat_interleave(g, 2), v.repeat_interleave(g, 2)
        s = torch.einsum("bqhd,bkhd->bhqk", q, k) * self.d**-0.5
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        y = torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v)
        return self.o_proj(y.reshape(B, T, -1))


@pytest.mark.parametrize(
    "module",
    [
        GroupedQuery(),
        CausalSelfAttention(16, 4, n_kv_heads=2),
        CausalSelfAttention(12, 4, n_kv_heads=1),
    ],
    ids=["hand-written", "library GQA", "library MQA"],
)
def test_grouped_query_module_is_clean(module):
    d = diagnose(module, isolate=False)
    assert d.ok, str(d)


def test_grouped_query_module_with_wrong_groups_is_not_clean():
    d = diagnose(GroupedQuery(wrong_groups=True), isolate=False)
    assert d.fault == "some-heads-only", str(d)
    # i % 2 and i // 3 differ for query heads 2 and 5 (1-based) of 6 only
    assert d.findings[0].measurement["heads"] == [1, 4], str(d)


# -- scales named by one size, not by a coincidence of two ------------------------------------
def scale_by_keys(q, k, v):
    """NumPy einsum, scaled by 1/√T_k (the number of keys)."""
    T = k.shape[-2]
    s = np.einsum("...id,...jd->...ij", q, k) / np.sqrt(T)
    s = np.where(np.tril(np.ones((s.shape[-2], T), bool), T - s.shape[-2]), s, -np.inf)
    w = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("...ij,...jd->...id", w / w.sum(-1, keepdims=True), v)


def scale_by_heads_width(q, k, v):
    """(B, H, T, d) torch, scaled by 1/√(H·d_head): right with one head only."""
    B, H, T, d = q.shape
    s = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(H * d)
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    return torch.matmul(F.softmax(s, dim=-1), v)


def test_scale_by_number_of_keys_is_not_named_by_d_v():
    d = diagnose(scale_by_keys, isolate=False)
    assert d.stage == "S" and d.fault is None, str(d)
    assert "1/√T_k" in d.message and "the weights do not change" in d.message, str(d)


def test_scale_by_all_heads_width_is_not_named_by_d_v():
    d = diagnose(scale_by_heads_width, isolate=False)
    assert d.stage == "S" and d.fault is None, str(d)
    assert d.findings[0].probe == "two-head probe" and "1/√(H·d_k)" in d.message, str(d)


class WideHeadsScale(nn.Module):
    """Two heads of 4 in a model of width 16, scaled by 1/√(H·d_head) = 1/√8."""

    def __init__(self):
        super().__init__()
        self.n_head = 2
        self.q, self.k, self.v = (nn.Linear(16, 8, bias=False) for _ in range(3))

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = (p(x).view(B, T, 2, 4).transpose(1, 2) for p in (self.q, self.k, self.v))
        a = q @ k.transpose(-1, -2) / math.sqrt(8)  # fault: 8 = H·d_head, not d_head
        a = a.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), -math.inf)
        return (a.softmax(-1) @ v).transpose(1, 2).reshape(B, T, 8)


def test_module_scale_by_heads_width_is_named_by_no_other_size():
    d = diagnose(WideHeadsScale(), isolate=False)
    assert d.stage == "S" and d.fault is None, str(d)
    assert "1/√(H·d_k) (H·d_k = 8)" in d.message, str(d)


def test_probe_sizes_are_apart():
    qkv = Plan("qkv", None, None, {"alibi_slopes": masks.alibi_slopes(2)}, np.float64, False)
    p = qkv.main_probes()[0]
    assert len({p.T_k, p.d_k, p.H * p.d_k}) == 3, (p.T_k, p.d_k, p.H)
    one = Plan("qkv", None, None, {}, np.float64, False)
    two = one.further(one.main_probes()[0])[0][0]
    assert two.kind == "two-head" and len({two.T_k, two.d_k, 2 * two.d_k}) == 3
    dims = {
        "d_model": 6,
        "d_k": 3,
        "heads": 2,
        "kv_heads": 2,
        "d_v": 3,
        "hd_v": 6,
        "d_out": 6,
        "w_o": True,
    }
    m = Plan("module", dims, None, {}, np.float32, True).main_probes()[0]
    assert m.T_k not in (3, 6), m.T_k  # not d_k = d_v, not H·d_k = d_model


# -- H = Aᵀ V -----------------------------------------------------------------------------
class TransposedWeights:
    """A callable object (not a module): the weights right, the values read through Aᵀ."""

    def __call__(self, q, k, v):
        T = q.shape[-2]
        s = torch.einsum("...qd,...kd->...qk", q, k) / q.shape[-1] ** 0.5
        a = torch.where(torch.ones(T, T, dtype=torch.bool).tril(), s, -torch.inf).softmax(-1)
        return torch.einsum("...kq,...kd->...qd", a, v)  # fault: Aᵀ V


def test_transposed_weights_are_named_at_h():
    d = diagnose(TransposedWeights(), isolate=False)
    assert d.stage == "H" and d.fault is None, str(d)
    assert "Aᵀ V" in d.message and "transposed" in d.message, str(d)
    assert len(d.findings) == 1 and d.pattern is None, str(d)


# -- random in eval -------------------------------------------------------------------------
class DropoutLeftOn(nn.Module):
    def forward(self, q, k, v):
        T = q.shape[-2]
        s = (q @ k.mT) * q.shape[-1] ** -0.5
        a = s.masked_fill(~torch.tril(torch.ones(T, T, dtype=torch.bool)), -1e30).softmax(-1)
        return F.dropout(a, p=0.2, training=True) @ v  # fault: training=True in eval


def squashed_values(q, k, v):
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    s = np.where(np.tril(np.ones(s.shape[-2:], bool)), s, -np.inf)
    a = np.exp(s - s.max(-1, keepdims=True))
    return (a / a.sum(-1, keepdims=True)) @ np.tanh(v)  # not linear in V; 0 for V = 0


def test_random_in_eval_is_said_to_be_not_deterministic():
    d = diagnose(DropoutLeftOn().eval(), signature="qkv", isolate=False)
    assert d.stage == "H" and "not deterministic" in d.message, str(d)
    assert "not A V" not in d.message and len(d.findings) == 1, str(d)


def test_nonlinear_output_with_zero_for_zero_values_says_so():
    d = diagnose(squashed_values, isolate=False)
    assert d.stage == "H" and "not A V" in d.message, str(d)
    assert "with V = 0 it is 0" in d.message and "not 0" not in d.message, str(d)


# -- normalizations that no softmax gives ------------------------------------------------------
def normalized_without_exp(q, k, v):
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    T_q, T_k = s.shape[-2:]
    s = s * np.tril(np.ones((T_q, T_k)), T_k - T_q)
    return s / s.sum(-1, keepdims=True) @ v  # fault: no exp: weights can be negative


def online_softmax_without_rescale(q, k, v):
    """Flash-style, one key at a time: the running sum is rescaled, the output is not."""
    T_q, T_k = q.shape[-2], k.shape[-2]
    pos = np.arange(T_k - T_q, T_k)
    m = np.full(q.shape[:-1], -np.inf)
    den = np.zeros(q.shape[:-1])
    acc = np.zeros(q.shape[:-1] + (v.shape[-1],))
    for j in range(T_k):
        s = np.einsum("...qd,...d->...q", q, k[..., j, :]) / np.sqrt(q.shape[-1])
        s = np.where(pos >= j, s, -np.inf)
        m_new = np.maximum(m, s)
        p = np.where(np.isfinite(s), np.exp(s - m_new), 0.0)
        den = den * np.where(np.isfinite(m), np.exp(m - m_new), 0.0) + p
        acc = acc + p[..., None] * v[..., j, None, :]  # fault: acc is not rescaled
        m = m_new
    return acc / den[..., None]


def test_negative_weights_are_placed_at_a():
    d = diagnose(normalized_without_exp, isolate=False)
    assert d.stage == "A" and "negative weights" in d.message, str(d)
    assert not any(f.stage == "S" for f in d.findings), str(d)


def test_rows_summing_over_one_are_placed_at_a():
    d = diagnose(online_softmax_without_rescale, isolate=False)
    assert d.stage == "A" and "no softmax sums so" in d.message, str(d)
    assert not any(f.stage == "S" for f in d.findings), str(d)
    assert d.also == [], str(d)


# -- long fp16 rows that read nothing ------------------------------------------------------------
def early_queries(b, h, q_idx, kv_idx):
    return q_idx < 2498  # queries from position 2498 on read nothing


def early_queries_torch(q, k, v, accumulate=torch.float32):
    T_q, T_k = q.shape[-2], k.shape[-2]
    i, j = _positions(T_q, T_k)
    ok = (j <= i) & (i < 2498)
    s = (q @ k.transpose(-1, -2)).to(accumulate) / math.sqrt(q.shape[-1])
    e = torch.exp(s.masked_fill(~ok, -torch.inf) - s.masked_fill(~ok, -torch.inf).amax(-1, True))
    e = e.nan_to_num(0.0)  # rows with no key: all -inf
    den = e.sum(-1, keepdim=True)
    a = torch.where(den > 0, e / den.clamp_min(1e-30), 0.0)
    return a.to(q.dtype) @ v


def test_long_fp16_rows_that_read_nothing_give_no_finding():
    d = diagnose(early_queries_torch, mask_mod=early_queries, isolate=False)
    assert d.ok, str(d)
    assert "long fp16 rows" in d.details["probes"]


def early_queries_fp16_sums(q, k, v):
    """NumPy: the same rows, the softmax's sum accumulated in the input dtype."""
    T_q, T_k = q.shape[-2:][0], k.shape[-2]
    i = np.arange(T_k - T_q, T_k)[:, None]
    j = np.arange(T_k)[None, :]
    z = np.where((j <= i) & (i < 2498), q @ np.swapaxes(k, -1, -2), -np.inf)
    z = z / np.sqrt(q.shape[-1]).astype(q.dtype)
    top = z.max(-1, keepdims=True)
    e = np.exp(z - np.where(np.isfinite(top), top, 0))
    den = np.cumsum(e, axis=-1, dtype=e.dtype)[..., -1:]  # fault: summed in fp16
    return np.where(den > 0, e / np.where(den > 0, den, 1), 0).astype(q.dtype) @ v


def test_long_fp16_rows_that_read_keys_still_show_fp16_sums():
    d = diagnose(early_queries_fp16_sums, mask_mod=early_queries, isolate=False)
    assert d.fault == "softmax-fp16-accumulation", str(d)
    assert "reading 0 keys" not in d.message


# -- rows that read no key --------------------------------------------------------------------
def strictly_past(q, k, v):
    """T×d only (torch.baddbmm on one batch)."""
    (T, d), dv = q.shape, v.shape[-1]
    s = torch.baddbmm(torch.zeros(1, T, T), q.view(1, T, d), k.view(1, T, d).mT)
    s = s / math.sqrt(d)
    blocked = torch.ones(T, T, dtype=torch.bool).triu(0)  # fault: the diagonal too
    a = torch.softmax(s.masked_fill(blocked, -torch.inf), -1).nan_to_num(0.0)
    return (a @ v.view(1, T, dv)).view(T, dv)


def last_row_halved(q, k, v):
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    s = np.where(np.tril(np.ones(s.shape[-2:], bool)), s, -np.inf)
    a = np.exp(s - s.max(-1, keepdims=True))
    a = a / a.sum(-1, keepdims=True)
    a[..., -1, :] *= 0.5
    return a @ v


def test_row_that_reads_nothing_gives_one_finding():
    d = diagnose(strictly_past, isolate=False)
    assert d.fault == "diagonal-blocked", str(d)
    assert len(d.findings) == 1 and "sum to 0" not in str(d), str(d)


def test_one_row_off_is_worded_in_the_singular():
    d = diagnose(last_row_halved, isolate=False)
    assert d.stage == "A" and "row 6 sums to 0.5 instead of 1" in d.message, str(d)


# -- a failure of diagnose's own -------------------------------------------------------------
def test_failure_after_the_probes_is_diagnose_s_own(monkeypatch):
    def broken(*a, **k):
        raise IndexError("judge broke")

    monkeypatch.setattr(diagnose_module, "judge", broken)
    with pytest.raises(RuntimeError, match="not in the function"):
        diagnose(alibi_heads, alibi_slopes=SLOPES, isolate=False)
    d = diagnose(alibi_heads, alibi_slopes=SLOPES)  # the worker is a fork: it is broken too
    assert d.status == "error" and "a fault in causalattn's diagnose" in d.message, str(d)
    assert "judge broke" in d.message
