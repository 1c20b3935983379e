"""PyTorch's scaled_dot_product_attention as an engine: the peer our engines are measured against."""

from __future__ import annotations

import torch.nn.functional as F

from .problem import Problem


def forward(p: Problem, return_lse: bool = False):
    if return_lse:
        raise ValueError("engine 'sdpa': PyTorch's SDPA does not return the log-sum-exp; use 'tiled'")
    plain_causal = (
        p.causal and p.lengths is None and p.key_padding_mask is None
        and p.cu_seqlens is None and p.q.shape[2] == p.k.shape[2]
    )
    gqa = p.group > 1
    if plain_causal:
        return F.scaled_dot_product_attention(p.q, p.k, p.v, is_causal=True, scale=p.scale, enable_gqa=gqa)
    allowed = p.allowed()
    # SDPA multiplies zero weights by the values, so 0·NaN at a padding key would reach
    # real rows: keys no query may read are zeroed first (causal future keys are a peer
    # limitation: SDPA itself gives no bit-for-bit guarantee there).
    readable = allowed.any(dim=2, keepdim=True).transpose(-1, -2)  # (B, 1, T_k, 1)
    k = p.k.masked_fill(~readable, 0.0)
    v = p.v.masked_fill(~readable, 0.0)
    out = F.scaled_dot_product_attention(p.q, k, v, attn_mask=allowed, scale=p.scale, enable_gqa=gqa)
    # SDPA gives NaN (or a uniform average) on rows with no readable key; ours are zero.
    return out.masked_fill(~allowed.any(dim=-1, keepdim=True), 0.0)
