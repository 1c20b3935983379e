"""`causalattn heads --model DIR [--json] [--ablate]`: the head table of a saved model,
layers and heads 1-based, the same numbers as the Python API (0-based)."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

import _hf_tiny as tiny  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from causalattn.cli import app  # noqa: E402
from causalattn.inspect import head_roles  # noqa: E402
from causalattn.integrations import hf_heads, hf_model  # noqa: E402
from causalattn.integrations.transformers import ablate, capture  # noqa: E402

KEYS = ["layer", "head", "previous_token", "induction", "first_token", "mean_distance", "entropy"]
runner = CliRunner()


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama")
    tiny.model("llama").save_pretrained(d)
    tiny.tokenizer().save_pretrained(d)
    return d


def run(*args, code=0):
    res = runner.invoke(app, [str(a) for a in args])
    assert res.exit_code == code, (res.exit_code, res.output, res.exception)
    return res


def test_json_is_one_object_per_head_one_based_as_the_python_api(llama_dir):
    rows = json.loads(run("heads", "--model", llama_dir, "--json", "--sequences", "4").stdout)
    assert [(r["layer"], r["head"]) for r in rows] == [(l, h) for l in (1, 2) for h in (1, 2, 3, 4)]
    assert all(list(r)[: len(KEYS)] == KEYS and "role" in r for r in rows)
    model, tok = hf_model.load(llama_dir)
    ids, bos = hf_heads.probe_ids(model, tok, length=24, sequences=4, seed=0)
    assert ids.shape == (4, 49) and bos and (ids[:, 0] == tok.bos_token_id).all()
    roles = head_roles(capture(model, ids))
    for r, py in zip(rows, roles):
        assert (r["layer"], r["head"]) == (py.layer + 1, py.head + 1)
        for k in KEYS[2:]:
            assert r[k] == pytest.approx(py[k], abs=1e-9), k
    text = run("heads", "--model", llama_dir, "--sequences", "4").stdout.splitlines()
    assert text[0].startswith("LlamaForCausalLM: 2 layers × 4 heads, on 4 random sequences")
    assert len(text) == 3 + 8 and text[2].split()[:3] == ["layer", "head", "role"]
    assert text[3].split()[:2] == ["1", "1"] and text[-1].split()[:2] == ["2", "4"]


def test_ablate_adds_each_heads_effect_on_the_loss(llama_dir):
    probe = ["--sequences", "2", "--length", "8"]
    rows = json.loads(run("heads", "--model", llama_dir, "--json", *probe, "--ablate").stdout)
    model, tok = hf_model.load(llama_dir)
    ids, bos = hf_heads.probe_ids(model, tok, length=8, sequences=2, seed=0)
    base = hf_heads.repeat_losses(model, ids, 8, bos)[1]
    with ablate(model, heads=[(1, 2)]):
        loss = hf_heads.repeat_losses(model, ids, 8, bos)[1]
    r = rows[6]  # layer 2, head 3
    assert (r["layer"], r["head"]) == (2, 3)
    assert r["ablated_loss"] == pytest.approx(loss, rel=1e-5)
    assert r["loss_ratio"] == pytest.approx(loss / base, rel=1e-5)
    assert len({round(x["ablated_loss"], 6) for x in rows}) > 1  # heads differ: it can fail
    mean = json.loads(
        run("heads", "--model", llama_dir, "--json", *probe, "--ablate", "--how", "mean").stdout
    )
    assert [x["ablated_loss"] for x in mean] != [x["ablated_loss"] for x in rows]


def test_losses_are_over_each_repeats_second_to_last_token():
    """A model that knows the answer everywhere has loss 0 on both; the targets counted are
    the 2nd..L-th of each repeat (the 1st of a repeat follows nothing that predicts it)."""

    class Oracle(torch.nn.Module):
        def forward(self, ids, use_cache=False):
            logits = torch.full((*ids.shape, 50), -1e4)
            nxt = torch.cat([ids[:, 1:], ids[:, :1]], 1)
            logits.scatter_(-1, nxt[..., None], 0.0)
            logits[:, 0] = 0.0  # position 0 predicts position 1: uniform (not counted)
            logits[:, 5] = 0.0  # predicts position 6, the 1st token of the second repeat
            return type("Out", (), {"logits": logits})()

        def parameters(self):
            return iter([torch.zeros(1)])

    ids = torch.tensor([[1, 10, 11, 12, 13, 14, 10, 11, 12, 13, 14]])  # BOS + 5 twice
    assert hf_heads.repeat_losses(Oracle(), ids, 5, bos=True) == (0.0, 0.0)


def test_bad_input_is_one_error_line_and_exit_2(llama_dir, tmp_path):
    for args, want in [
        ((), "Missing option '--model'"),
        (("--model", tmp_path / "nothing"), "no such folder"),
        (("--model", llama_dir, "--length", "0"), "--length must be a positive integer"),
        (("--model", llama_dir, "--length", "1"), "--length must be at least 2"),
        (("--model", llama_dir, "--sequences", "0"), "--sequences must be a positive integer"),
        (("--model", llama_dir, "--length", "40"), "T = 81, longer than the model's context of 64"),
        (("--model", llama_dir, "--ablate", "--how", "max"), "--how must be 'zero' or 'mean'"),
    ]:
        res = runner.invoke(app, ["heads", *map(str, args)])
        assert res.exit_code == 2, (args, res.output)
        assert res.output.startswith("error: ") and want in res.output, (args, res.output)
    falcon = tmp_path / "falcon"
    cfg = transformers.FalconConfig(
        vocab_size=tiny.VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=4
    )
    transformers.FalconForCausalLM(cfg).save_pretrained(falcon)
    tiny.tokenizer().save_pretrained(falcon)
    res = runner.invoke(app, ["heads", "--model", str(falcon)])
    assert res.exit_code == 2 and "keeps its own attention code" in res.output, res.output
    assert len(res.output.strip().splitlines()) == 1
