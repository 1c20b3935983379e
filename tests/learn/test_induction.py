"""causalattn.learn.train_induction and the model it trained (examples/induction): the bars
of the induction model, measured on that model; the tests train only a few steps of their own."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from causalattn.inspect import head_roles  # noqa: E402
from causalattn.integrations import hf_heads, hf_model  # noqa: E402
from causalattn.integrations.transformers import ablate, capture  # noqa: E402
from causalattn.learn import induction, train_induction  # noqa: E402

SHIPPED = Path(__file__).resolve().parents[2] / "examples" / "induction"


def _weights(path):
    model, _ = hf_model.load(path)
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_a_short_training_writes_a_folder_every_command_reads(tmp_path):
    a = train_induction(tmp_path / "a", seed=0, steps=2, batch=2)
    assert a == tmp_path / "a"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "training.json"):
        assert (a / name).is_file(), name
    facts = json.loads((a / "training.json").read_text())
    assert facts["steps"] == 2 and facts["seed"] == 0 and facts["first_repeat_loss"] > 0
    model, tok = hf_model.load(a)
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.num_hidden_layers == 2
    ids = tok(" ".join(induction.WORDS[:3]))["input_ids"]
    assert ids[0] == tok.bos_token_id and len(ids) == 4  # a word a token, after <s>
    same = train_induction(tmp_path / "b", seed=0, steps=2, batch=2)
    other = train_induction(tmp_path / "c", seed=1, steps=2, batch=2)
    wa, wb, wc = _weights(a), _weights(same), _weights(other)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)  # seeded: the same model again
    assert not all(torch.equal(wa[k], wc[k]) for k in wa)


def test_bad_input(tmp_path):
    with pytest.raises(ValueError, match="the folder .*nowhere does not exist"):
        train_induction(tmp_path / "nowhere" / "m")
    for kw, want in [
        ({"steps": 0}, "steps must be an integer >= 1"),
        ({"seed": -1}, "seed must be an integer >= 0"),
        ({"batch": True}, "batch must be an integer >= 1"),
    ]:
        with pytest.raises(ValueError, match=want):
            train_induction(tmp_path / "m", **kw)


@pytest.fixture(scope="module")
def shipped():
    """The shipped model and its head table as `causalattn heads --ablate` measures it (the
    probe: 16 sequences of 24 random words repeated twice, seed 0)."""
    model, tok = hf_model.load(SHIPPED)
    ids, bos = hf_heads.probe_ids(model, tok, length=24, sequences=16, seed=0)
    table = hf_heads.measure(model, tok, length=24, sequences=16, seed=0, ablate=True)
    return model, tok, ids, bos, table


def test_the_shipped_model_is_train_induction_seed_0(shipped):
    facts = json.loads((SHIPPED / "training.json").read_text())
    assert facts["seed"] == 0 and facts["steps"] == induction.STEPS
    assert facts["batch"] == induction.BATCH
    cfg = json.loads((SHIPPED / "config.json").read_text())
    model, tok = shipped[:2]
    fresh = induction._model(tok).config.to_dict()
    for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        assert cfg[k] == fresh[k], k


def test_bar_the_second_repeat_is_copied(shipped):
    model, _, ids, bos, table = shipped
    first, second = hf_heads.repeat_losses(model, ids, 24, bos)
    assert second < 0.1 * first, (first, second)
    assert (first, second) == (table.loss_first, table.loss_second)


def test_bar_previous_token_head_in_layer_1_induction_head_in_layer_2(shipped):
    model, tok, ids, _, table = shipped
    roles = head_roles(capture(model, ids))
    assert roles == table.roles  # the table's roles are head_roles of the probe
    best = max(roles, key=lambda r: r.induction)
    assert best.layer == 1 and best.induction >= 0.5, best
    assert max(r.previous_token for r in roles if r.layer == 0) >= 0.5
    assert best.role == "induction"
    torch.manual_seed(0)  # a random-weight model of the same shape has no induction head
    rand = induction._model(tok).eval()
    assert max(r.induction for r in head_roles(capture(rand, ids))) <= 0.15


def test_bar_ablating_the_induction_heads_breaks_the_copy_and_a_control_does_not(shipped):
    model, _, ids, bos, table = shipped
    roles, base = table.roles, table.loss_second
    heads = [(r.layer, r.head) for r in roles if r.induction >= 0.3]
    layer = max(roles, key=lambda r: r.induction).layer
    control = min((r for r in roles if r.layer == layer), key=lambda r: r.induction)
    with ablate(model, heads=heads):
        broken = hf_heads.repeat_losses(model, ids, 24, bos)[1]
    with ablate(model, heads=[(control.layer, control.head)]):
        kept = hf_heads.repeat_losses(model, ids, 24, bos)[1]
    assert kept == table.ablated[(control.layer, control.head)]  # the table's own ablation
    assert broken >= 5 * base, (heads, base, broken)
    assert 1 / 1.5 <= kept / base <= 1.5, (control, base, kept)
    assert np.isfinite([base, broken, kept]).all()


def test_the_docs_print_the_heads_table_as_it_comes_out(shipped):
    """The heads guide's transcript of `causalattn heads --model examples/induction
    --ablate` is what the command prints (the CLI echoes this table's format())."""
    text = (SHIPPED.parents[1] / "docs" / "guides" / "heads-models.md").read_text(encoding="utf-8")
    cmd = "$ causalattn heads --model examples/induction --ablate\n"
    assert cmd in text
    shown = text.split(cmd, 1)[1].split("\n```", 1)[0]
    assert shown == shipped[-1].format()
