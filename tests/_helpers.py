"""What several test modules share (tests never import from benchmarks/)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def run_in_triton_interpreter(test_file: str, timeout: float = 600) -> str:
    """Run a test module under TRITON_INTERPRET=1 in a subprocess (the variable must be set
    before triton is first imported); fail with its output's tail; return the summary line."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    here = Path(test_file)
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        str(here),
        "-q",
        "-p",
        "no:cacheprovider",
        "-o",
        "addopts=",
        "--rootdir",
        str(here.parent.parent),
    ]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    tail = (run.stdout + run.stderr)[-6000:]
    assert run.returncode == 0, f"{here.name} failed in Triton's interpreter:\n{tail}"
    assert " passed" in tail, tail
    return tail.strip().splitlines()[-1]


QUESTIONS = [  # the shape causalattn.learn.questions() returns
    {
        "id": "q1",
        "kind": "softmax-axis",
        "prompt": "Along which axis does softmax run?",
        "choices": ["down each key column", "across each query row", "over all T×T scores"],
        "answer": 1,
        "hint": "Each query's weights must sum to 1.",
        "explanation": "Row i holds query i's scores over keys j.",
        "highlight": {"matrix": "A", "axis": "row", "row": 2},
        "data": {
            "X": [[1, 0], [0, 1], [1, 1], [-1, 1]],
            "W_q": [[1, 0], [0, 1]],
            "W_k": [[1, 0], [0, 1]],
            "W_v": [[1, 1], [1, -1]],
            "tokens": ["x1", "x2", "x3", "x4"],
        },
    },
    {
        "id": "q2",
        "kind": "mask-cell",
        "prompt": "Why is cell (8, 2) of sentence 4 blocked?",
        "choices": ["future", "padding"],
        "answer": 1,
        "hint": "Look at row 8's token.",
        "explanation": "Row 8 is <PAD>.",
        "highlight": {"matrix": "M", "cells": [[7, 1]]},
        "sentence": 3,
    },
]
