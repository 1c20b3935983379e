"""torch: the private names the operators and the HF pattern memo need (torch 2.13).

Each has no public counterpart in torch 2.13; tests/test_internals.py fails when torch
renames one or changes what it does.

- :func:`autograd_inside`: a ``torch.library.custom_op``'s implementation runs below the
  Autograd dispatch keys (torch excludes them from the thread's dispatch set there, so
  ``torch.enable_grad()`` alone records nothing). The reference's recomputation and a
  score_mod's tiles are differentiated by autograd inside the operators, so the keys are
  put back for that block. torch has no public guard for this (``torch.library`` offers
  ``register_autograd`` for an operator's own backward, not autograd inside one); the
  guard is ``torch._C._ForceDispatchKeyGuard`` over ``_dispatch_tls_local_*_set``.
- :func:`constant_result`: what ``torch.compiler.assume_constant_result`` does (it sets
  ``fn._dynamo_marked_constant``, which Dynamo reads when it traces a call to ``fn``),
  without its ``import torch._dynamo`` when causalattn is imported (that import is about
  half of the CLI's start-up). The public decorator is the same attribute.
- :func:`transforms_active`: whether a torch.func transform (grad, vjp, vmap) is running;
  the public ``torch.func`` has no query (torch's own autograd.Function asks
  ``torch._C._are_functorch_transforms_active``). Under a transform the tensors still
  have type ``torch.Tensor``, so no public test of the inputs tells.
- :func:`is_fake`: whether a tensor is a FakeTensor (traced shapes, no data), outside the
  Dynamo and export tracing that ``torch.compiler.is_compiling`` / ``is_exporting`` report
  (a user's own ``FakeTensorMode``); FakeTensor lives only in ``torch._subclasses``.
- :func:`version`: a tensor's version counter, which every in-place write bumps, the only
  way to tell that a tensor's data changed without reading it (``Tensor._version``; the
  public ``torch.autograd.graph.increment_version`` only writes it).
"""

from __future__ import annotations

import torch

__all__ = ["autograd_inside", "constant_result", "transforms_active", "is_fake", "version"]

# the Autograd keys an operator's implementation runs without (the names torch has)
AUTOGRAD_KEYS = ("AutogradFunctionality", "AutogradOther", "AutogradNestedTensor")


def autograd_inside():
    """A guard that re-enables autograd dispatch inside an operator's implementation."""
    C = torch._C
    ex = C._dispatch_tls_local_exclude_set()
    for key in AUTOGRAD_KEYS:
        if hasattr(C.DispatchKey, key):
            ex = ex.remove(getattr(C.DispatchKey, key))
    return C._ForceDispatchKeyGuard(C._dispatch_tls_local_include_set(), ex)


def constant_result(fn):
    """``torch.compiler.assume_constant_result(fn)``, without importing ``torch._dynamo``."""
    fn._dynamo_marked_constant = True
    return fn


def transforms_active() -> bool:
    """Whether a torch.func transform (grad, vjp, jacrev, vmap, ...) is running now."""
    return torch._C._are_functorch_transforms_active()


def is_fake(t) -> bool:
    """Whether ``t`` is a FakeTensor (shapes and dtypes only, no data)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def version(t: torch.Tensor) -> int:
    """``t``'s version counter: it grows with every in-place write to ``t``'s data."""
    return t._version
