"""transformers: a model's current attention implementation.

Why no public API serves: transformers (5.x) has a public setter,
``PreTrainedModel.set_attn_implementation``, but no public getter; the setter itself reads
``model.config._attn_implementation``, and it only logs a warning (it changes nothing) for a
model that computes attention in its own code. A tap must know both what to restore and
whether the model took the new one, so it reads the same attribute.
tests/test_internals.py fails when transformers renames it.
"""

from __future__ import annotations

__all__ = ["attn_implementation"]


def attn_implementation(model) -> str | None:
    """The attention implementation ``model`` runs now ("eager", "sdpa", a registered name)."""
    return model.config._attn_implementation
