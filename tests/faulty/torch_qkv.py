"""PyTorch attention fn(q, k, v, key_padding_mask=None), (B, T, d) or T×d; one fault each."""

import math

import torch


def _causal(T):
    return torch.ones(T, T, dtype=torch.bool).tril()


def correct(q, k, v, key_padding_mask=None):
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    allowed = _causal(scores.shape[-1])
    if key_padding_mask is not None:
        allowed = allowed & key_padding_mask[:, None, :]
    scores = scores.masked_fill(~allowed, float("-inf"))
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return weights @ v


def missing_scale(q, k, v, key_padding_mask=None):
    scores = q @ k.transpose(-2, -1)  # fault: no / sqrt(d_k)
    allowed = _causal(scores.shape[-1])
    if key_padding_mask is not None:
        allowed = allowed & key_padding_mask[:, None, :]
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, dim=-1).nan_to_num(0.0) @ v


def no_mask(q, k, v, key_padding_mask=None):
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if key_padding_mask is not None:  # fault: padding only, no causal mask
        scores = scores.masked_fill(~key_padding_mask[:, None, :], float("-inf"))
    return torch.softmax(scores, dim=-1).nan_to_num(0.0) @ v


def softmax_query_axis(q, k, v, key_padding_mask=None):
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    allowed = _causal(scores.shape[-1])
    if key_padding_mask is not None:
        allowed = allowed & key_padding_mask[:, None, :]
    scores = scores.masked_fill(~allowed, float("-inf"))
    weights = torch.softmax(scores, dim=-2)  # fault: over the query axis
    return weights.nan_to_num(0.0) @ v


def mask_after_softmax(q, k, v, key_padding_mask=None):
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    weights = torch.softmax(scores, dim=-1)
    allowed = _causal(scores.shape[-1])
    if key_padding_mask is not None:
        allowed = allowed & key_padding_mask[:, None, :]
    weights = weights * allowed  # fault: zeroed after the softmax, not renormalized
    return weights @ v


def unstable_softmax(q, k, v, key_padding_mask=None):
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    allowed = _causal(scores.shape[-1])
    if key_padding_mask is not None:
        allowed = allowed & key_padding_mask[:, None, :]
    e = torch.exp(scores.masked_fill(~allowed, float("-inf")))  # fault: no max subtraction
    weights = e / e.sum(dim=-1, keepdim=True)
    weights = torch.where(allowed.any(-1, keepdim=True), weights, 0.0)
    return weights @ v


def finite_min_added_twice(q, k, v, key_padding_mask=None):
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    T = scores.shape[-1]
    neg = torch.finfo(scores.dtype).min
    causal = torch.zeros(T, T, dtype=scores.dtype).masked_fill(~_causal(T), neg)
    scores = scores + causal
    if key_padding_mask is not None:  # fault: a second finite minimum added on top
        pad = torch.zeros(key_padding_mask.shape, dtype=scores.dtype).masked_fill(
            ~key_padding_mask, neg
        )
        scores = scores + pad[:, None, :]
    return torch.softmax(scores, dim=-1) @ v


def half_scale(q, k, v, key_padding_mask=None):
    """Not in the catalogue: scores divided by 2√d_k. diagnose finds it through the audit."""
    scores = q @ k.transpose(-2, -1) / (2 * math.sqrt(q.shape[-1]))
    allowed = _causal(scores.shape[-1])
    if key_padding_mask is not None:
        allowed = allowed & key_padding_mask[:, None, :]
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, dim=-1).nan_to_num(0.0) @ v
