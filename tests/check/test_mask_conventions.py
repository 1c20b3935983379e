"""One mask, one verdict through every door: each convention (bool, additive -inf, additive
fills -1e9 / -1e4 / finfo.min, 1/0 in floats and integers), a non-causal one of each, and
ambiguous masks, run side by side through the CLI (a real ``python -m causalattn audit``
subprocess on a .npy / .npz file) and Python (``audit({"mask": m})``, the mask next to
scores, ``compare_masks``); every door must give the same verdict and read the same
convention. The one reader is causalattn.check.conventions."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from causalattn.check import AuditInputError, audit, compare_masks
from causalattn.check.conventions import AmbiguousMask, decide, encode, read

# this checkout's src, however deep the test file sits (subprocesses import it first)
SRC = str(
    next(p for p in Path(__file__).resolve().parents if (p / "src" / "causalattn").is_dir()) / "src"
)
T = 6
TRIL = np.tril(np.ones((T, T), bool))
OFF_BY_ONE = np.tril(np.ones((T, T), bool), 1)  # each query also reads the next key


def _additive(allowed, fill, dtype=np.float64):
    return np.where(allowed, 0.0, fill).astype(dtype)


# name -> (mask, the convention it is read as or None, verdict: causal / not causal / ambiguous)
CASES = {
    "bool": (TRIL, "bool", "causal"),
    "bool, no mask": (np.ones((T, T), bool), "bool", "not causal"),
    "additive -inf": (_additive(TRIL, -np.inf), "additive", "causal"),
    "additive -inf, transposed": (_additive(TRIL.T, -np.inf), "additive", "not causal"),
    "additive -1e9": (_additive(TRIL, -1e9), "additive", "causal"),
    "additive -1e9, off by one": (_additive(OFF_BY_ONE, -1e9), "additive", "not causal"),
    "additive -1e4 fp16": (_additive(TRIL, -1e4, np.float16), "additive", "causal"),
    "additive finfo.min fp32": (
        _additive(TRIL, np.finfo(np.float32).min, np.float32),
        "additive",
        "causal",
    ),
    "1/0": (np.tril(np.ones((T, T))), "1/0", "causal"),
    "1/0, all ones": (np.ones((T, T)), "1/0", "not causal"),
    "1/0 integers": (np.tril(np.ones((T, T), np.int64)), "1/0", "causal"),
    "1/0 integers, off by one": (OFF_BY_ONE.astype(np.int32), "1/0", "not causal"),
    "ambiguous: all zeros": (np.zeros((T, T)), None, "ambiguous"),
    "ambiguous: a soft bias": (np.where(TRIL, 0.0, -100.0), None, "ambiguous"),
    "ambiguous: 1s and fills": (np.where(TRIL, 1.0, -np.inf), None, "ambiguous"),
    "ambiguous: NaN": (np.where(TRIL, 0.0, np.nan), None, "ambiguous"),
}


def _file(tmp: Path, i: int, m: np.ndarray) -> Path:
    """Alternately a .npz holding ``mask`` and a lone mask.npy (files may name it mask)."""
    folder = tmp / f"case{i}"
    folder.mkdir()
    if i % 2:
        np.save(folder / "mask.npy", m)
        return folder / "mask.npy"
    np.savez(folder / "m.npz", mask=m)
    return folder / "m.npz"


def _python_verdicts(m) -> dict:
    """door -> (verdict, convention) through the Python doors."""
    out = {}
    try:
        rep = audit({"mask": m})
        out["audit mask"] = ("causal" if rep.ok else "not causal", _convention(rep.notes[0]))
    except AuditInputError as exc:
        out["audit mask"] = ("ambiguous" if "ambiguous" in str(exc) else str(exc), None)
    S = np.random.default_rng(0).normal(size=(T, T))
    try:
        rep = audit({"S": S, "mask": m})
        (c,) = [c for c in rep.checks if c.name == "mask is causal (+ padding)"]
        out["audit with S"] = ("causal" if c.ok else "not causal", read(m).convention)
    except AuditInputError as exc:
        out["audit with S"] = ("ambiguous" if "ambiguous" in str(exc) else str(exc), None)
    try:
        r = compare_masks(m)
        out["compare_masks"] = ("causal" if r.ok else "not causal", r.convention)
    except AmbiguousMask:
        out["compare_masks"] = ("ambiguous", None)
    return out


def _convention(note: str) -> str | None:
    for c in ("bool", "additive", "1/0"):
        if f"read as {c} " in note:
            return c
    return None


def _cli_verdicts(files: dict) -> dict:
    """name -> (verdict, convention, output) from one real CLI subprocess per file, run
    together (each imports torch once)."""
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-m", "causalattn", "audit", str(path), "--json"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
            env=env,
            start_new_session=True,
        )
        for name, path in files.items()
    }
    out = {}
    for name, p in procs.items():
        stdout, stderr = p.communicate(timeout=300)
        text = stdout + stderr
        if p.returncode == 2:
            out[name] = ("ambiguous" if "ambiguous" in text else text, None, text)
            continue
        verdict = {0: "causal", 1: "not causal"}.get(p.returncode, text)
        out[name] = (verdict, json.loads(stdout).get("convention"), text)
    return out


def test_every_convention_gives_one_verdict_through_the_cli_and_python(tmp_path):
    files = {name: _file(tmp_path, i, m) for i, (name, (m, _, _)) in enumerate(CASES.items())}
    cli = _cli_verdicts(files)
    for name, (m, convention, verdict) in CASES.items():
        got_cli, conv_cli, text = cli[name]
        assert got_cli == verdict, (name, text)
        assert conv_cli == convention, (name, text)
        if verdict == "causal":  # the CLI never calls a causal mask a future key read
            assert "future key read" not in text, (name, text)
        if verdict == "ambiguous":
            assert "not judged" in text, (name, text)
        for door, (got, conv) in _python_verdicts(m).items():
            assert got == verdict, (name, door, got)
            assert conv == convention, (name, door, conv)


def test_the_reader_names_the_reason_of_an_ambiguous_mask():
    why = {
        "ambiguous: all zeros": "every entry is 0",
        "ambiguous: a soft bias": "at or below -10000), first at [0, 1] = -100",
        "ambiguous: 1s and fills": "1s (1/0's may read) next to blocking fills",
        "ambiguous: NaN": "first at [0, 1] = nan",
    }
    for name, reason in why.items():
        r = read(CASES[name][0])
        assert r.ambiguous and r.allowed is None and reason in r.reason, (name, r.reason)
        with pytest.raises(AmbiguousMask, match="my mask: ambiguous mask convention"):
            decide(CASES[name][0], "my mask")
    assert read(np.zeros((0, 0))).reason == "it has no entries"
    with pytest.raises(ValueError, match="my mask: must be boolean"):
        decide(np.array([["a"]]), "my mask")


def test_torch_masks_are_read_alike_and_each_convention_round_trips():
    import torch

    for name, (m, convention, _) in CASES.items():
        if m.dtype == np.float16:
            continue
        r = read(torch.as_tensor(m))
        assert r.convention == convention, name
        if convention is not None:
            assert isinstance(r.allowed, torch.Tensor) and r.allowed.dtype == torch.bool
            assert (r.allowed.numpy() == read(m).allowed).all(), name
    for c in ("bool", "additive", "1/0"):
        written = encode(TRIL, c, np.float32)
        assert read(written).convention == c and (read(written).allowed == TRIL).all()
    with pytest.raises(ValueError, match="convention must be one of"):
        encode(TRIL, "boolean", np.float32)
