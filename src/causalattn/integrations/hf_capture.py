"""Look inside a Hugging Face causal LM: one forward pass, and per layer the seed's stages.

    traces = capture(model, input_ids, attention_mask=None, layers=None, tokenizer=None)
    traces[3].A            # (H, T, T): layer 3's weights, heads leading (B == 1)
    ca.audit(traces[3])    # the in-order audit of that layer

The model runs once with causalattn's attention function (the engine the model would run
under ``attn_implementation="causalattn"``); each chosen layer's call is recorded:

- Q, K after rotary embeddings, exactly as the attention function receives them, and V;
  grouped-query K and V are expanded to one per query head when read from the trace;
- H, the engine's real output for the layer, and O, the layer's output projection of it
  (``o_proj`` / ``c_proj`` / ``out_proj``; bias taken off, O = H W_O). In a bf16/fp16 model
  a recorded layer's attention and projection run in float32 (the engines accumulate in
  float32 anyway) and are rounded to the model's dtype only on their way back into it;
- the pattern the layer was handed (HF's mask and keywords, :mod:`.hf_pattern`) as M,
  and the pattern the model's config declares for that layer (causal, its window or
  chunk, the padding of ``attention_mask``) as the trace's ``allowed`` — the audit
  compares the two, so a layer that was handed the wrong mask fails at stage M.

Memory: only Q, K, V, H, O and W_O are kept (float32, O(T·d) per head: 32 MiB a layer for
GPT-2 small at T = 2048, 387 MiB for all 12 layers, measured); S, [S_cap, E,] M, Z, A, C,
``allowed`` and ``reasons`` are T×T per head and are recomputed from Q, K, V and the
pattern in float64 by :func:`layer_stages` when they are read (returned as float32); only
the last layer read keeps its T×T stages, so reading S, M, Z, A of one layer computes them
once. C (T×T×d_v) is offered only while it stays under ``reference.C_LIMIT_BYTES``.
"""

from __future__ import annotations

import contextvars
import math
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, replace

import numpy as np
import torch

from .. import masks
from ..reference import C_LIMIT_BYTES
from ..trace import Trace
from .hf_pattern import pattern_from_hf

__all__ = ["capture", "CapturedTrace", "layer_stages", "token_strings", "CAPTURE_NAME"]

CAPTURE_NAME = "causalattn-capture"
_PROJECTIONS = ("o_proj", "c_proj", "out_proj", "dense", "wo")
_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("causalattn_capture", default=None)


# ---- the stages of one layer --------------------------------------------------------------


def layer_stages(Q, K, V, pattern: masks.Pattern, scale: float) -> dict[str, torch.Tensor]:
    """S, [S_cap, E,] M, Z, A and H of one layer, in float64, from what its attention received.

    Q ``(B, H, T_q, d_k)``, K ``(B, H, T_k, d_k)``, V ``(B, H, T_k, d_v)`` (heads expanded),
    torch float64. As :func:`causalattn.trace`: S = Q Kᵀ·scale; S_cap = c·tanh(S/c) with a
    softcap; E the ALiBi bias; M the additive mask (0 / -inf, ``(B|1, H|1, T_q, T_k)``);
    Z = S_cap + E + M; A the row softmax with the pattern's sinks in each denominator;
    H = A V. A row with no readable key is zero.
    """
    B, H, T_q, _ = Q.shape
    T_k = K.shape[-2]
    allowed = pattern.allowed(B, H, T_q, T_k, like=Q)
    out = {"S": (Q @ K.transpose(-1, -2)) * scale}
    Sm = out["S"]
    if pattern.softcap is not None:
        Sm = out["S_cap"] = pattern.only("softcap").modify_scores(Sm)
    if pattern.has_additive:  # ALiBi, rel_bias, bias
        E = pattern.only("alibi_slopes", "rel_bias", "bias").modify_scores(torch.zeros_like(Sm))
        out["E"] = E
        Sm = Sm + out["E"]
    M = out["M"] = torch.zeros(allowed.shape, dtype=Q.dtype).masked_fill(~allowed, -math.inf)
    Z = out["Z"] = Sm + M
    has_key = allowed.any(-1, keepdim=True)
    m = Z.amax(-1, keepdim=True)
    sinks = None
    if pattern.sinks is not None:
        sinks = torch.as_tensor(np.asarray(masks._numpy(pattern.sinks), np.float64))
        sinks = sinks.view(1, H, 1, 1)
        m = torch.maximum(m, sinks)
    m = torch.where(has_key, m, torch.zeros_like(m))
    E = torch.exp(Z - m)  # exactly 0 where M is -inf
    denom = E.sum(-1, keepdim=True)
    if sinks is not None:
        denom = denom + torch.exp(sinks - m)
    A = out["A"] = torch.where(
        has_key, E / torch.where(has_key, denom, torch.ones_like(denom)), 0.0
    )
    out["H"] = A @ V
    return out


# ---- one recorded layer -------------------------------------------------------------------


@dataclass(frozen=True)
class _Record:
    layer: int
    Q: np.ndarray  # (B, H, T_q, d_k) float32
    K: np.ndarray  # (B, H_kv, T_k, d_k)
    V: np.ndarray  # (B, H_kv, T_k, d_v)
    H: np.ndarray  # (B, H, T_q, d_v): the engine's output
    received: masks.Pattern  # what the layer's attention was handed
    declared: masks.Pattern  # what the model's config says the layer should apply
    scale: float
    O: np.ndarray | None = None  # (B, T_q, d_model), bias taken off
    W_o: np.ndarray | None = None  # (H·d_v, d_model)

    def expand(self, a: np.ndarray) -> np.ndarray:
        g = self.Q.shape[1] // a.shape[1]
        return a if g == 1 else np.repeat(a, g, axis=1)  # HF's repeat_kv: head h reads h // g


def _pattern_rows(p: masks.Pattern, b: slice) -> masks.Pattern:
    """The pattern restricted to batch rows b (per-row fields sliced, the rest kept)."""
    kw = {}
    for name in ("lengths", "prefix_lengths", "key_padding_mask"):
        v = getattr(p, name)
        if v is not None:
            kw[name] = v[b]
    if p.mask is not None and p.mask.shape[0] > 1:
        kw["mask"] = p.mask[b]
    if p.alibi_slopes is not None and p.alibi_slopes.ndim == 2:
        kw["alibi_slopes"] = p.alibi_slopes[b]
    return replace(p, **kw) if kw else p


def _pattern_heads(p: masks.Pattern, h: slice) -> masks.Pattern:
    kw = {}
    if p.mask is not None and p.mask.ndim == 4 and p.mask.shape[1] > 1:
        kw["mask"] = p.mask[:, h]
    if p.sinks is not None:
        kw["sinks"] = p.sinks[h]
    if p.alibi_slopes is not None:
        kw["alibi_slopes"] = p.alibi_slopes[..., h]
    return replace(p, **kw) if kw else p


class _LazyStages(Mapping):
    """The trace's arrays: kept ones as they are, T×T ones computed on each read."""

    def __init__(self, rec: _Record, squeeze: bool, stages):
        self.rec, self.squeeze, self.stages = rec, squeeze, stages
        B, H, T_q, _ = rec.Q.shape
        T_k, d_v = rec.K.shape[2], rec.V.shape[3]
        names = ["Q", "K", "V", "S"]
        names += ["S_cap"] * (rec.received.softcap is not None)
        names += ["E"] * rec.received.has_additive
        names += ["M", "Z", "A", "H"]
        if B * H * T_q * T_k * d_v * 8 <= C_LIMIT_BYTES:
            names.append("C")
        if rec.O is not None:
            names += ["W_o", "O"]
        self.names = names

    def __iter__(self):
        return iter(self.names)

    def __len__(self):
        return len(self.names)

    def __contains__(self, name):
        return name in self.names

    def __getitem__(self, name):
        if name not in self.names:
            raise KeyError(name)
        r = self.rec
        if name in ("Q", "H", "O", "W_o"):
            out = getattr(r, name)
        elif name in ("K", "V"):
            out = r.expand(getattr(r, name))
        else:
            out = self._computed(name)
        if self.squeeze and name != "W_o":
            out = out[0]
        return out

    def _computed(self, name):
        st = _last_stages(self.rec, self.stages)
        if name == "C":
            A, V = st["A"], self.rec.expand(self.rec.V)
            return A[..., None] * V[..., None, :, :]
        out = st[name]
        return np.broadcast_to(out, st["S"].shape) if name in ("M", "E") else out


# The T×T stages of the one layer read last, as float32: reading S, M, Z, A and C of a layer
# (as the audit does) computes them once, and at most one layer's stages are ever held.
_LAST: list = [None, None]  # [weakref to the _Record, {name: float32 array}]


def _last_stages(rec: _Record, compute) -> dict[str, np.ndarray]:
    if _LAST[0] is None or _LAST[0]() is not rec:
        _LAST[:] = [None, None]  # drop the previous layer's arrays before computing these
        st = {k: v.numpy().astype(np.float32) for k, v in compute().items() if k != "H"}
        _LAST[:] = [weakref.ref(rec), st]
    return _LAST[1]


class CapturedTrace(Trace):
    """A :class:`Trace` of one layer of a Hugging Face model (see the module docstring).

    Extra attributes: ``layer`` (its index), ``pattern`` (the pattern the config declares,
    whose dense form is ``allowed``), ``received`` (the pattern the layer was handed),
    ``batch_tokens`` (token strings per sequence).
    """

    def __init__(self, rec: _Record, tokens: list[list[str]] | None):
        B, H = rec.Q.shape[:2]
        squeeze = B == 1
        self._rec = rec
        self._arrays = _LazyStages(rec, squeeze, lambda: self._stages())
        self.scale = rec.scale
        self.n_heads = H
        self.layer = rec.layer
        self.pattern = rec.declared
        self.received = rec.received
        self.batch_tokens = tokens
        self.tokens = tokens[0] if tokens is not None and squeeze else None

    @property
    def allowed(self) -> np.ndarray:
        """The declared pattern's dense mask, ``(1|H, T_q, T_k)`` (``(B|1, 1|H, ...)`` for a
        batch), True = may read; built on each read, like the T×T stages."""
        B, H, T_q, _ = self._rec.Q.shape
        a = self.pattern.allowed(B, H, T_q, self._rec.K.shape[2])
        return a[0] if B == 1 else a

    @property
    def reasons(self) -> np.ndarray:
        """Why each cell is blocked (uint8 codes of :data:`causalattn.masks.REASONS`)."""
        B, H, T_q, _ = self._rec.Q.shape
        r = self.pattern.reasons(B, H, T_q, self._rec.K.shape[2])
        return r[0] if B == 1 else r

    def _stages(self) -> dict[str, torch.Tensor]:
        """This layer's S, M, Z, A, H in float64 (:func:`layer_stages`), computed afresh."""
        r = self._rec
        Q, K, V = (
            torch.from_numpy(np.asarray(a, np.float64)) for a in (r.Q, r.expand(r.K), r.expand(r.V))
        )
        return layer_stages(Q, K, V, r.received, r.scale)

    def __repr__(self) -> str:
        return f"CapturedTrace(layer {self.layer}, {super().__repr__()})"

    def select(self, *index: int):
        """``select(h)`` on one sequence, ``select(b)`` or ``select(b, h)`` on a batch: a plain
        :class:`Trace` of that slice, computed for that slice only."""
        B = self._rec.Q.shape[0]
        if B == 1:
            index = (0, *index)
        if not 1 <= len(index) <= 2:
            raise ValueError(
                f"select: give (b,) or (b, h) for a batch, (h,) for one sequence; got {index}"
            )
        b = index[0]
        r = self._rec
        kw = {}
        bs = slice(b, b + 1)
        hs = slice(None)
        if len(index) == 2:
            h = index[1]
            g = r.Q.shape[1] // r.K.shape[1]
            hs, kvs = slice(h, h + 1), slice(h // g, h // g + 1)
            kw = {
                "Q": r.Q[bs, hs],
                "K": r.K[bs, kvs],
                "V": r.V[bs, kvs],
                "H": r.H[bs, hs],
                "O": None,
                "W_o": None,
            }
        else:
            kw = {
                "Q": r.Q[bs],
                "K": r.K[bs],
                "V": r.V[bs],
                "H": r.H[bs],
                "O": None if r.O is None else r.O[bs],
            }
        sub = replace(
            r,
            **kw,
            received=_pattern_heads(_pattern_rows(r.received, bs), hs),
            declared=_pattern_heads(_pattern_rows(r.declared, bs), hs),
        )
        tokens = None if self.batch_tokens is None else [self.batch_tokens[b]]
        tr = CapturedTrace(sub, tokens)
        if len(index) == 2:  # one head: no head axis
            arrays = {n: tr[n][0] for n in tr.names}
            return Trace(
                arrays,
                allowed=tr.allowed[0],
                scale=tr.scale,
                tokens=tr.tokens,
                pattern=tr.pattern,
                reasons=tr.reasons[0],
            )
        return tr


# ---- readable tokens ----------------------------------------------------------------------


def _byte_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-ins (GPT-2's 'Ġ' for a space) -> the byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[chr(b)] = b
        else:
            out[chr(256 + extra)] = b
            extra += 1
    return out


_BYTES = _byte_alphabet()


def _is_byte_level(tokenizer) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(
        tokenizer, "_tokenizer", None
    )
    dec = getattr(backend, "decoder", None)
    return "ByteLevel" in repr(dec) if dec is not None else False


def token_strings(tokenizer, ids) -> list[str]:
    """Each id as readable text: byte-level pieces decoded ('Ġ' -> ' ', 'Ċ' -> '\\n'; a
    piece holding part of a UTF-8 character shows U+FFFD), SentencePiece's '▁' as a space.
    Without a tokenizer, the ids themselves."""
    ids = [int(i) for i in ids]
    if tokenizer is None:
        return [str(i) for i in ids]
    pieces = tokenizer.convert_ids_to_tokens(ids)
    byte_level = _is_byte_level(tokenizer)
    out = []
    for p, i in zip(pieces, ids):
        if p is None:
            out.append(f"<{i}>")
        elif byte_level and all(ch in _BYTES for ch in p):
            out.append(bytes(_BYTES[ch] for ch in p).decode("utf-8", errors="replace"))
        else:
            out.append(p.replace("▁", " "))
    return out


# ---- the run ------------------------------------------------------------------------------


def _numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().to("cpu", torch.float32).numpy()


def _host(p: masks.Pattern) -> masks.Pattern:
    """The pattern with its arrays on the host (NumPy), detached from the model."""
    kw = {}
    for name in ("key_padding_mask", "mask", "sinks", "alibi_slopes"):
        v = getattr(p, name)
        if v is not None and masks._is_torch(v):
            kw[name] = v.detach().cpu().numpy()
    if kw.get("sinks") is not None:
        kw["sinks"] = kw["sinks"].astype(np.float64)
    return replace(p, **kw) if kw else p


def _declared(module, layer: int, received: masks.Pattern, key_padding) -> masks.Pattern:
    """The pattern the model's config declares for this layer: causal, the layer type's
    window or chunk, the padding of the input's attention_mask; the modifiers received."""
    cfg = getattr(module, "config", None)
    types = getattr(cfg, "layer_types", None)
    kind = types[layer] if types is not None and layer < len(types) else None
    window = chunk = None
    if kind == "sliding_attention" or (kind is None and getattr(cfg, "sliding_window", None)):
        window = getattr(cfg, "sliding_window", None)
    if kind == "chunked_attention":
        chunk = getattr(cfg, "attention_chunk_size", None)
    causal = bool(getattr(cfg, "is_causal", True)) and bool(getattr(module, "is_causal", True))
    if chunk is not None and key_padding is not None and not bool(key_padding[:, 0].all()):
        # HF counts Llama 4's chunks from each row's first real token, the chunk rule from
        # position 0: with left padding no Pattern declares it, and the layer's own is taken
        return received
    return masks.Pattern(
        causal=causal,
        window=window,
        chunk=chunk,
        key_padding_mask=key_padding,
        softcap=received.softcap,
        sinks=received.sinks,
        alibi_slopes=received.alibi_slopes,
    )


def _projection(module):
    for name in _PROJECTIONS:
        proj = getattr(module, name, None)
        if isinstance(proj, torch.nn.Module) and hasattr(proj, "weight"):
            return proj
    return None


def _w_o(proj) -> np.ndarray:
    w = proj.weight.detach().to("cpu", torch.float32)
    # GPT-2's Conv1D stores (in, out) and computes x @ W; nn.Linear stores (out, in)
    return (w if type(proj).__name__ == "Conv1D" else w.T).numpy().copy()


class _Recorder:
    def __init__(self, layers: set[int], key_padding, engine: str):
        self.layers, self.key_padding, self.engine = layers, key_padding, engine
        self.records: dict[int, dict] = {}
        self.calls = 0

    def __call__(
        self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs
    ):
        from .transformers import attention_forward

        layer = getattr(module, "layer_idx", None)
        layer = self.calls if layer is None else int(layer)
        self.calls += 1
        if layer not in self.layers:
            return attention_forward(
                module,
                query,
                key,
                value,
                attention_mask,
                scaling,
                dropout,
                engine=self.engine,
                **kwargs,
            )
        # a recorded layer runs in float32 at least (the engines accumulate in float32 for
        # bf16/fp16 anyway), so its H is the engine's before the rounding to the model's dtype
        up = torch.promote_types(query.dtype, torch.float32)
        out, _ = attention_forward(
            module,
            query.to(up),
            key.to(up),
            value.to(up),
            attention_mask,
            scaling,
            dropout,
            engine=self.engine,
            **kwargs,
        )
        pat, n = pattern_from_hf(module, query, key, attention_mask, **kwargs)
        scale = float(scaling) if scaling is not None else masks.default_scale(query.shape[-1])
        key_padding = self.key_padding
        if key_padding is not None:
            key_padding = key_padding[:, :n] if key_padding.shape[1] >= n else None
        rec = {
            "layer": layer,
            "Q": _numpy(query),
            "K": _numpy(key[:, :, :n]),
            "V": _numpy(value[:, :, :n]),
            "H": _numpy(out.transpose(1, 2)),
            "received": _host(pat),
            "scale": scale,
        }
        rec["declared"] = _host(_declared(module, layer, rec["received"], key_padding))
        proj = _projection(module)
        if proj is not None:
            H32 = out.detach().reshape(*out.shape[:2], -1)  # (B, T_q, H·d_v), as o_proj reads it

            def hook(mod, args, output, rec=rec):
                handle.remove()
                W = torch.from_numpy(_w_o(mod)).to(H32.device)
                b = getattr(mod, "bias", None)
                if output.dtype == H32.dtype:  # the model's own projection, bias taken off
                    o = output.detach() - (0 if b is None else b.detach())
                    rec["O"], rec["W_o"] = _numpy(o), W.cpu().numpy()
                    return None
                # bf16/fp16: the projection of the float32 H in float32, rounded on the way out
                o = H32 @ W
                rec["O"], rec["W_o"] = _numpy(o), W.cpu().numpy()
                return (o + (0 if b is None else b.detach().float())).to(output.dtype)

            handle = proj.register_forward_hook(hook)
        self.records[layer] = rec
        return out.to(query.dtype), None


def _dispatch(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    rec = _ACTIVE.get()
    if rec is None:
        raise ValueError(
            f"attn_implementation={CAPTURE_NAME!r} runs only inside capture(); "
            "use 'causalattn' otherwise"
        )
    return rec(module, query, key, value, attention_mask, scaling, dropout, **kwargs)


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    from .transformers import mask_function

    AttentionInterface.register(CAPTURE_NAME, _dispatch)
    AttentionMaskInterface.register(CAPTURE_NAME, mask_function)


def _n_layers(model) -> int:
    cfg = (
        model.config.get_text_config()
        if hasattr(model.config, "get_text_config")
        else (model.config)
    )
    n = getattr(cfg, "num_hidden_layers", None)
    if not isinstance(n, int):
        raise ValueError(
            f"capture: the model's config ({type(cfg).__name__}) names no "
            "num_hidden_layers; is it a transformer language model?"
        )
    return n


def _context(model) -> int | None:
    cfg = (
        model.config.get_text_config()
        if hasattr(model.config, "get_text_config")
        else (model.config)
    )
    for name in ("max_position_embeddings", "n_positions", "n_ctx", "seq_length"):
        v = getattr(cfg, name, None)
        if isinstance(v, int) and v > 0:
            return v
    return None


def _as_ids(input_ids, attention_mask):
    ids = torch.as_tensor(input_ids)
    if ids.dim() == 1:
        ids = ids[None]
    if ids.dim() != 2 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ValueError(
            f"capture: input_ids must be integer token ids (T,) or (B, T), got "
            f"shape {tuple(ids.shape)} and dtype {ids.dtype}"
        )
    if ids.shape[1] == 0:
        raise ValueError("capture: input_ids is empty (T = 0); give at least one token")
    am = None
    if attention_mask is not None:
        am = torch.as_tensor(attention_mask)
        if am.dim() == 1:
            am = am[None]
        if tuple(am.shape) != tuple(ids.shape):
            raise ValueError(
                f"capture: attention_mask must be (B, T) = {tuple(ids.shape)} like "
                f"input_ids, got {tuple(am.shape)}"
            )
        am = am.bool()
        if bool(am.all()):
            am = None
    return ids, am


def capture(
    model, input_ids, attention_mask=None, layers=None, *, tokenizer=None, engine: str = "auto"
) -> list[CapturedTrace]:
    """Run ``model`` once on ``input_ids`` and return one :class:`CapturedTrace` per chosen layer.

    model: a transformers causal LM (any attention implementation; it is switched to
    causalattn's function for this run and back). input_ids ``(T,)`` or ``(B, T)``;
    attention_mask ``(B, T)`` (1 = real token, 0 = padding) or None; layers: indices
    (negative from the end) or None for all; tokenizer: labels the positions with readable
    token strings (default: the model directory's tokenizer when it has one, else ids).
    Traces carry heads as their leading axis (``(H, T, ·)``; ``(B, H, T, ·)`` when B > 1).
    """
    try:
        _register()
    except ImportError as exc:
        raise ImportError("capture needs `pip install causalattn[hf]`") from exc
    n_layers = _n_layers(model)
    if layers is None:
        chosen = list(range(n_layers))
    else:
        chosen = []
        for x in [layers] if isinstance(layers, int) else list(layers):
            if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
                raise ValueError(f"capture: layers must be integers, got {x!r}")
            if not -n_layers <= x < n_layers:
                raise ValueError(
                    f"capture: layer {x} is out of range; the model has "
                    f"{n_layers} layers (0..{n_layers - 1})"
                )
            chosen.append(int(x) % n_layers)
        if not chosen:
            raise ValueError("capture: layers is empty; give at least one layer index")
    ids, am = _as_ids(input_ids, attention_mask)
    ctx = _context(model)
    if ctx is not None and ids.shape[1] > ctx:
        raise ValueError(
            f"capture: the text is T = {ids.shape[1]} tokens but the model's "
            f"context is {ctx}; shorten it"
        )
    if tokenizer is None:
        tokenizer = _local_tokenizer(model)
    dev = next(model.parameters()).device
    ids = ids.to(dev)
    key_padding = None if am is None else am.to(dev)
    rec = _Recorder(set(chosen), key_padding, engine)
    old = model.config._attn_implementation
    token = _ACTIVE.set(rec)
    was_training = model.training
    try:
        model.eval()
        model.set_attn_implementation(CAPTURE_NAME)
        kw = {} if key_padding is None else {"attention_mask": key_padding.long()}
        if key_padding is not None:  # HF's convention for padded batches
            kw["position_ids"] = (key_padding.long().cumsum(-1) - 1).clamp(min=0)
        with torch.no_grad():
            model(ids, use_cache=False, **kw)
    finally:
        _ACTIVE.reset(token)
        model.set_attn_implementation(old)
        model.train(was_training)
    missing = [layer for layer in chosen if layer not in rec.records]
    if missing:
        raise ValueError(
            f"capture: layers {missing} never called the attention function; is "
            f"this a transformer causal LM ({type(model).__name__})?"
        )
    toks = [token_strings(tokenizer, row) for row in ids.cpu().tolist()]
    return [CapturedTrace(_Record(**rec.records[layer]), toks) for layer in chosen]


def _local_tokenizer(model):
    path = getattr(model.config, "_name_or_path", None) or getattr(model, "name_or_path", None)
    if not path:
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception:  # no tokenizer saved with the model: positions are labelled by id
        return None
