"""The head table of a Hugging Face causal LM: each head's role, measured on repeated random
tokens, and what ablating it costs. What ``causalattn heads --model DIR`` prints.

    table = measure(model, tokenizer, length=24, sequences=16, seed=0, ablate=True)
    print(table.format())      # layers and heads 1-based, as on the command line
    table.rows()               # the same as dicts (what --json prints)

The probe: ``sequences`` sequences of ``length`` distinct random tokens (the tokenizer's
vocabulary without its special tokens, nor the pad, eos and bos ids the model's config
names) repeated twice, after the tokenizer's BOS token when
it has one (:func:`causalattn.inspect.repeated_tokens`). The scores are
:func:`causalattn.inspect.head_roles` of a capture of that batch. The losses are the mean
next-token cross-entropy over the first repeat's targets (its 2nd to last token: the 1st
follows nothing the model has seen) and over the second repeat's (its 2nd to last token:
each can be copied from the first repeat); ``ablate`` adds, per head, the second-repeat
loss with that head ablated (:func:`.hf_edit.ablate`) and its ratio to the model's own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from ..inspect import SCORES, HeadRole, head_roles, repeated_tokens
from .hf_capture import _context, capture
from .hf_edit import ablate as _ablate

__all__ = ["measure", "probe_ids", "repeat_losses", "HeadTable"]


def probe_ids(
    model, tokenizer, *, length: int, sequences: int, seed: int
) -> tuple[torch.Tensor, bool]:
    """(ids ``(sequences, [1 +] 2·length)``, whether a BOS token leads) for this model."""
    n_vocab = model.get_input_embeddings().num_embeddings
    special = set(getattr(tokenizer, "all_special_ids", []) or []) | _named_ids(model, tokenizer)
    size = len(tokenizer) if tokenizer is not None else n_vocab
    vocab = [i for i in range(min(size, n_vocab)) if i not in special]
    bos = getattr(tokenizer, "bos_token_id", None) if tokenizer is not None else None
    ctx = _context(model)
    T = 2 * length + (bos is not None)
    if ctx is not None and T > ctx:
        raise ValueError(
            f"--max-len: {length} tokens repeated twice{' after BOS' if bos is not None else ''}"
            f" is T = {T}, longer than the model's context of {ctx}"
        )
    ids = repeated_tokens(vocab, sequences, length, seed=seed, first=bos)
    return torch.from_numpy(ids), bos is not None


def _named_ids(model, tokenizer) -> set[int]:
    """The pad, eos and bos ids the tokenizer or the model's config names (a config's eos may
    be a list): never probe tokens, with a tokenizer or without one."""
    out: set[int] = set()
    for src in (tokenizer, getattr(model, "config", None)):
        for name in ("pad_token_id", "eos_token_id", "bos_token_id"):
            v = getattr(src, name, None) if src is not None else None
            for i in v if isinstance(v, (list, tuple)) else [v]:
                if isinstance(i, int) and not isinstance(i, bool):
                    out.add(i)
    return out


def repeat_losses(model, ids: torch.Tensor, length: int, bos: bool) -> tuple[float, float]:
    """(first-repeat loss, second-repeat loss): mean next-token cross-entropy over the
    targets 2..L of each repeat (positions shifted by one after a BOS token)."""
    o = int(bos)
    dev = next(model.parameters()).device
    with torch.no_grad():
        logits = model(ids.to(dev), use_cache=False).logits.float()
    ce = torch.nn.functional.cross_entropy(
        logits[:, :-1].transpose(1, 2), ids[:, 1:].to(dev), reduction="none"
    )  # ce[:, p - 1] is the loss of the token at position p
    first = ce[:, o : o + length - 1].mean().item()  # targets o+1 .. o+L-1
    second = ce[:, o + length : o + 2 * length - 1].mean().item()  # targets o+L+1 .. o+2L-1
    return first, second


@dataclass
class HeadTable:
    """Each head's scores (and, with ``ablated``, its ablation's second-repeat loss)."""

    architecture: str
    roles: list[HeadRole]
    length: int
    sequences: int
    seed: int
    loss_first: float
    loss_second: float
    how: str = "zero"
    ablated: dict[tuple[int, int], float] = field(default_factory=dict)

    def rows(self, base: int = 1) -> list[dict]:
        """One dict per head: layer and head counted from ``base``, NaN as None."""
        out = []
        for r in self.roles:
            d = {"layer": r.layer + base, "head": r.head + base}
            d.update({k: _finite(getattr(r, k)) for k in SCORES})
            d["role"] = r.role
            if self.ablated:
                loss = self.ablated[(r.layer, r.head)]
                d["ablated_loss"] = _finite(loss)
                d["loss_ratio"] = _finite(loss / self.loss_second) if self.loss_second else None
            out.append(d)
        return out

    def format(self, base: int = 1) -> str:
        """The table as plain lines (never wrapped), layers and heads counted from ``base``."""
        layers = len({r.layer for r in self.roles})
        heads = len(self.roles) // max(layers, 1)
        # a first-repeat loss of 0 (a model sure of random tokens) has no ratio, as in rows()
        ratio = _finite(self.loss_second / self.loss_first) if self.loss_first else None
        lines = [
            f"{self.architecture}: {layers} layers × {heads} heads, on {self.sequences} random "
            f"sequences of {self.length} tokens repeated twice (seed {self.seed})",
            f"loss on the first repeat {self.loss_first:.3f}, on the second {self.loss_second:.4f}"
            f" (ratio {_num(ratio, 4)})",
        ]
        cols = ["previous_token", "induction", "first_token", "mean_distance", "entropy"]
        extra = ["ablated_loss", "loss_ratio"] if self.ablated else []
        head = f"{'layer':>5}  {'head':>4}  {'role':<14}" + "".join(f"  {c:>14}" for c in cols)
        lines.append(head + "".join(f"  {c:>12}" for c in extra))
        for d in self.rows(base):
            line = f"{d['layer']:>5}  {d['head']:>4}  {d['role'] or '-':<14}"
            line += "".join(f"  {_num(d[c], 3):>14}" for c in cols)
            line += "".join(f"  {_num(d[c], 4):>12}" for c in extra)
            lines.append(line)
        if self.ablated:
            lines.append(
                f"ablated_loss: the second-repeat loss with that head ablated ({self.how}); "
                "loss_ratio: that over the model's own"
            )
        return "\n".join(lines)


def _finite(x) -> float | None:
    return float(x) if x is not None and math.isfinite(x) else None


def _num(x, digits: int) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def measure(
    model,
    tokenizer,
    *,
    length: int = 24,
    sequences: int = 16,
    seed: int = 0,
    ablate: bool = False,
    how: str = "zero",
) -> HeadTable:
    """The head table of ``model`` on its probe (see the module docstring)."""
    for name, v in (("--max-len", length), ("--sequences", sequences)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    if how not in ("zero", "mean"):
        raise ValueError(f"--how must be 'zero' or 'mean', got {how!r}")
    if length < 2:
        raise ValueError(
            f"--max-len must be at least 2 (a repeat's loss starts at its 2nd), got {length}"
        )
    ids, bos = probe_ids(model, tokenizer, length=length, sequences=sequences, seed=seed)
    roles = head_roles(capture(model, ids, tokenizer=tokenizer))
    first, second = repeat_losses(model, ids, length, bos)
    table = HeadTable(type(model).__name__, roles, length, sequences, seed, first, second, how)
    if ablate:
        for r in roles:
            with _ablate(model, heads=[(r.layer, r.head)], how=how):
                table.ablated[(r.layer, r.head)] = repeat_losses(model, ids, length, bos)[1]
    return table
