"""CausalSelfAttention: the seed's projections and one engine call, as an ``nn.Module``.

    Q = X W_Q,  K = X W_K,  V = X W_V,  H = softmax_last(Q Kᵀ/√d_k + M) V,  O = H W_O

Weights are stored in the seed's ``X @ W`` layout, not ``nn.Linear``'s transposed one:

    W_q: d_model×(h·d_k)    W_k: d_model×(h_kv·d_k)    W_v: d_model×(h_kv·d_v)
    W_o: (h·d_v)×d_model    biases b_q, b_k, b_v, b_o (optional)

so ``layer.W_q`` is exactly the seed's W_Q (GPT-2's ``Conv1D`` uses the same layout; an
``nn.Linear`` weight is its transpose). ``n_kv_heads < n_heads`` is grouped-query
attention: query head i reads key/value head ``i // (n_heads // n_kv_heads)``.
"""

from __future__ import annotations

import itertools
import math
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from . import dropout as _dropout
from . import masks as _masks
from . import masks_mod as _masks_mod
from .engines import KVCache, attention
from .masks import shape_str as _shape_str

if TYPE_CHECKING:
    from ._trace import Trace
    from .arrays import ArrayLike, MaskMod, ScoreMod
    from .shapes import Row

__all__ = ["CausalSelfAttention", "from_gpt2_attention", "from_nanogpt_state_dict"]

_CACHE_IDS = itertools.count(1)  # each layer's owner id for the KVCache it fills

# One materialized T×T stage of the float64 trace (B·h·T²·8 bytes) may take at most this.
TRACE_LIMIT_BYTES = 64 * 2**20


def _positive(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"CausalSelfAttention: {name} must be a positive integer, got {value!r}")
    return value


# the layer's older keywords, by their new names (kept one release, with a warning)
RENAMED = {"bias": "proj_bias", "alibi": "alibi_slopes", "attn_dropout": "dropout_p"}


def _renamed(given: dict, proj_bias, alibi_slopes, dropout_p):
    """(proj_bias, alibi_slopes, dropout_p) with any older keyword of ``given`` in its new
    name's place (a DeprecationWarning each); a keyword neither old nor new is refused as
    Python refuses it, an old one given with its new one names both."""
    new = {"proj_bias": proj_bias, "alibi_slopes": alibi_slopes, "dropout_p": dropout_p}
    default = {"proj_bias": False, "alibi_slopes": False, "dropout_p": 0.0}
    for old, value in given.items():
        if old not in RENAMED:
            raise TypeError(f"CausalSelfAttention() got an unexpected keyword argument {old!r}")
        name = RENAMED[old]
        if new[name] != default[name]:
            raise ValueError(f"CausalSelfAttention: {old}= is the older name of {name}=; give one")
        warnings.warn(
            f"CausalSelfAttention: {old}= is now {name}= (the older name goes in the next release)",
            DeprecationWarning,
            stacklevel=3,
        )
        new[name] = value
    return new["proj_bias"], new["alibi_slopes"], new["dropout_p"]


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention on :func:`causalattn.attention`.

    ``d_k`` and ``d_v`` default to ``d_model // n_heads``; ``n_kv_heads`` (default
    ``n_heads``) enables grouped-query attention; ``scale`` defaults to 1/√d_k.
    ``engine`` is any name :func:`causalattn.attention` takes ("auto", "tiled", "sdpa",
    "reference", ...). ``proj_bias`` gives the four projections biases b_q, b_k, b_v, b_o.
    The pattern (:class:`causalattn.masks.Pattern`): ``window`` (each
    query reads its last ``window`` positions), ``chunk``, ``alibi_slopes`` (True: fixed slopes,
    :func:`causalattn.masks.alibi_slopes`), ``softcap`` and ``sinks`` (one learned sink
    logit per head, the parameter ``sinks``), ``mask_mod`` and ``score_mod`` (any rule or
    function of the scores, :mod:`causalattn.masks_mod`; a score_mod's learned tensors get
    their gradients). ``dropout_p`` drops attention weights in ``train()`` mode only, as
    ``nn.Dropout`` does. ``forward`` takes a call's own pattern keywords (``bias=``, ...). The
    older constructor keywords ``bias``, ``alibi`` and ``attn_dropout`` still work for this
    release, with a DeprecationWarning.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        *,
        d_k: int | None = None,
        d_v: int | None = None,
        n_kv_heads: int | None = None,
        proj_bias: bool = False,
        scale: float | None = None,
        engine: str = "auto",
        window: int | None = None,
        chunk: int | None = None,
        alibi_slopes: bool = False,
        softcap: float | None = None,
        sinks: bool = False,
        mask_mod: MaskMod | None = None,
        score_mod: ScoreMod | None = None,
        dropout_p: float = 0.0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        **renamed: object,
    ):
        super().__init__()
        proj_bias, alibi_slopes, dropout_p = _renamed(renamed, proj_bias, alibi_slopes, dropout_p)
        self.d_model = _positive("d_model", d_model)
        self.n_heads = _positive("n_heads", n_heads)
        if d_k is None and d_model % n_heads:
            raise ValueError(
                f"CausalSelfAttention: d_model={d_model} is not divisible by n_heads={n_heads}; "
                "give d_k (and d_v) explicitly"
            )
        self.d_k = _positive("d_k", d_model // n_heads if d_k is None else d_k)
        self.d_v = _positive("d_v", self.d_k if d_v is None else d_v)
        self.n_kv_heads = _positive("n_kv_heads", n_heads if n_kv_heads is None else n_kv_heads)
        if n_heads % self.n_kv_heads:
            raise ValueError(
                f"CausalSelfAttention: n_heads={n_heads} must be a multiple of "
                f"n_kv_heads={self.n_kv_heads} (grouped-query attention)"
            )
        if scale is not None and (
            isinstance(scale, bool)
            or not isinstance(scale, (int, float, np.floating, np.integer))
            or not math.isfinite(scale)
        ):
            raise ValueError(f"CausalSelfAttention: scale must be a finite number, got {scale!r}")
        self.scale = None if scale is None else float(scale)
        self.engine = engine
        self.cache_id = next(_CACHE_IDS)
        # validated once here, by the one definition of M
        _masks.Pattern(
            window=window, chunk=chunk, softcap=softcap, mask_mod=mask_mod, score_mod=score_mod
        )
        self.window, self.chunk, self.softcap = window, chunk, softcap
        self.mask_mod, self.score_mod = mask_mod, score_mod
        self.dropout_p = _dropout.check_p(dropout_p, "CausalSelfAttention: dropout_p")
        for name, flag in (
            ("proj_bias", proj_bias),
            ("alibi_slopes", alibi_slopes),
            ("sinks", sinks),
        ):
            if not isinstance(flag, bool):
                raise ValueError(f"CausalSelfAttention: {name} must be True or False, got {flag!r}")
        f = {"device": device, "dtype": dtype}
        h, g = self.n_heads, self.n_kv_heads
        self.W_q = nn.Parameter(torch.empty(d_model, h * self.d_k, **f))
        self.W_k = nn.Parameter(torch.empty(d_model, g * self.d_k, **f))
        self.W_v = nn.Parameter(torch.empty(d_model, g * self.d_v, **f))
        self.W_o = nn.Parameter(torch.empty(h * self.d_v, d_model, **f))
        # fixed ALiBi slopes (not saved: they follow from n_heads) and learned sink logits
        slopes = (
            torch.as_tensor(_masks.alibi_slopes(h), dtype=dtype, device=device)
            if alibi_slopes
            else None
        )
        self.register_buffer("alibi_slopes", slopes, persistent=False)
        self.sinks = nn.Parameter(torch.zeros(h, **f)) if sinks else None
        for name, n in (
            ("b_q", h * self.d_k),
            ("b_k", g * self.d_k),
            ("b_v", g * self.d_v),
            ("b_o", d_model),
        ):
            self.register_parameter(name, nn.Parameter(torch.zeros(n, **f)) if proj_bias else None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Normal weights with std 1/√fan_in (fan_in = rows of W in the X @ W layout); zero
        biases."""
        with torch.no_grad():
            for W in (self.W_q, self.W_k, self.W_v, self.W_o):
                W.normal_(0.0, 1.0 / math.sqrt(W.shape[0]))
            for b in (self.b_q, self.b_k, self.b_v, self.b_o, self.sinks):
                if b is not None:
                    b.zero_()

    def extra_repr(self) -> str:
        kv = f", n_kv_heads={self.n_kv_heads}" if self.n_kv_heads != self.n_heads else ""
        return (
            f"d_model={self.d_model}, n_heads={self.n_heads}{kv}, d_k={self.d_k}, d_v={self.d_v}, "
            f"proj_bias={self.b_q is not None}, engine={self.engine!r}{self._pattern_repr()}"
        )

    def _pattern_repr(self) -> str:
        parts = [
            f"{n}={getattr(self, n)!r}"
            for n in ("window", "chunk", "softcap")
            if getattr(self, n) is not None
        ]
        parts += [n + "=True" for n in ("alibi_slopes", "sinks") if getattr(self, n) is not None]
        parts += [
            f"{n}={_masks_mod.name_of(getattr(self, n))}"
            for n in ("mask_mod", "score_mod")
            if getattr(self, n) is not None
        ]
        if self.dropout_p:
            parts.append(f"dropout_p={self.dropout_p}")
        return "".join(", " + p for p in parts)

    # --- forward -----------------------------------------------------------------------

    def _project(self, x: torch.Tensor, W: torch.Tensor, b, heads: int) -> torch.Tensor:
        """(B, T, d_model) @ d_model×(heads·d) -> (B, heads, T, d)."""
        B, T, _ = x.shape
        d = W.shape[1] // heads  # explicit, so that B = 0 gives (0, heads, T, d), not an error
        if b is None:
            Y = x @ W
        else:
            Y = torch.addmm(b, x.reshape(-1, x.shape[-1]), W).view(B, T, W.shape[1])
        return Y.view(B, T, heads, d).transpose(1, 2)

    def _check_x(self, x) -> None:
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[-1] != self.d_model:
            got = _shape_str(x) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(
                f"CausalSelfAttention: x must be (B, T, d_model) with d_model={self.d_model}, got "
                f"{got}"
            )
        if x.shape[1] == 0:
            raise ValueError(
                f"CausalSelfAttention: x is {_shape_str(x)}; a sequence needs T >= 1 token"
            )
        if x.dtype != self.W_q.dtype:
            raise ValueError(
                f"CausalSelfAttention: x is {x.dtype} but the weights are {self.W_q.dtype}; "
                "cast one to the other (layer.to(dtype))"
            )

    def _check_padding(self, B: int, T_k: int, key_padding_mask, lengths) -> None:
        if key_padding_mask is not None:
            key_padding = key_padding_mask
            if (
                not isinstance(key_padding, torch.Tensor)
                or key_padding.dtype != torch.bool
                or tuple(key_padding.shape) != (B, T_k)
            ):
                got = (
                    f"{_shape_str(key_padding)} {key_padding.dtype}"
                    if isinstance(key_padding, torch.Tensor)
                    else type(key_padding).__name__
                )
                raise ValueError(
                    f"key_padding_mask: expected a bool tensor (B, T_k) = ({B}, {T_k}) (True = may "
                    f"read; T_k counts cached positions too), got {got}"
                )
        if lengths is not None:
            try:
                L = torch.as_tensor(lengths)
            except (TypeError, ValueError, RuntimeError) as exc:
                raise ValueError(
                    f"lengths: expected an integer tensor (B,) = ({B},), got {lengths!r:.40} "
                    f"({exc})"
                ) from exc
            if (
                L.dim() != 1
                or L.shape[0] != B
                or L.dtype.is_floating_point
                or L.dtype == torch.bool
            ):
                raise ValueError(
                    f"lengths: expected an integer tensor (B,) = ({B},), got shape {_shape_str(L)} "
                    f"and dtype {L.dtype}"
                )

    def _check_cache(self, kv_cache, x: torch.Tensor) -> None:
        if not isinstance(kv_cache, KVCache):
            raise ValueError(
                f"kv_cache: expected a causalattn.KVCache, got {type(kv_cache).__name__}"
            )
        if len(kv_cache):
            k = kv_cache.k
            want = (x.shape[0], self.n_kv_heads, self.d_k)
            if (k.shape[0], k.shape[1], k.shape[3]) != want or kv_cache.v.shape[3] != self.d_v:
                raise ValueError(
                    f"kv_cache: holds k {_shape_str(k)} and v {_shape_str(kv_cache.v)} (B, H_kv, "
                    "T, d); this "
                    f"layer with x {_shape_str(x)} needs (B, H_kv, ·, d_k) = ({want[0]}, "
                    f"{want[1]}, ·, "
                    f"{want[2]}) and d_v = {self.d_v} (a cache from another layer or batch size?)"
                )
            if k.dtype != x.dtype or k.device != x.device:
                raise ValueError(
                    f"kv_cache: holds {k.dtype} on {k.device}, but x is {x.dtype} on {x.device}"
                )

    def _call_keywords(self, pattern, keywords: dict, attn_bias) -> dict:
        """The pattern keywords attention gets: the call's joined with the layer's own, only
        those set (so a plain call keeps attention's shortcut)."""
        where = "CausalSelfAttention.forward"
        call = _masks.keywords_of(pattern, keywords, where)
        if attn_bias is not None:
            warnings.warn(
                f"{where}: attn_bias is now bias (the pattern keyword); attn_bias goes in "
                "the next release",
                DeprecationWarning,
                stacklevel=3,
            )
            if call["bias"] is not None:
                raise ValueError(f"{where}: give bias or attn_bias (its old name), not both")
            call["bias"] = attn_bias
        own = {
            "window": self.window,
            "chunk": self.chunk,
            "alibi_slopes": self.alibi_slopes,
            "softcap": self.softcap,
            "sinks": self.sinks,
            "mask_mod": self.mask_mod,
            "score_mod": self.score_mod,
        }
        both = [n for n, v in own.items() if v is not None and call[n] is not None]
        if both:
            raise ValueError(
                f"{where}: {', '.join(both)} is the layer's own (set at construction) and "
                "was given to the call too; give it once"
            )
        out = {n: v for n, v in call.items() if v is not _masks.DEFAULTS[n]}
        return {**out, **{n: v for n, v in own.items() if v is not None}}

    @_masks.takes_pattern
    def forward(
        self,
        x: torch.Tensor,
        *,
        pattern: _masks.Pattern | None = None,
        kv_cache: KVCache | None = None,
        attn_bias: torch.Tensor | None = None,
        **keywords,
    ) -> torch.Tensor:
        """O ``(B, T, d_model)`` for x ``(B, T, d_model)``.

        The call's pattern (``pattern`` or its keywords, as for :func:`causalattn.attention`)
        joins the layer's own (window, chunk, ALiBi, softcap, sinks, mask_mod, score_mod,
        set at construction); one set by both is refused by name. ``lengths`` ``(B,)``: real
        positions per sequence (keys past it blocked, queries past it padding rows, whose H
        is zero). ``key_padding_mask`` ``(B, T_k)`` bool, True = may read. With ``kv_cache``
        this step's K and V are appended first and the T new queries are the last T
        positions (bottom-right alignment); T_k then counts the cached positions too.
        ``bias``: an additive score bias broadcastable to (B, h, T, T_k) (it may require a
        gradient); ``attn_bias`` is its old name, kept for one release.
        """
        kw = self._call_keywords(pattern, keywords, attn_bias)
        self._check_x(x)
        B, T, _ = x.shape
        T_k = T + (len(kv_cache) if kv_cache is not None else 0)
        if kv_cache is not None:
            self._check_cache(kv_cache, x)
        self._check_padding(B, T_k, kw.get("key_padding_mask"), kw.get("lengths"))
        if kv_cache is not None:  # after every check: a refused call claims nothing
            kv_cache.claim(self.cache_id, "CausalSelfAttention layer")

        q = self._project(x, self.W_q, self.b_q, self.n_heads)  # (B, h, T, d_k)
        k = self._project(x, self.W_k, self.b_k, self.n_kv_heads)  # (B, h_kv, T, d_k)
        v = self._project(x, self.W_v, self.b_v, self.n_kv_heads)  # (B, h_kv, T, d_v)
        if kv_cache is not None:
            k, v = kv_cache.append(k, v)
        H = attention(
            q,
            k,
            v,
            scale=self.scale,
            engine=self.engine,
            dropout_p=self.dropout_p if self.training else 0.0,
            **kw,
        )  # (B, h, T, d_v)
        H = H.transpose(1, 2).reshape(B, T, self.n_heads * self.d_v)
        O = H @ self.W_o
        return O if self.b_o is None else O + self.b_o

    # --- inspection --------------------------------------------------------------------

    def trace(
        self,
        x: ArrayLike,
        *,
        lengths: ArrayLike | None = None,
        key_padding_mask: ArrayLike | None = None,
        tokens: list[str] | None = None,
    ) -> Trace:
        """The float64 reference :class:`~causalattn.Trace` of this layer on x, head by head.

        x: ``T×d_model`` or ``(B, T, d_model)`` (tensor or array). Every stage is
        materialized, so T is kept small (one T×T stage of all heads at most 64 MiB).
        With biases, X gets a trailing column of ones and each of W_q, W_k, W_v a last
        row holding its bias, so ``Q = X W_Q`` still holds exactly; the trace's O is
        ``H W_O`` and the layer returns ``O + b_o``. With grouped-query attention each
        query head is shown with its own copy of the K and V head it reads.
        """
        from .matrix_form import trace as _trace

        X = (
            x.detach().to("cpu", torch.float64).numpy()
            if isinstance(x, torch.Tensor)
            else np.asarray(x, np.float64)
        )
        if X.ndim not in (2, 3) or X.shape[-1] != self.d_model:
            raise ValueError(
                f"trace: x must be T×d_model or (B, T, d_model) with d_model={self.d_model}, got "
                f"{X.shape}"
            )
        B, T = (1, X.shape[0]) if X.ndim == 2 else X.shape[:2]
        per_stage = B * self.n_heads * T * T * 8
        if per_stage > TRACE_LIMIT_BYTES:
            raise ValueError(
                f"trace: x {X.shape} with {self.n_heads} heads makes each T×T stage "
                f"{per_stage / 2**20:.0f} MiB in float64 (limit {TRACE_LIMIT_BYTES // 2**20} MiB); "
                "trace a shorter slice, e.g. x[..., :256, :]"
            )
        per_seq = {}
        if lengths is not None or key_padding_mask is not None:
            if X.ndim == 2:
                raise ValueError(
                    "trace: lengths / key_padding_mask need a batch, x (B, T, d_model)"
                )
            self._check_padding(B, T, key_padding_mask, lengths)
            if lengths is not None:
                per_seq["lengths"] = np.asarray(torch.as_tensor(lengths).cpu())
            if key_padding_mask is not None:
                per_seq["key_padding_mask"] = key_padding_mask.cpu().numpy()

        def w(p):
            return p.detach().to("cpu", torch.float64).numpy()

        g = self.n_heads // self.n_kv_heads
        W = {"W_q": w(self.W_q), "W_k": w(self.W_k), "W_v": w(self.W_v)}
        if g > 1:  # one copy of its K/V head per query head
            for n, d in (("W_k", self.d_k), ("W_v", self.d_v)):
                W[n] = np.repeat(W[n].reshape(self.d_model, self.n_kv_heads, d), g, axis=1).reshape(
                    self.d_model, -1
                )
        if self.b_q is not None:
            X = np.concatenate([X, np.ones(X.shape[:-1] + (1,))], axis=-1)
            bias = {"W_q": w(self.b_q), "W_k": w(self.b_k), "W_v": w(self.b_v)}
            for n in W:
                b = bias[n]
                if g > 1 and n != "W_q":
                    b = np.repeat(b.reshape(self.n_kv_heads, -1), g, axis=0).reshape(-1)
                W[n] = np.concatenate([W[n], b[None, :]], axis=0)
        return _trace(
            X,
            W["W_q"],
            W["W_k"],
            W["W_v"],
            w(self.W_o),
            causal=True,
            **per_seq,
            window=self.window,
            chunk=self.chunk,
            softcap=self.softcap,
            alibi_slopes=None if self.alibi_slopes is None else w(self.alibi_slopes),
            sinks=None if self.sinks is None else w(self.sinks),
            mask_mod=self.mask_mod,
            score_mod=self.score_mod,
            scale=self.scale,
            n_heads=self.n_heads,
            tokens=tokens,
        )

    def shape_table(self, T: int) -> list[Row]:
        """The seed's dimension table for this layer at sequence length T
        (:mod:`causalattn.shapes`)."""
        from .shapes import shape_table

        return shape_table(T, self.d_model, self.n_heads, d_k=self.d_k, d_v=self.d_v)

    # --- loading -----------------------------------------------------------------------

    @classmethod
    def from_gpt2_attention(cls, module: nn.Module, *, engine: str = "auto") -> CausalSelfAttention:
        """A layer with the weights of a transformers ``GPT2Attention`` (self-attention).

        GPT-2's ``c_attn`` is a ``Conv1D`` whose weight is d_model×(3·d_model) in the
        ``X @ W`` layout already: its column blocks are W_Q | W_K | W_V. Scaling follows
        the module (``scale_attn_weights``, ``scale_attn_by_inverse_layer_idx``).
        """
        c_attn, c_proj = getattr(module, "c_attn", None), getattr(module, "c_proj", None)
        if c_attn is None or c_proj is None or getattr(module, "is_cross_attention", False):
            raise ValueError(
                "from_gpt2_attention: expected a GPT-2 self-attention module with c_attn and "
                "c_proj, "
                f"got {type(module).__name__}"
            )
        d_model, n_heads = int(module.embed_dim), int(module.num_heads)
        scale = getattr(module, "scaling", None)
        if scale is None:  # transformers < 5 keeps the flags only
            scale = (d_model // n_heads) ** -0.5 if module.scale_attn_weights else 1.0
            if module.scale_attn_by_inverse_layer_idx:
                scale /= float(module.layer_idx + 1)
        layer = cls(
            d_model,
            n_heads,
            proj_bias=True,
            scale=float(scale),
            engine=engine,
            device=c_attn.weight.device,
            dtype=c_attn.weight.dtype,
        )
        layer._load(c_attn.weight, c_attn.bias, c_proj.weight, c_proj.bias, "from_gpt2_attention")
        return layer

    @classmethod
    def from_nanogpt_state_dict(
        cls,
        state_dict: Mapping[str, torch.Tensor],
        n_heads: int,
        *,
        prefix: str = "",
        engine: str = "auto",
    ) -> CausalSelfAttention:
        """A layer from a nanoGPT ``CausalSelfAttention`` state dict (``c_attn``/``c_proj``).

        nanoGPT uses ``nn.Linear``, whose weight is the transpose of the seed's W:
        ``c_attn.weight`` is (3·d_model)×d_model, so W_Q | W_K | W_V = ``c_attn.weight.T``.
        ``prefix`` selects one block of a whole model, e.g. ``"transformer.h.0.attn."``.
        """
        keys = [prefix + "c_attn.weight", prefix + "c_proj.weight"]
        missing = [k for k in keys if k not in state_dict]
        if missing:
            raise ValueError(f"from_nanogpt_state_dict: state_dict has no {missing}")
        Wa, Wp = state_dict[keys[0]], state_dict[keys[1]]
        ba, bp = state_dict.get(prefix + "c_attn.bias"), state_dict.get(prefix + "c_proj.bias")
        d_model = Wa.shape[1]
        layer = cls(
            d_model,
            n_heads,
            proj_bias=ba is not None,
            engine=engine,
            device=Wa.device,
            dtype=Wa.dtype,
        )
        layer._load(Wa.t(), ba, Wp.t(), bp, "from_nanogpt_state_dict")
        return layer

    def _load(self, W_qkv, b_qkv, W_o, b_o, who: str) -> None:
        """Copy fused W_Q | W_K | W_V ``d_model×(3·h·d)`` and W_O in the X @ W layout."""
        D = self.d_model
        want = (D, 3 * self.n_heads * self.d_k)
        if tuple(W_qkv.shape) != want or tuple(W_o.shape) != (self.n_heads * self.d_v, D):
            raise ValueError(
                f"{who}: expected W_Q|W_K|W_V {want[0]}×{want[1]} and W_O "
                f"{self.n_heads * self.d_v}×{D}, got {_shape_str(W_qkv)} and {_shape_str(W_o)}"
            )
        with torch.no_grad():
            Wq, Wk, Wv = W_qkv.split(self.n_heads * self.d_k, dim=1)
            self.W_q.copy_(Wq)
            self.W_k.copy_(Wk)
            self.W_v.copy_(Wv)
            self.W_o.copy_(W_o)
            if self.b_q is not None:
                bq, bk, bv = b_qkv.split(self.n_heads * self.d_k)
                self.b_q.copy_(bq)
                self.b_k.copy_(bk)
                self.b_v.copy_(bv)
                self.b_o.copy_(b_o)


from_gpt2_attention = CausalSelfAttention.from_gpt2_attention
from_nanogpt_state_dict = CausalSelfAttention.from_nanogpt_state_dict
