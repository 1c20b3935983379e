"""Look inside a Hugging Face causal LM: one forward pass, or a greedy generation, and per
layer the seed's stages.

    traces = capture(model, input_ids, attention_mask=None, layers=None, tokenizer=None)
    traces[3].A            # (H, T, T): layer 3's weights, heads leading (B == 1)
    ca.audit(traces[3])    # the in-order audit of that layer
    capture(model, ids, generate=8)   # the prompt and 8 greedy tokens, through the KV cache

The model runs with causalattn's attention function under a :class:`.hf_taps.Tap` (the
engine the model would run under ``attn_implementation="causalattn"``); each chosen layer's
calls are recorded:

- Q, K after rotary embeddings, exactly as the attention function receives them, and V;
  grouped-query K and V are expanded to one per query head when read from the trace;
- H, the engine's real output for the layer, and O, the layer's output projection of it
  (``o_proj`` / ``c_proj`` / ``out_proj``; bias taken off, O = H W_O), through a forward
  hook on the projection registered before the run. In a bf16/fp16 model a recorded
  layer's attention and projection run in float32 (the engines accumulate in float32
  anyway) and are rounded to the model's dtype only on their way back into it;
- the pattern the layer was handed (HF's mask and keywords, :mod:`.hf_pattern`) as M,
  and the pattern the model's config declares for that layer (causal, its window or
  chunk, the padding of ``attention_mask``) as the trace's ``allowed`` — the audit
  compares the two, so a layer that was handed the wrong mask fails at stage M.

With ``generate=N`` the model runs N + 1 times through its own KV cache: the prompt, then
each greedy token (the argmax of the last logits) alone, so the trace has a row for each of
the N generated tokens too (T = prompt + N). Each call's queries are its own rows; its keys
are the last ones of those it read (a KV cache appends); the rows of the mask each call was
handed are put together into one T×T mask, and the structured pattern that reproduces it
exactly (:func:`.hf_pattern.pattern_from_hf`) is the trace's received pattern.

Memory: only Q, K, V, H, O and W_O are kept (float32, O(T·d) per head: 32 MiB a layer for
GPT-2 small at T = 2048, 387 MiB for all 12 layers, measured); the T×T stages are computed
when read (:mod:`.hf_trace`).
"""

from __future__ import annotations

import inspect
from dataclasses import replace
from functools import partial

import numpy as np
import torch

from .. import masks
from .hf_pattern import SUPPORTED_KWARGS, pattern_from_hf
from .hf_taps import Call, Tap, attention_sites, projection
from .hf_trace import CapturedTrace, _Record, _StageCache, token_strings

__all__ = ["capture", "CapturedTrace", "token_strings"]


class _Layer:
    """One recorded layer's calls, in order: the prompt, then one per generated token."""

    def __init__(self):
        self.Q, self.K, self.V, self.H, self.O = [], [], [], [], []
        self.rows: list[tuple[np.ndarray, int]] = []  # each call's allowed rows and keys read
        self.first: tuple | None = None  # (pattern, keywords, module, scale) of the first call
        self.pending: torch.Tensor | None = None  # the last call's H, for the projection hook
        self.W_o: np.ndarray | None = None


class _Recorder(Tap):
    """The tap of one capture: records the chosen layers' calls and their projections."""

    what = "capture"

    def __init__(self, model, layers, engine: str, generating: bool):
        super().__init__(model)
        self.engine, self.generating = engine, generating
        self.layers = {layer: _Layer() for layer in layers}

    def attention(self, call: Call, out: torch.Tensor) -> torch.Tensor:
        rec = self.layers.get(call.layer)
        if rec is None:
            return out
        pat, n = pattern_from_hf(
            call.module, call.query, call.key, call.attention_mask, **call.kwargs
        )
        B, H, T_q, d_k = call.query.shape
        if rec.first is None:
            scale = masks.default_scale(d_k) if call.scaling is None else float(call.scaling)
            kw = {k: call.kwargs[k] for k in SUPPORTED_KWARGS if k in call.kwargs}
            rec.first = (pat, kw, call.module, scale)
        own = slice(n - T_q, n)  # this call's own keys: the last T_q of those it read
        rec.Q.append(_numpy(call.query))
        rec.K.append(_numpy(call.key[:, :, own]))
        rec.V.append(_numpy(call.value[:, :, own]))
        rec.H.append(_numpy(out.transpose(1, 2)))
        if self.generating:
            rec.rows.append((_numpy_bool(pat.allowed(B, H, T_q, n, like=call.query)), n))
        rec.pending = out.detach().reshape(*out.shape[:2], -1)  # (B, T_q, H·d_v)
        return out

    def hooks(self, sites: dict[int, torch.nn.Module]) -> list:
        handles = []
        for layer, rec in self.layers.items():
            proj = projection(sites[layer])
            if proj is not None:
                handles.append(proj.register_forward_hook(partial(self._projected, rec)))
        return handles

    @staticmethod
    def _projected(rec: _Layer, mod, args, output):
        H32, rec.pending = rec.pending, None
        if H32 is None:  # the projection ran without its attention (not in HF's layers)
            return None
        if rec.W_o is None:
            rec.W_o = _w_o(mod)
        b = getattr(mod, "bias", None)
        if output.dtype == H32.dtype:  # the model's own projection, bias taken off
            rec.O.append(_numpy(output.detach() - (0 if b is None else b.detach())))
            return None
        # bf16/fp16: the projection of the float32 H in float32, rounded on the way out
        o = H32 @ torch.from_numpy(rec.W_o).to(H32.device)
        rec.O.append(_numpy(o))
        return (o + (0 if b is None else b.detach().float())).to(output.dtype)

    def record(self, layer: int, ids: torch.Tensor, key_padding, generated: int) -> _Record:
        """The layer's calls as one :class:`_Record` over all T positions."""
        rec = self.layers[layer]
        pat, kw, module, scale = rec.first
        Q, K, V, H = (np.concatenate(a, axis=2) for a in (rec.Q, rec.K, rec.V, rec.H))
        if self.generating:
            pat = _joined(module, Q, K, rec.rows, kw)
        received = _host(pat)
        O = np.concatenate(rec.O, axis=1) if len(rec.O) == len(rec.Q) else None
        return _Record(
            layer=layer,
            Q=Q,
            K=K,
            V=V,
            H=H,
            received=received,
            declared=_host(_declared(module, layer, received, key_padding)),
            scale=scale,
            O=O,
            W_o=rec.W_o if O is not None else None,
            ids=ids.cpu().numpy(),
            generated=generated,
        )


def _joined(module, Q: np.ndarray, K: np.ndarray, rows, kw: dict) -> masks.Pattern:
    """The pattern of a generation's calls together: each call's allowed rows ``(B|1, H|1,
    T_q, n)`` placed at its queries and the last n keys, then the structured pattern that
    reproduces that T×T mask exactly (or the mask itself)."""
    T = Q.shape[2]
    B = max(r.shape[0] for r, _ in rows)
    Hm = max(r.shape[1] for r, _ in rows)
    full = np.zeros((B, Hm, T, T), bool)
    end = 0
    for r, n in rows:
        start, end = end, end + r.shape[2]
        full[:, :, start:end, end - n : end] = r
    pat, _ = pattern_from_hf(
        module, torch.from_numpy(Q), torch.from_numpy(K), torch.from_numpy(full), **kw
    )
    return pat


def _numpy_bool(a) -> np.ndarray:
    return a.detach().cpu().numpy() if isinstance(a, torch.Tensor) else np.asarray(a, bool)


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


def _w_o(proj) -> np.ndarray:
    w = proj.weight.detach().to("cpu", torch.float32)
    # GPT-2's Conv1D stores (in, out) and computes x @ W; nn.Linear stores (out, in)
    return (w if type(proj).__name__ == "Conv1D" else w.T).numpy().copy()


def n_layers(model) -> int:
    """The model's number of transformer layers (its config's num_hidden_layers)."""
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


def _as_ids(input_ids, attention_mask, what: str = "capture: input_ids"):
    """Token ids as ``(B, T)`` and the padding mask as booleans (None when there is none)."""
    ids = torch.as_tensor(input_ids)
    if ids.dim() == 1:
        ids = ids[None]
    if ids.dim() != 2 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ValueError(
            f"{what} must be integer token ids (T,) or (B, T), got "
            f"shape {tuple(ids.shape)} and dtype {ids.dtype}"
        )
    if ids.shape[1] == 0:
        raise ValueError(f"{what} is empty (T = 0); give at least one token")
    am = None
    if attention_mask is not None:
        am = torch.as_tensor(attention_mask)
        if am.dim() == 1:
            am = am[None]
        if tuple(am.shape) != tuple(ids.shape):
            raise ValueError(
                f"{what.split(':')[0]}: attention_mask must be (B, T) = {tuple(ids.shape)} "
                f"like the ids, got {tuple(am.shape)}"
            )
        am = am.bool()
        if bool(am.all()):
            am = None
    return ids, am


def _run(model, ids: torch.Tensor, key_padding, generate: int | None) -> torch.Tensor:
    """Run the model once (no cache), or greedily for ``generate`` tokens through its KV
    cache (N + 1 calls, the last one for the last token's row); all the ids ``(B, T)``."""
    if not generate:
        model(ids, use_cache=False, **_padding(key_padding, ids.shape[1]))
        return ids
    # transformers 5 renames past_key_values to cache (the old name warns, then goes)
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    cache, new = None, ids
    for step in range(generate + 1):
        kw = {"use_cache": True, **_padding(key_padding, new.shape[1])}
        if cache is not None:
            kw[name] = cache
        out = model(new, **kw)
        if step == generate:
            return ids
        cache, new = out[name], out.logits[:, -1:].argmax(-1)
        ids = torch.cat([ids, new], dim=1)
        if key_padding is not None:
            key_padding = torch.cat([key_padding, torch.ones_like(new, dtype=torch.bool)], 1)
    return ids


def _padding(key_padding, T_new: int) -> dict:
    """HF's keywords for a padded batch: the mask so far and the new tokens' positions."""
    if key_padding is None:
        return {}
    pos = (key_padding.long().cumsum(-1) - 1).clamp(min=0)
    return {"attention_mask": key_padding.long(), "position_ids": pos[:, -T_new:]}


def _chosen_layers(layers, n_layers: int) -> list[int]:
    if layers is None:
        return list(range(n_layers))
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
    return chosen


def capture(
    model,
    input_ids,
    attention_mask=None,
    layers=None,
    *,
    tokenizer=None,
    engine: str = "auto",
    generate: int | None = None,
) -> list[CapturedTrace]:
    """Run ``model`` on ``input_ids`` and return one :class:`CapturedTrace` per chosen layer.

    model: a transformers causal LM (any attention implementation; it is switched to
    causalattn's function for this run and back). input_ids ``(T,)`` or ``(B, T)``;
    attention_mask ``(B, T)`` (1 = real token, 0 = padding) or None; layers: indices
    (negative from the end) or None for all; tokenizer: labels the positions with readable
    token strings (default: the model directory's tokenizer when it has one, else ids);
    generate: N > 0 greedy tokens after the prompt, recorded through the KV cache (the
    traces then cover T = prompt + N positions; ``.generated`` is N).
    Traces carry heads as their leading axis (``(H, T, ·)``; ``(B, H, T, ·)`` when B > 1).
    """
    n_model = n_layers(model)
    chosen = _chosen_layers(layers, n_model)
    if generate is not None and (
        isinstance(generate, bool) or not isinstance(generate, (int, np.integer)) or generate < 1
    ):
        raise ValueError(
            f"capture: generate must be a positive number of tokens (or None), got {generate!r}"
        )
    ids, am = _as_ids(input_ids, attention_mask)
    ctx = _context(model)
    total = ids.shape[1] + (generate or 0)
    if ctx is not None and total > ctx:
        raise ValueError(
            f"capture: the text is T = {total} tokens"
            + (f" ({ids.shape[1]} + {generate} generated)" if generate else "")
            + f" but the model's context is {ctx}; shorten it"
        )
    sites = attention_sites(model, "capture")
    absent = [layer for layer in chosen if layer not in sites]
    if absent:
        raise ValueError(
            f"capture: layers {absent} have no attention module with that layer_idx in "
            f"{type(model).__name__}"
        )
    if tokenizer is None:
        tokenizer = _local_tokenizer(model)
    dev = next(model.parameters()).device
    ids = ids.to(dev)
    key_padding = None if am is None else am.to(dev)
    rec = _Recorder(model, chosen, engine, generating=bool(generate))
    was_training = model.training
    try:
        model.eval()
        with rec, torch.no_grad():
            ids = _run(model, ids, key_padding, generate)
    finally:
        model.train(was_training)
    missing = [layer for layer in chosen if not rec.layers[layer].Q]
    if missing:
        raise ValueError(
            f"capture: layers {missing} never called the attention function; is "
            f"this a transformer causal LM ({type(model).__name__})?"
        )
    if key_padding is not None and generate:
        ones = torch.ones(ids.shape[0], generate, dtype=torch.bool, device=dev)
        key_padding = torch.cat([key_padding, ones], dim=1)
    toks = [token_strings(tokenizer, row) for row in ids.cpu().tolist()]
    cache = _StageCache()
    return [
        CapturedTrace(rec.record(layer, ids, key_padding, generate or 0), toks, cache)
        for layer in chosen
    ]


def _local_tokenizer(model):
    path = getattr(model.config, "_name_or_path", None) or getattr(model, "name_or_path", None)
    if not path:
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception:  # no tokenizer saved with the model: positions are labelled by id
        return None
