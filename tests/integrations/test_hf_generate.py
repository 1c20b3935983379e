"""capture(model, ids, generate=N): the rows of the N greedy tokens, recorded through the KV
cache, equal a capture of the whole sequence run once, within the accuracy rule."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

import _hf_tiny as tiny  # noqa: E402

import causalattn as ca  # noqa: E402
from causalattn.integrations.transformers import _accepted, capture  # noqa: E402

FLOOR = 1e-5
PROMPT, N = 9, 6  # 15 tokens: past the tiny models' windows and chunks of 4
NEEDS = {"mistral": {"window"}, "gemma2": {"window", "softcap"}, "gpt_oss": {"window", "sinks"}}
NEEDS["llama4"] = {"chunk"}


def _model(name):
    missing = NEEDS.get(name, set()) - _accepted()
    if missing:
        pytest.skip(f"causalattn.attention does not take {sorted(missing)} yet")
    return tiny.model(name)


def _within_rule(ours, plain, ref, what):
    err = np.abs(ours.astype(np.float64) - ref).max()
    bound = 2 * np.abs(plain.astype(np.float64) - ref).max() + FLOOR
    assert err <= bound, f"{what}: {err:.3g} > {bound:.3g}"


@pytest.mark.parametrize("name", ["gpt2", "llama", "mistral", "gemma2", "gpt_oss", "llama4"])
def test_generated_rows_equal_one_run_of_the_whole_sequence(name):
    model = _model(name)
    prompt = torch.randint(3, tiny.VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(2))
    gen = capture(model, prompt, generate=N)
    with torch.no_grad():  # HF's own greedy generation picks the same tokens
        hf = model.generate(prompt, max_new_tokens=N, do_sample=False, min_new_tokens=N)
    ids = torch.as_tensor(gen[0].ids)[None]
    assert ids.shape == (1, PROMPT + N) and torch.equal(ids, hf)
    whole = capture(model, ids)
    ref = capture(copy.deepcopy(model).double(), ids)
    for g, w, r in zip(gen, whole, ref):
        assert g.generated == N and w.generated == 0 and g.A.shape[-1] == PROMPT + N
        assert g.received.describe() == w.received.describe(), (name, g.layer)
        assert g.pattern.describe() == w.pattern.describe()
        for stage in ("Q", "K", "V", "A", "H", "O"):
            _within_rule(g[stage], w[stage], r[stage], f"{name} layer {g.layer} {stage}")
        assert ca.audit(g).ok, (name, g.layer)


def test_generation_of_a_left_padded_batch():
    model = tiny.model("llama")
    ids = torch.randint(3, tiny.VOCAB, (2, PROMPT), generator=torch.Generator().manual_seed(3))
    am = torch.ones(2, PROMPT, dtype=torch.long)
    am[1, :3] = 0
    gen = capture(model, ids, attention_mask=am, generate=4)
    full_am = torch.cat([am, torch.ones(2, 4, dtype=torch.long)], 1)
    whole = capture(model, torch.as_tensor(gen[0].ids), attention_mask=full_am)
    real = full_am.bool()[:, None, :, None]
    for g, w in zip(gen, whole):
        assert g.received.describe() == w.received.describe() == "causal + padding"
        diff = np.abs(g.A - w.A) * real.numpy()
        assert diff.max() < 1e-5
        assert ca.audit(g).ok


def test_generate_is_checked():
    model = tiny.model("gpt2")
    ids = torch.arange(3, 13)[None]
    for bad in (0, -2, True, 1.5, "3"):
        with pytest.raises(ValueError, match="capture: generate must be a positive number"):
            capture(model, ids, generate=bad)
    with pytest.raises(ValueError, match=r"T = 65 tokens \(60 \+ 5 generated\) but the model's"):
        capture(model, torch.ones(1, 60, dtype=torch.long), generate=5)
    assert model.config._attn_implementation == "eager"


def test_explore_marks_the_generated_tokens(tmp_path):
    from typer.testing import CliRunner

    from causalattn.cli import app

    d = tmp_path / "llama"
    tiny.model("llama").save_pretrained(d)
    tiny.tokenizer().save_pretrained(d)
    page = tmp_path / "page.html"
    runner = CliRunner()
    args = ["explore", "--model", str(d), "The cat sat on the mat.", "-o", str(page)]
    res = runner.invoke(app, [*args, "--generate", "3"])
    assert res.exit_code == 0, res.output
    assert '"gen":3' in page.read_text()
    for bad, want in [
        (["--generate", "0"], "capture: generate must be a positive number"),
        (["--generate", "x"], "Invalid value for '--generate'"),
    ]:
        res = runner.invoke(app, [*args, *bad])
        assert res.exit_code == 2 and res.output.startswith("error: ") and want in res.output
    res = runner.invoke(app, ["explore", "a b", "--generate", "2", "-o", str(page)])
    assert res.exit_code == 2 and "--generate needs --model" in res.output
