# causalattn learn exercise: softmax (torch)
"""Reference solution of the softmax exercise (the tests plant faults into it)."""

import torch


def softmax(z):
    m = z.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # a row of -inf reads nothing
    e = torch.exp(z - m)
    total = e.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, e / total.clamp_min(1e-300), torch.zeros_like(e))
