"""A fresh worker's job in a module that imports torch at its top (about 600 MiB of address
space): unpickling the job loads it."""

from __future__ import annotations

import torch


def total() -> int:
    return int(torch.ones(3).sum())
