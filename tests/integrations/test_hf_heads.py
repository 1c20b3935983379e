"""`causalattn heads --model DIR [--json] [--ablate]`: the head table of a saved model,
layers and heads 1-based, the same numbers as the Python API (0-based)."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

import _hf_tiny as tiny  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from causalattn.cli import app  # noqa: E402
from causalattn.inspect import SCORES, HeadRole, head_roles, role_of  # noqa: E402
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
    doc = json.loads(run("heads", "--model", llama_dir, "--json", "--sequences", "4").stdout)
    assert doc["command"] == "heads" and doc["positions"] == "1-based"
    rows = doc["heads"]
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
    probe = ["--sequences", "2", "--max-len", "8"]
    rows = json.loads(run("heads", "--model", llama_dir, "--json", *probe, "--ablate").stdout)
    rows = rows["heads"]
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
    )["heads"]
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
        (("--model", llama_dir, "--max-len", "0"), "--max-len must be a positive integer"),
        (("--model", llama_dir, "--max-len", "1"), "--max-len must be at least 2"),
        (("--model", llama_dir, "--sequences", "0"), "--sequences must be a positive integer"),
        (("--model", llama_dir, "--max-len", "40"), "T = 81, longer than the model's context"),
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


# ---- the table as text and as rows, of a table built by hand --------------------------------


def _role(layer, head, **scores):
    sc = {"previous_token": 0.0, "induction": math.nan, "first_token": 0.0}
    sc |= {"mean_distance": 0.0, "entropy": 0.0, **scores}
    return HeadRole(layer=layer, head=head, **sc, role=role_of(sc))


def _table(ablated=None, loss_second=0.5, **kw):
    """1 layer × 3 heads: a previous-token head, one with no role, a first-token head."""
    roles = [
        _role(0, 0, previous_token=0.9, mean_distance=1.0),
        _role(0, 1, induction=0.123456, entropy=2.0),
        _role(0, 2, first_token=0.75),
    ]
    return hf_heads.HeadTable(
        "Arch", roles, 8, 4, 7, 2.0, loss_second, how="mean", ablated=ablated or {}, **kw
    )


ABLATED = {(0, 0): 0.5, (0, 1): 1.23456, (0, 2): math.nan}


def test_the_table_text_says_its_shape_losses_and_one_aligned_line_per_head():
    lines = _table(ABLATED).format().splitlines()
    assert lines[0] == (
        "Arch: 1 layers × 3 heads, on 4 random sequences of 8 tokens repeated twice (seed 7)"
    )
    assert lines[1] == "loss on the first repeat 2.000, on the second 0.5000 (ratio 0.2500)"
    names = ["layer", "head", "role", *SCORES, "ablated_loss", "loss_ratio"]
    assert lines[2].split() == names
    # 1-based; scores to 3 decimals, losses to 4; NaN and no role as "-"
    assert lines[3].split() == "1 1 previous-token 0.900 - 0.000 1.000 0.000 0.5000 1.0000".split()
    assert lines[4].split() == "1 2 - 0.000 0.123 0.000 0.000 2.000 1.2346 2.4691".split()
    assert lines[5].split() == "1 3 first-token 0.000 - 0.750 0.000 0.000 - -".split()
    assert lines[6] == (
        "ablated_loss: the second-repeat loss with that head ablated (mean); "
        "loss_ratio: that over the model's own"
    )
    assert len(lines) == 7

    def spans(line):
        return [m.span() for m in re.finditer(r"\S+", line)]

    for line in lines[3:6]:  # each value right-aligned under its name, the role left-aligned
        got, want = spans(line), spans(lines[2])
        assert [e for _, e in got[:2] + got[3:]] == [e for _, e in want[:2] + want[3:]], line
        assert got[2][0] == want[2][0], line
    assert _table(ABLATED).format(base=0).splitlines()[3].split()[:2] == ["0", "0"]


def test_without_ablation_the_table_has_no_loss_columns():
    lines = _table().format().splitlines()
    assert lines[2].split() == ["layer", "head", "role", *SCORES]
    assert len(lines) == 3 + 3 and all(len(x.split()) == 8 for x in lines[3:])
    assert [set(r) for r in _table().rows()] == [{"layer", "head", *SCORES, "role"}] * 3


def test_the_rows_are_1_based_dicts_with_none_for_what_is_not_a_number():
    rows = _table(ABLATED).rows()
    assert [list(r) for r in rows] == [
        ["layer", "head", *SCORES, "role", "ablated_loss", "loss_ratio"]
    ] * 3
    assert [(r["layer"], r["head"], r["role"]) for r in rows] == [
        (1, 1, "previous-token"),
        (1, 2, ""),
        (1, 3, "first-token"),
    ]
    assert rows[1]["induction"] == 0.123456 and rows[0]["induction"] is None
    assert rows[0]["mean_distance"] == 1.0 and rows[1]["entropy"] == 2.0
    assert (rows[1]["ablated_loss"], rows[1]["loss_ratio"]) == (1.23456, 1.23456 / 0.5)
    assert (rows[2]["ablated_loss"], rows[2]["loss_ratio"]) == (None, None)
    assert [(r["layer"], r["head"]) for r in _table(ABLATED).rows(base=0)][:2] == [(0, 0), (0, 1)]
    # a second-repeat loss of 0 (a model that copies perfectly): no ratio, and no error
    rows = _table(ABLATED, loss_second=0.0).rows()
    assert [r["loss_ratio"] for r in rows] == [None] * 3
    assert rows[0]["ablated_loss"] == 0.5
    assert "(ratio 0.0000)" in _table(ABLATED, loss_second=0.0).format()


def test_a_first_repeat_loss_of_0_prints_no_ratio():
    table = hf_heads.HeadTable("Arch", [], 8, 4, 7, 0.0, 0.0)
    assert table.format().splitlines()[1].endswith("on the second 0.0000 (ratio -)")


# ---- the losses: which targets each counts ---------------------------------------------------


class _WrongAt(torch.nn.Module):
    """A model sure of every next token but the one at position ``q``, uniform over V there:
    its loss is log V on the token at q, 0 on every other."""

    V = 50

    def __init__(self, q):
        super().__init__()
        self.q = q

    def forward(self, ids, use_cache=False):
        logits = torch.full((*ids.shape, self.V), -1e4)
        logits[:, :-1].scatter_(-1, ids[:, 1:, None], 0.0)
        logits[:, self.q - 1] = 0.0  # the position that predicts q
        return type("Out", (), {"logits": logits})()

    def parameters(self):
        return iter([torch.zeros(1)])


@pytest.mark.parametrize("bos", [True, False], ids=["bos", "no-bos"])
@pytest.mark.parametrize("tail", [0, 2], ids=["probe", "tokens-after"])
def test_each_loss_is_the_mean_over_exactly_the_2nd_to_Lth_token_of_its_repeat(bos, tail):
    """Wrong on one token at a time: a repeat's loss is log V / (L - 1) when that token is
    one of its 2nd..L-th, else 0 (its 1st, the BOS and tokens after the repeats never count)."""
    L, o = 4, int(bos)
    x = [10, 11, 12, 13]
    ids = torch.tensor([[1] * o + x + x + [20] * tail])
    share = math.log(_WrongAt.V) / (L - 1)
    for q in range(1, ids.shape[1]):
        first, second = hf_heads.repeat_losses(_WrongAt(q), ids, L, bos)
        assert first == pytest.approx(share if o + 1 <= q < o + L else 0.0, abs=1e-6), q
        assert second == pytest.approx(share if o + L + 1 <= q < o + 2 * L else 0.0, abs=1e-6), q


# ---- the probe: which ids it draws, how long it may be ------------------------------------------


class _Tok:
    """What probe_ids reads of a tokenizer: its size and its special ids (this one has no
    BOS attribute at all, and a flag where an eos id would be)."""

    eos_token_id = True  # a bool names no token (True is not id 1)
    pad_token_id = 9  # named by the tokenizer only, not among its special ids

    def __init__(self, size, special=()):
        self.size, self.all_special_ids = size, list(special)

    def __len__(self):
        return self.size


def test_the_probe_draws_every_id_of_the_smaller_vocabulary_but_the_special_ones():
    model = tiny.model("gpt2")
    model.config.eos_token_id = [2, 5]  # a config's eos may be a list
    model.config.bos_token_id = None
    # the tokenizer's 12 ids (not the model's 320) less its special one, both pads, both eos
    allowed = {1, 3, 4, 6, 8, 10, 11}
    ids, bos = hf_heads.probe_ids(model, _Tok(12, [7]), length=7, sequences=3, seed=0)
    assert not bos and ids.shape == (3, 14) and ids.dtype == torch.int64
    assert all(set(row.tolist()) == allowed for row in ids)  # 7 distinct of 7: all of them
    assert (ids[:, :7] == ids[:, 7:]).all()
    # a tokenizer larger than the model's embeddings: only ids the model has
    ids, _ = hf_heads.probe_ids(model, _Tok(400), length=31, sequences=16, seed=0)
    assert ids.max() < model.get_input_embeddings().num_embeddings


def test_the_probe_is_seeded():
    model, tok = tiny.model("gpt2"), tiny.tokenizer()
    a, b, c = (hf_heads.probe_ids(model, tok, length=8, sequences=4, seed=s)[0] for s in (3, 3, 4))
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert not torch.equal(a, hf_heads.probe_ids(model, tok, length=8, sequences=4, seed=0)[0])


def test_the_probe_may_fill_the_models_context_and_not_one_token_more():
    model, tok = tiny.model("gpt2"), tiny.tokenizer()  # a context of 64
    assert hf_heads.probe_ids(model, None, length=32, sequences=1, seed=0)[0].shape == (1, 64)
    assert hf_heads.probe_ids(model, tok, length=31, sequences=1, seed=0)[0].shape == (1, 63)
    ctx = "longer than the model's context of 64"
    for t, length, want in [
        (None, 33, f"--max-len: 33 tokens repeated twice is T = 66, {ctx}"),
        (tok, 32, f"--max-len: 32 tokens repeated twice after BOS is T = 65, {ctx}"),
    ]:
        with pytest.raises(ValueError) as e:
            hf_heads.probe_ids(model, t, length=length, sequences=1, seed=0)
        assert str(e.value) == want


# ---- measure: its defaults, its refusals ------------------------------------------------------


def test_measure_with_its_defaults_measures_what_the_command_does_with_its_own(llama_dir):
    model, tok = hf_model.load(llama_dir)
    table = hf_heads.measure(model, tok)
    doc = json.loads(run("heads", "--model", llama_dir, "--json").stdout)["heads"]
    assert table.rows() == [pytest.approx(r) for r in doc]
    assert (table.length, table.sequences, table.seed, table.how) == (24, 16, 0, "zero")


def test_measure_takes_the_smallest_probe_and_refuses_what_is_not_a_count():
    model, tok = tiny.model("llama"), tiny.tokenizer()
    table = hf_heads.measure(model, tok, length=np.int64(2), sequences=1, ablate=True, how="mean")
    assert len(table.rows()) == 8 and table.how == "mean"
    assert (
        table.format()
        .splitlines()[-1]
        .startswith("ablated_loss: the second-repeat loss with that head ablated (mean); ")
    )
    for name, kw in [("--max-len", "length"), ("--sequences", "sequences")]:
        for bad in (0, True, 2.5, "8"):
            with pytest.raises(ValueError) as e:
                hf_heads.measure(model, tok, **{kw: bad})
            assert str(e.value) == f"{name} must be a positive integer, got {bad!r}"
