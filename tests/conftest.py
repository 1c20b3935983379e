"""Suite-wide pytest hooks.

Mutation testing (``make mutate``, mutmut 3): mutmut maps each source function to every
selected test that calls it, so a mutant in masks.py would also run every engine test (all
engines take their mask from masks.py) and a surviving mutant would cost the whole
selection. Each mutated module is instead judged by its own tests, listed here; mutmut names
the mutant in ``MUTANT_UNDER_TEST`` inside its worker. Outside a mutant run this is a no-op.
"""

from __future__ import annotations

import os

# mutated module (prefix of mutmut's mutant name) -> the test files that judge it
MUTATION_TESTS = {
    "causalattn.masks.": ("test_masks.py", "test_patterns.py"),
    "causalattn.check.": ("test_audit.py", "test_check_audit.py"),
    "causalattn.distributed.layout.": ("test_layout.py", "test_ring.py"),
    "causalattn.reference.": ("test_reference.py",),
    "causalattn.engines.": (
        "test_engine_contract.py",
        "test_engines.py",
        "test_engine_patterns.py",
        "test_tiled.py",
    ),
}


def pytest_collection_modifyitems(config, items):
    mutant = os.environ.get("MUTANT_UNDER_TEST", "")
    files = next((f for prefix, f in MUTATION_TESTS.items() if mutant.startswith(prefix)), None)
    if files is None:
        return
    keep = [item for item in items if item.path.name in files]
    if len(keep) < len(items):
        config.hook.pytest_deselected(items=[item for item in items if item not in keep])
        items[:] = keep
