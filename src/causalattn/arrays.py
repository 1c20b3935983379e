"""The types the public signatures name (annotations only: nothing here runs).

``Array`` is what the engines and the layer take: a NumPy array or a torch tensor.
``ArrayLike`` is what the float64 reference, the audit and the masks also take: an array,
a tensor or nested sequences of numbers. ``MaskMod`` and ``ScoreMod`` are FlexAttention's
signatures: ``mask_mod(b, h, q_idx, kv_idx) -> bool`` and ``score_mod(score, b, h, q_idx,
kv_idx) -> score``, each argument a scalar or a tensor of indices. Shapes are in each
function's docstring: (B, H, T, d) for the engines, T×d for one sequence of the seed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeAlias

if TYPE_CHECKING:  # torch and numpy only for the type checker: importing this costs nothing
    from collections.abc import Callable, Sequence

    import numpy as np
    import torch

__all__ = ["Array", "ArrayLike", "Tensor", "MaskMod", "ScoreMod"]

Tensor: TypeAlias = "torch.Tensor"
Array: TypeAlias = "np.ndarray | torch.Tensor"
ArrayLike: TypeAlias = "np.ndarray | torch.Tensor | Sequence[float] | Sequence[Sequence[float]]"
MaskMod: TypeAlias = "Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]"
ScoreMod: TypeAlias = "Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]"
