"""A Hugging Face checkpoint folder -> model, tokenizer, ids; and the audit of every layer.

What ``causalattn audit --model DIR "text"`` and ``causalattn explore model DIR "text"``
run. Every refusal is a ValueError naming what is wrong in one line (the CLI prints it as
``error: ...`` and exits 2): a folder that is not a model, a model that is not a causal
LM, no tokenizer, an empty text, a text longer than the model's context.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = ["load", "encode", "audit_layers", "LayerAudit"]


def _from_cache(name: str) -> Path | None:
    """A hub id such as ``gpt2`` or ``org/name`` -> its snapshot folder in the local Hugging
    Face cache (never downloaded), or None."""
    if Path(name).is_absolute() or name.startswith(".") or name.count("/") > 1:
        return None
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name, local_files_only=True))
    except Exception:  # not cached, or not a valid id: the caller says "no such folder"
        return None


def load(path: str | Path):
    """(model, tokenizer) from a folder written by ``save_pretrained`` (or a hub id already in
    the local cache, e.g. ``gpt2``), in float32, eval mode, on the CPU; nothing is
    downloaded (``local_files_only``)."""
    try:
        import transformers
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError:
        raise ValueError("--model needs transformers: pip install 'causalattn[hf]'") from None
    p = Path(path)
    if not p.is_dir():
        cached = _from_cache(str(path))
        if cached is None:
            raise ValueError(
                f"{p}: no such folder, nor a model in the local Hugging Face cache "
                "(give a folder written by save_pretrained)"
            )
        p = cached
    if not (p / "config.json").is_file():
        raise ValueError(f"{p}: not a Hugging Face model folder (no config.json)")
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    try:
        model = AutoModelForCausalLM.from_pretrained(
            p, local_files_only=True, attn_implementation="eager", dtype="float32"
        )
    except (ValueError, KeyError) as exc:  # a config type with no causal-LM head
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(
            f"{p}: not a causal language model transformers can load here ({first[:200]})"
        ) from None
    except OSError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"{p}: the model cannot be read ({first[:200]})") from None
    cfg = model.config.get_text_config()
    if (
        getattr(cfg, "is_encoder_decoder", False)
        or getattr(cfg, "is_decoder", True) is False
        or not getattr(cfg, "is_causal", True)
    ):
        raise ValueError(
            f"{p}: not a causal language model ({type(cfg).__name__} attends both ways)"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(p, local_files_only=True)
    except (OSError, ValueError, TypeError) as exc:
        raise ValueError(
            f"{p}: no usable tokenizer saved with the model "
            f"({str(exc).strip().splitlines()[0][:200] if str(exc).strip() else exc})"
        ) from None
    return model.eval(), tokenizer


def encode(tokenizer, text: str, model):
    """The text as ids ``(1, T)``, with the tokenizer's special tokens; refuses an empty text
    and one longer than the model's context."""
    from .hf_capture import _context

    if not text or not text.strip():
        raise ValueError("text: empty; give the text to run the model on")
    ids = tokenizer(text, return_tensors="pt")["input_ids"]
    if ids.shape[1] == 0:
        raise ValueError("text: the tokenizer made no tokens of it")
    ctx = _context(model)
    if ctx is not None and ids.shape[1] > ctx:
        raise ValueError(
            f"text: {ids.shape[1]} tokens, longer than the model's context of "
            f"{ctx} tokens; shorten it"
        )
    return ids


@dataclass
class LayerAudit:
    """One row of the summary: a layer's verdict and two numbers worth seeing."""

    layer: int
    heads: int
    ok: bool
    stage: str | None  # first failing stage (None: ok)
    check: str | None
    message: str | None
    hint: str | None
    worst_row_sum_error: float  # max over readable rows of |Σ_j A_ij - (1 - sink weight)|
    empty_rows: int  # query rows with no readable key (padding), over all heads
    report: object

    def to_dict(self) -> dict:
        return {
            "layer": self.layer,
            "heads": self.heads,
            "ok": self.ok,
            "stage": self.stage,
            "check": self.check,
            "message": self.message,
            "hint": self.hint,
            "worst_row_sum_error": self.worst_row_sum_error,
            "empty_rows": self.empty_rows,
            "report": self.report.to_dict(),
        }


def _row_sum_error(tr) -> float:
    """Each readable row of the trace's A (float32) must sum to 1 less its sink's weight."""
    A = np.asarray(tr.A, np.float64)
    A = A.reshape((1,) * (4 - A.ndim) + A.shape)  # (B, H, T_q, T_k)
    allowed = np.broadcast_to(tr.received.allowed(*A.shape[:2], *A.shape[2:]), A.shape)
    has_key = allowed.any(-1)
    want = np.ones(has_key.shape)
    if tr.received.sinks is not None:
        Z = np.asarray(tr.Z, np.float64).reshape(A.shape)
        s = np.asarray(tr.received.sinks, np.float64)[None, :, None]
        m = np.maximum(np.where(has_key, Z.max(-1), 0.0), s)
        with np.errstate(invalid="ignore", over="ignore"):
            e = np.exp(Z - m[..., None]).sum(-1)
        want = e / (e + np.exp(s - m))
    err = np.abs(A.sum(-1) - want)[has_key]
    return float(err.max()) if err.size else 0.0


def audit_layers(traces) -> list[LayerAudit]:
    """``causalattn.audit`` on each captured layer, in order, with the summary numbers."""
    from ..check import audit

    rows = []
    for tr in traces:
        report = audit(tr)
        ff = report.first_failure
        rows.append(
            LayerAudit(
                layer=tr.layer,
                heads=tr.n_heads,
                ok=report.ok,
                stage=None if ff is None else ff.stage,
                check=None if ff is None else ff.name,
                message=None if ff is None else ff.message,
                hint=None if ff is None else ff.hint,
                worst_row_sum_error=_row_sum_error(tr),
                empty_rows=sum(len(e["rows"]) for e in report.empty_rows),
                report=report,
            )
        )
    return rows
