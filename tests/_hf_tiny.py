"""Tiny random-weight Hugging Face causal LMs from configs, and a tokenizer trained here.

Nothing is downloaded: the tokenizer is a byte-level BPE trained with `tokenizers` on a
few sentences, the models are built from configs with seeded random weights (scaled up
so attention is far from uniform) and can be saved with ``save_pretrained`` to a folder
that the CLI then reads exactly as it would read a downloaded checkpoint.
"""

from __future__ import annotations

import torch
import transformers

VOCAB = 320
WINDOW = 4  # every windowed model uses this window, so prompts of 12+ tokens exceed it
CHUNK = 4

CORPUS = [
    "The cat sat on the mat and looked at the dog.",
    "A dog is not a cat, but both like the warm mat.",
    "Attention reads the past: each token looks at the tokens before it.",
    "Queries, keys and values; scores, weights and contributions.",
    '<script>alert(1)</script> & "quotes" are only text.',
]


def tokenizer():
    """A byte-level BPE tokenizer (GPT-2's kind: 'Ġ' marks a space) with VOCAB entries."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
    )


def _common(n_layers=2):
    return dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=n_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        head_dim=8,
    )


def gpt2(attn_pdrop=0.0):
    return transformers.GPT2Config(
        vocab_size=VOCAB,
        n_positions=64,
        n_embd=32,
        n_layer=2,
        n_head=4,
        attn_pdrop=attn_pdrop,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )


def llama():
    return transformers.LlamaConfig(**_common())


def mistral():
    return transformers.MistralConfig(**_common(), sliding_window=WINDOW)


def qwen2():  # window on layers >= max_window_layers only
    return transformers.Qwen2Config(
        **_common(3), use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1
    )


def gemma2():  # window on alternate layers, softcapped scores
    return transformers.Gemma2Config(
        **_common(),
        sliding_window=WINDOW,
        attn_logit_softcapping=5.0,
        final_logit_softcapping=None,
        query_pre_attn_scalar=8,
    )


def gpt_oss():  # sinks + window on alternate layers
    kw = _common()
    kw.pop("intermediate_size")
    return transformers.GptOssConfig(
        **kw,
        intermediate_size=32,
        sliding_window=WINDOW,
        num_local_experts=2,
        num_experts_per_tok=1,
    )


def llama4():  # chunked attention on the rope layers
    kw = _common(4)
    return transformers.Llama4TextConfig(
        **kw,
        attention_chunk_size=CHUNK,
        intermediate_size_mlp=64,
        num_local_experts=2,
        no_rope_layer_interval=4,
        interleave_moe_layer_step=4,
    )


def phi3():
    return transformers.Phi3Config(**_common(), sliding_window=WINDOW)


def starcoder2():  # attention dropout 0.1 in its config, as the real one
    return transformers.Starcoder2Config(**_common(), sliding_window=WINDOW, attention_dropout=0.1)


def qwen3():
    return transformers.Qwen3Config(
        **_common(), use_sliding_window=True, sliding_window=WINDOW, max_window_layers=0
    )


MORE = {"phi3": phi3, "starcoder2": starcoder2, "qwen3": qwen3}  # a lighter check only

CONFIGS = {
    "gpt2": gpt2,
    "llama": llama,
    "mistral": mistral,
    "qwen2": qwen2,
    "gemma2": gemma2,
    "gpt_oss": gpt_oss,
    "llama4": llama4,
}


def model(name: str, seed: int = 0, impl: str = "eager", boldness: float = 8.0, **cfg_kw):
    """A seeded random model in eval mode; 2-D weights scaled by ``boldness`` (the 0.02
    init leaves attention near-uniform, where a wrong mask hides)."""
    torch.manual_seed(seed)
    cfg = {**CONFIGS, **MORE}[name](**cfg_kw)
    if name in ("gpt_oss", "llama4"):  # the loop over experts runs in float64 (grouped_mm not)
        cfg._experts_implementation = "eager"
    if name == "llama4":
        m = transformers.Llama4ForCausalLM(cfg)
        m.set_attn_implementation(impl)
    else:
        m = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=impl)
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 2:
                p.mul_(boldness)
    return m.eval()


def _eager_nan_safe(module, query, key, value, attention_mask, *args, **kwargs):
    """The model's own eager attention with NaN rows zeroed. In float64, finfo.min + a score
    overflows to -inf on a left-padding row that reads nothing, its softmax is NaN, and
    0·NaN in the next layer's A V would carry it into real rows."""
    import sys

    eager = sys.modules[type(module).__module__].eager_attention_forward
    out, weights = eager(module, query, key, value, attention_mask, *args, **kwargs)
    return out.nan_to_num(0.0), weights.nan_to_num(0.0)


EAGER_SAFE = "eager-nan-safe"


def register_eager_safe() -> str:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(EAGER_SAFE, _eager_nan_safe)
    AttentionMaskInterface.register(EAGER_SAFE, ALL_MASK_ATTENTION_FUNCTIONS["eager"])
    return EAGER_SAFE
