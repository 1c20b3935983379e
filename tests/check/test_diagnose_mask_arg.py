"""diagnose on fn(q, k, v, mask): the signature is found from the parameters' names, the
mask is passed in the convention the function's use implies (bool, additive or 1/0; the
diagnosis says which), a function that ignores its mask is still found out, and an
unsupported signature is refused in one line naming the ones diagnose takes — through
Python and through a real ``python -m causalattn diagnose`` subprocess."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from causalattn.check import diagnose

# this checkout's src, however deep the test file sits (subprocesses import it first)
SRC = str(
    next(p for p in Path(__file__).resolve().parents if (p / "src" / "causalattn").is_dir()) / "src"
)
TAKEN = "fn(q, k, v), fn(q, k, v, mask), fn(x, w_q, w_k, w_v[, w_o]) or an nn.Module"

SOURCE = textwrap.dedent(
    '''
    import math

    import numpy as np
    import torch
    import torch.nn.functional as F


    def masked_fill_1_0(q, k, v, mask):
        """mask = torch.tril(torch.ones(T, T)): 0 = blocked."""
        s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        s = s.masked_fill(mask == 0, float("-inf"))
        return torch.softmax(s, -1) @ v


    def plus_additive(q, k, v, mask):
        s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        return torch.softmax(s + mask, -1) @ v


    def sdpa(query, key, value, attn_mask):
        return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask)


    def where_bool(q, k, v, mask):
        s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        return torch.softmax(torch.where(mask, s, float("-inf")), -1) @ v


    def numpy_1_0(q, k, v, mask):
        s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
        s = np.where(mask == 0, -np.inf, s)
        e = np.exp(s - s.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True) @ v


    def ignores_its_mask(q, k, v, mask):
        s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        return torch.softmax(s, -1) @ v


    def optional_mask(q, k, v, mask=None):
        s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        if mask is not None:
            s = s + mask
        return torch.softmax(s, -1) @ v


    def with_a_scale(q, k, v, scale):
        return torch.softmax(q @ k.transpose(-2, -1) * scale, -1) @ v
    '''
)


@pytest.fixture(scope="module")
def fns(tmp_path_factory):
    path = tmp_path_factory.mktemp("mask_arg") / "fns.py"
    path.write_text(SOURCE)
    spec = importlib.util.spec_from_file_location("mask_arg_fns", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.PATH = path
    return mod


@pytest.mark.parametrize(
    "name, convention, also",
    [
        ("masked_fill_1_0", "bool", "1/0 would read the same"),
        ("plus_additive", "additive", None),
        ("sdpa", "bool", "additive would read the same"),
        ("where_bool", "bool", None),
        ("numpy_1_0", "bool", "1/0 would read the same"),
    ],
)
def test_the_convention_the_function_reads_is_found_and_named(fns, name, convention, also):
    d = diagnose(getattr(fns, name), isolate=False)
    note = d.details["mask convention"]
    assert d.ok, str(d)
    assert d.details["signature"] == "qkv-mask"
    assert note.startswith(convention + " ("), note
    assert "assumed" not in note
    if also:
        assert also in note, note
    else:
        assert "would read the same" not in note, note
    assert f"fn(q, k, v, mask): the mask passed as {convention}" in str(d)


def test_a_function_that_ignores_its_mask_is_found_out(fns):
    d = diagnose(fns.ignores_its_mask, isolate=False)
    assert not d.ok and d.fault == "no-mask", str(d)
    assert "assumed: under no convention" in d.details["mask convention"]


def test_an_optional_mask_is_passed_when_the_signature_says_so(fns):
    assert diagnose(fns.optional_mask, isolate=False).fault == "no-mask"  # called as fn(q, k, v)
    d = diagnose(fns.optional_mask, signature="qkv-mask", isolate=False)
    assert d.ok and d.details["mask convention"].startswith("additive"), str(d)


def test_an_unsupported_signature_is_refused_in_one_line(fns):
    for fn, shown in [
        (fns.with_a_scale, "fn(q, k, v, scale)"),
        (lambda q, k, v, mask, dropout: q, "fn(q, k, v, mask, dropout)"),
        (lambda a, b: a, "fn(a, b)"),
    ]:
        with pytest.raises(ValueError) as exc:
            diagnose(fn, isolate=False)
        msg = str(exc.value)
        assert "\n" not in msg and f"{shown} is not a signature diagnose takes" in msg, msg
        assert TAKEN in msg, msg


def test_the_cli_diagnoses_fn_q_k_v_mask_and_refuses_an_unsupported_one(fns):
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    runs = {
        name: subprocess.Popen(
            [sys.executable, "-m", "causalattn", "diagnose", f"{fns.PATH}:{name}"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            env=env,
            start_new_session=True,
        )
        for name in ("masked_fill_1_0", "with_a_scale")
    }
    out = {name: (p.communicate(timeout=300)[0], p.returncode) for name, p in runs.items()}
    text, rc = out["masked_fill_1_0"]
    assert rc == 0 and "diagnose: clean" in text, text
    assert "fn(q, k, v, mask): the mask passed as bool" in text and "1/0" in text, text
    assert "mat1 and mat2" not in text, text
    text, rc = out["with_a_scale"]
    assert rc == 2, text
    (line,) = [s for s in text.splitlines() if "is not a signature diagnose takes" in s]
    assert "fn(q, k, v, scale)" in line and TAKEN in line, text
