"""`causalattn audit --model DIR "text"` and `causalattn explore --model DIR "text"` on tiny
checkpoints written with save_pretrained, read back exactly as a downloaded one would be."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

import _hf_tiny as tiny  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from causalattn.cli import app  # noqa: E402
from causalattn.integrations import hf_capture  # noqa: E402

TEXT = "The cat sat on the mat and looked at the dog."
runner = CliRunner()


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    tok = tiny.tokenizer()
    out = {}
    for name in ("gpt2", "llama", "mistral"):
        d = tmp_path_factory.mktemp(name)
        tiny.model(name).save_pretrained(d)
        tok.save_pretrained(d)
        out[name] = d
    return out


def run(*args, code=0):
    res = runner.invoke(app, [str(a) for a in args])
    assert res.exit_code == code, (res.exit_code, res.output, res.exception)
    return res


def audit_json(d, *extra, code=0):
    return json.loads(run("audit", "--model", d, TEXT, "--json", *extra, code=code).stdout)


@pytest.mark.parametrize("name", ["gpt2", "llama", "mistral"])
def test_audit_correct_model_passes_every_layer(dirs, name):
    out = run("audit", "--model", dirs[name], TEXT).stdout
    assert out.splitlines()[-1] == "audit: ok"
    assert out.count(" ok ") == 2  # one row per layer
    data = audit_json(dirs[name])
    assert data["ok"] and [r["layer"] for r in data["layers"]] == [0, 1]
    assert all(r["heads"] == 4 and r["worst_row_sum_error"] < 1e-5 for r in data["layers"])
    assert "".join(data["tokens"]) == TEXT  # readable token strings from the tokenizer
    want = "causal + window 4" if name == "mistral" else "causal"
    assert data["pattern"] == [want, want]


def test_audit_layers_option(dirs):
    data = audit_json(dirs["llama"], "--layers", "1")
    assert [r["layer"] for r in data["layers"]] == [1]


def test_broken_mask_fails_at_that_layer_and_stage_m(dirs, monkeypatch):
    Attention = transformers.models.llama.modeling_llama.LlamaAttention
    forward = Attention.forward

    def drops_mask_on_layer_1(self, *args, **kwargs):
        if self.layer_idx == 1:  # this layer's attention is handed no mask and not causal
            kwargs["attention_mask"] = None
            self.is_causal = False
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(Attention, "forward", drops_mask_on_layer_1)
    data = audit_json(dirs["llama"], code=1)
    assert [(r["layer"], r["stage"]) for r in data["layers"]] == [(0, None), (1, "M")]
    out = run("audit", "--model", dirs["llama"], TEXT, code=1).stdout
    assert "layer 1, stage M" in out and out.splitlines()[-1] == "audit: FAILED"


def test_softmax_over_queries_fails_at_that_layer_and_stage_a(dirs, monkeypatch):
    stages = hf_capture.CapturedTrace._stages

    def broken(self):
        st = stages(self)
        if self.layer == 0:
            Z = st["Z"]  # the softmax over the query axis (a bug), blocked cells still 0
            blocked = np.isneginf(Z)
            Zf = np.where(blocked, -1e300, Z)
            E = np.exp(Zf - Zf.max(-2, keepdims=True))
            st["A"] = np.where(blocked, 0.0, E / E.sum(-2, keepdims=True))
        return st

    monkeypatch.setattr(hf_capture.CapturedTrace, "_stages", broken)
    data = audit_json(dirs["gpt2"], code=1)
    assert [(r["layer"], r["stage"]) for r in data["layers"]] == [(0, "A"), (1, None)]
    assert "query axis" in data["layers"][0]["hint"]


def test_explore_writes_one_offline_page(dirs, tmp_path):
    page = tmp_path / "report.html"
    out = run("explore", "--model", dirs["llama"], TEXT, "-o", page).stdout
    assert "2 layer(s) of LlamaForCausalLM" in out
    html = page.read_text()
    assert "layer 1" in html and "layer 2" in html  # the model view: one row per layer
    assert "http://" not in html.replace("http://www.w3.org", "") and "https://" not in html
    data = json.loads(run("explore", "--model", dirs["llama"], TEXT, "-o", page, "--json").stdout)
    assert data["layers"] == 2 and data["bytes"] == page.stat().st_size


def test_explore_model_and_the_older_spelling_write_the_same_page(dirs, tmp_path):
    """`explore model DIR "text"` is `explore --model DIR "text"`, flags and all."""
    import re

    def page(p):  # less the nonce and element id, new on every page
        b = re.sub(rb"nonce(-|=\")[A-Za-z0-9_-]+", rb"nonce\1N", p.read_bytes())
        return re.sub(rb"ca-x-[0-9a-f]+", b"ca-x-ID", b)

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    pa, pb = tmp_path / "a" / "e.html", tmp_path / "b" / "e.html"
    extra = ["--layers", "1", "--generate", "2", "--questions", "1", "--json"]
    a = run("explore", "model", dirs["llama"], TEXT, "-o", pa, *extra)
    b = run("explore", "--model", dirs["llama"], TEXT, "-o", pb, *extra)
    assert json.loads(a.stdout)["layers"] == json.loads(b.stdout)["layers"] == 1
    assert page(pa) == page(pb)
    na = runner.invoke(app, ["explore", "model", str(dirs["gpt2"])])
    nb = runner.invoke(app, ["explore", "--model", str(dirs["gpt2"])])
    assert na.exit_code == nb.exit_code == 2
    assert na.stderr == nb.stderr and "needs the text" in na.stderr


def test_bad_input_is_one_error_line_exit_2(dirs, tmp_path):
    (tmp_path / "empty").mkdir()
    t5 = tmp_path / "t5"
    transformers.T5Config(
        vocab_size=32, d_model=8, d_kv=4, d_ff=8, num_layers=1, num_heads=2
    ).save_pretrained(t5)
    cases = [
        (["audit", "--model", tmp_path / "nope", TEXT], "no such folder"),
        (["audit", "--model", tmp_path / "empty", TEXT], "not a Hugging Face model folder"),
        (["audit", "--model", t5, TEXT], "not a causal language model"),
        (["audit", "--model", dirs["gpt2"], ""], "text: empty"),
        (["audit", "--model", dirs["gpt2"]], "needs the text"),
        (["audit", "--model", dirs["gpt2"], "cat " * 80], "longer than the model's context of 64"),
        (["audit", "--model", dirs["gpt2"], TEXT, "--layers", "2"], "layer 2 is out of range"),
        (["audit", "--model", dirs["gpt2"], TEXT, "--layers", "x"], "--layers"),
        (["explore", "--model", dirs["gpt2"], TEXT, "more"], "one text"),
        (["explore", "--model", tmp_path / "empty", TEXT], "not a Hugging Face model folder"),
    ]
    for args, fragment in cases:
        res = runner.invoke(app, [str(a) for a in args])
        assert res.exit_code == 2, (args, res.output, res.exception)
        assert "Traceback" not in res.output
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), (args, res.stderr)
        assert fragment in lines[0], (fragment, lines[0])


def test_real_command_in_a_subprocess(dirs, tmp_path):
    """As a user runs it: the command in its own process, on a hub id that sits in the local
    Hugging Face cache (here the tiny GPT-2 filed as `gpt2`; offline, nothing downloaded)."""
    snap = tmp_path / "hub" / "models--gpt2" / "snapshots" / "0123456789abcdef"
    shutil.copytree(dirs["gpt2"], snap)
    (snap.parents[1] / "refs").mkdir()
    (snap.parents[1] / "refs" / "main").write_text(snap.name)
    env = {
        **os.environ,
        "PYTHONPATH": str(Path(__file__).parents[2] / "src"),
        "HF_HUB_CACHE": str(tmp_path / "hub"),
        "HF_HUB_OFFLINE": "1",
    }
    res = subprocess.run(
        [sys.executable, "-m", "causalattn.cli", "audit", "--model", "gpt2", TEXT],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines()[-1] == "audit: ok"
    assert "Loading weights" not in res.stderr  # no progress bars in a command's output
