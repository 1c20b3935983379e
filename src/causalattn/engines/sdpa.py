"""PyTorch's scaled_dot_product_attention as an engine: the peer our engines are measured against.

The pattern goes in as SDPA's dense mask (a mask_mod evaluated into it): a bool mask, or a
float bias where ALiBi, ``bias`` or ``rel_bias`` add finite entries (0 or -slope·|i-j|
where readable, -inf where not). SDPA cannot express
softcap (a function of the scores, not an addition), sinks (an extra denominator term), a
score_mod or the log-sum-exp: the registry says so (:data:`causalattn.engines.registry.ENGINES`)
and they raise a ValueError rather than approximate. Dropout is SDPA's own ``dropout_p``,
drawn from torch's global RNG: its pattern differs from :mod:`causalattn.dropout`'s (the
other engines'), so only its statistics can be compared.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .problem import Problem


def forward(p: Problem, return_lse: bool = False):
    from .registry import of_problem, refusal

    why = refusal("sdpa", of_problem(p, return_lse))  # what it lacks: the registry's data
    if why:
        raise ValueError(why)
    gqa = p.group > 1
    pt = p.pattern
    drop = p.dropout_p
    if pt.is_plain_causal and p.q.shape[2] == p.k.shape[2]:
        return F.scaled_dot_product_attention(
            p.q, p.k, p.v, is_causal=True, scale=p.scale, enable_gqa=gqa, dropout_p=drop
        )
    allowed = p.allowed()  # (B', H', T_q, T_k)
    # SDPA multiplies zero weights by the values, so 0·NaN at a padding key would reach
    # real rows: keys no query may read are zeroed first (causal future keys are a peer
    # limitation: SDPA itself gives no bit-for-bit guarantee there).
    readable = allowed.any(dim=2).any(dim=1)[:, None, :, None]  # (B', 1, T_k, 1)
    k = p.k.masked_fill(~readable, 0.0)
    v = p.v.masked_fill(~readable, 0.0)
    mask = allowed
    if pt.alibi_slopes is not None or pt.bias is not None or pt.rel_bias is not None:
        # a float bias: ALiBi and the biases where readable, -inf elsewhere
        B, H, T_q, T_k = p.dims
        bdt = torch.float64 if p.q.dtype == torch.float64 else torch.float32
        zero = torch.zeros(1, H, T_q, T_k, dtype=bdt, device=p.q.device)
        bias = pt.modify_scores(zero)
        mask = bias.masked_fill(~allowed, float("-inf")).to(p.q.dtype)
    out = F.scaled_dot_product_attention(
        p.q, k, v, attn_mask=mask, scale=p.scale, enable_gqa=gqa, dropout_p=drop
    )
    # SDPA gives NaN (or a uniform average) on rows with no readable key; ours are zero.
    return out.masked_fill(~allowed.any(dim=-1, keepdim=True), 0.0)
