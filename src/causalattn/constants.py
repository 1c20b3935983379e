"""The numbers every engine's kernels share, defined once: the Python engines import them
and the native build hands them to the compiler.

- ``LOG2E``, ``LN2``: scores kept in base 2 (exp2 is the fast exponential), S₂ = S·log₂e;
- ``HASH_*``: the dropout hash of :mod:`causalattn.dropout` (MurmurHash3's fmix32
  multipliers ``HASH_C1``, ``HASH_C2``; ``HASH_GOLD`` spreads consecutive integers;
  ``HASH_ROW``, ``HASH_COL``, ``HASH_OFFSET`` separate rows, columns and the offset);
- ``SKIP``, ``FULL``, ``PARTIAL_DENSE``, ``PARTIAL_TILE``: the tile kinds on a (bq, bk) grid
  (:mod:`causalattn.masks_mod`): skipped, fully readable, partly readable through the dense
  mask, and from ``PARTIAL_TILE`` on, through tile mask ``kind - PARTIAL_TILE``.

Python needs them where no compiler is found, and the C++ needs them at compile time
(``constexpr`` in the inner loops), so they live here: :data:`SHARED` names each one the
extension is built with (``-DCAUSALATTN_<NAME>=<value>``, :mod:`causalattn.engines.cpp`),
and the extension exports the values it was compiled with, checked against these at load.
"""

from __future__ import annotations

import math

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)

HASH_C1, HASH_C2 = 0x85EBCA6B, 0xC2B2AE35
HASH_GOLD = 0x9E3779B9
HASH_ROW, HASH_COL = 0x632BE5AB, 0x1B873593
HASH_OFFSET = 0x27D4EB2F

SKIP, FULL, PARTIAL_DENSE, PARTIAL_TILE = 0, 1, 2, 3

SHARED = {
    "LOG2E": LOG2E,
    "LN2": LN2,
    "HASH_C1": HASH_C1,
    "HASH_C2": HASH_C2,
    "HASH_GOLD": HASH_GOLD,
    "HASH_ROW": HASH_ROW,
    "HASH_COL": HASH_COL,
    "HASH_OFFSET": HASH_OFFSET,
    "SKIP": SKIP,
    "FULL": FULL,
    "PARTIAL_DENSE": PARTIAL_DENSE,
    "PARTIAL_TILE": PARTIAL_TILE,
}
