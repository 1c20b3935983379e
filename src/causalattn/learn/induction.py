"""A small transformer trained here, in about a minute of CPU, to copy in context.

    path = causalattn.learn.train_induction("induction-model", seed=0)
    # causalattn heads --model induction-model        (its layers × heads, roles measured)
    # causalattn explore --model induction-model "ba ko ri ... ba ko ri ..." -o page.html

The model is a Hugging Face Llama (rotary positions): 2 layers × 4 heads of 16, d_model 64,
an MLP of 128, over 256 made-up words (``WORDS``) and ``<pad> <s> </s> <unk>``, with a
word-level tokenizer trained here with ``tokenizers`` on those words. It is trained on
sequences ``<s> x x``: x is ``L`` distinct random words, L drawn per batch from
``LENGTHS``, so that no fixed offset copies the first repeat — only an induction circuit
does (a previous-token head in layer 1, then a head in layer 2 that reads the token after
the earlier copy of the current one). Next-token cross-entropy, AdamW, a one-cycle
learning rate, seeded (torch's and the data's generators). Over the second half of the
steps a group penalty ``HEAD_PENALTY · Σ_heads ‖W_O[h]‖_F`` on each head's slice of the
output projection lets the heads the circuit does not need fall silent (as head pruning
does): without it all four heads of layer 2 end up sharing the copy, and no head of that
layer is left to compare the induction heads with. The folder holds what
``save_pretrained`` writes for the model and the tokenizer, and ``training.json`` (the
steps, seconds and held-out losses).
"""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path

import numpy as np

__all__ = ["train_induction", "WORDS", "LENGTHS", "STEPS", "HEAD_PENALTY"]

STEPS = 600
BATCH = 64
HEAD_PENALTY = 0.1  # on Σ_heads ‖W_O[h]‖_F, from step STEPS // 2 on
LENGTHS = (6, 40)  # the repeated sequence's length L, drawn per batch, both ends included
PROBE_LENGTH = 24  # the held-out check's L (and `causalattn heads`' default)
SPECIAL = ("<pad>", "<s>", "</s>", "<unk>")


def _words(n: int = 256) -> tuple[str, ...]:
    """n made-up two-syllable words ('bako', 'rimu', ...), the same on every machine."""
    syllables = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]
    pairs = [a + b for a, b in itertools.product(syllables, syllables) if a != b]
    pick = np.random.default_rng(0).choice(len(pairs), size=n, replace=False)
    return tuple(pairs[i] for i in pick)


WORDS = _words()


def _tokenizer():
    """A word-level tokenizer over WORDS, trained with `tokenizers`, as transformers' fast one."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    trainer = trainers.WordLevelTrainer(special_tokens=list(SPECIAL), show_progress=False)
    tok.train_from_iterator([" ".join(WORDS)], trainer)
    bos = ("<s>", tok.token_to_id("<s>"))  # every text starts as the training sequences do
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[bos])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
    )


def _model(tokenizer, d_model: int = 64, n_heads: int = 4):
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=d_model,
        intermediate_size=2 * d_model,
        num_hidden_layers=2,
        num_attention_heads=n_heads,
        num_key_value_heads=n_heads,
        head_dim=d_model // n_heads,
        max_position_embeddings=128,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")


def _head_norms(model):
    """Σ over layers and heads of ‖W_O[h]‖_F, each head's columns of the output projection."""
    from ..integrations.hf_taps import attention_sites, n_heads, projection

    H = n_heads(model)
    total = 0.0
    for module in attention_sites(model, "train_induction").values():
        W = projection(module).weight  # (d_model, H·d_v), nn.Linear's (out, in)
        total = total + W.view(W.shape[0], H, -1).norm(dim=(0, 2)).sum()
    return total


def _batch(rng: np.random.Generator, vocab: np.ndarray, bos: int, n: int, length: int):
    import torch

    from ..inspect import repeated_tokens

    ids = repeated_tokens(vocab, n, length, seed=int(rng.integers(2**31)), first=bos)
    return torch.from_numpy(ids)


def train_induction(
    out_dir,
    seed: int = 0,
    *,
    steps: int = STEPS,
    batch: int = BATCH,
    lr: float = 3e-3,
) -> Path:
    """Train the model (module docstring) and write it to ``out_dir`` (created if missing; its
    parent must exist). Returns the folder's path. ``steps`` and ``batch`` make a quicker,
    weaker model (the tests' own)."""
    import torch

    from ..integrations.hf_heads import repeat_losses

    out = Path(out_dir)
    if not out.parent.is_dir():
        raise ValueError(f"train_induction: the folder {out.parent} does not exist")
    for name, v, least in (("seed", seed, 0), ("steps", steps, 1), ("batch", batch, 1)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < least:
            raise ValueError(f"train_induction: {name} must be an integer >= {least}, got {v!r}")
    tokenizer = _tokenizer()
    vocab = np.array([tokenizer.convert_tokens_to_ids(w) for w in WORDS])
    bos = tokenizer.bos_token_id
    torch.manual_seed(seed)
    model = _model(tokenizer)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    rng = np.random.default_rng(seed)
    start = time.perf_counter()
    model.train()
    for step in range(steps):
        ids = _batch(rng, vocab, bos, batch, int(rng.integers(LENGTHS[0], LENGTHS[1] + 1)))
        loss = model(ids, labels=ids, use_cache=False).loss
        if step >= steps // 2:
            loss = loss + HEAD_PENALTY * _head_norms(model)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    seconds = time.perf_counter() - start
    model.eval()
    held_out = _batch(np.random.default_rng(seed + 10**6), vocab, bos, 64, PROBE_LENGTH)
    first, second = repeat_losses(model, held_out, PROBE_LENGTH, bos=True)
    out.mkdir(exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    facts = {
        "seed": seed,
        "steps": steps,
        "batch": batch,
        "seconds": round(seconds, 1),
        "held_out_length": PROBE_LENGTH,
        "first_repeat_loss": first,
        "second_repeat_loss": second,
        "ratio": second / first,
    }
    (out / "training.json").write_text(json.dumps(facts, indent=2) + "\n")
    return out
