"""examples/train_tiny_lm.py: the loss falls, and the tiled engine's backward trains like the
reference."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "train_tiny_lm.py"
SMALL = {"block": 32, "batch": 8, "d_model": 32, "lr": 1e-2, "progress": False}


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("train_tiny_lm", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: extra threads only fight over the shared cores
    yield mod
    torch.set_num_threads(threads)


def test_loss_falls_well_below_its_start(example):
    losses = example.train(100, engine="auto", **SMALL)
    assert len(losses) == 100
    start, end = losses[0], sum(losses[-5:]) / 5
    assert end < 0.75 * start, f"loss {start:.3f} -> {end:.3f}"


def test_auto_engine_trains_like_the_reference(example):
    # Same seed, same batches: a wrong backward in the engine shows up within a few steps.
    auto = example.train(8, engine="auto", **SMALL)
    ref = example.train(8, engine="reference", **SMALL)
    assert max(abs(a - b) for a, b in zip(auto, ref)) < 1e-3, (auto, ref)
