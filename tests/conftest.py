"""Suite-wide pytest hooks.

Mutation testing (``make mutate``, mutmut 3): mutmut maps each source function to every
selected test that calls it, so a mutant in masks.py would also run every engine test (all
engines take their mask from masks.py) and a surviving mutant would cost the whole
selection. Each mutated module is instead judged by its own tests, listed here; mutmut names
the mutant in ``MUTANT_UNDER_TEST`` inside its worker. In mutmut's stats run (which maps
functions to tests) what a diagnosis's forked worker reaches is counted for the test too.
Outside mutmut this is a no-op. mutmut forks each mutant's worker from a process that has
collected every selected test module: a module that runs a torch op at import (a tensor
built in a parametrize list) starts OpenMP's threads there, and the forked workers then
hang in them (every mutant "timeout"); build such tensors inside the test.

How the suite shares a machine: `make test` runs it on pytest-xdist workers (`-n 2`). This
part changes nothing a test checks; it decides where and in which order tests run and how
many threads each worker's torch may use:

- each worker's torch gets its share of the cores (no oversubscription), except the modules
  in THREADED, whose tiled-engine cases exercise the multi-threaded tile scheduler and keep
  all the cores, as in a serial run;
- the modules in SERIAL run whole on one worker, one test at a time (ring attention's gloo
  processes and their cached spawns; one Chromium at a time). This is done by the scheduler
  below, not by ``xdist_group`` marks, which pytest 9.2 no longer lets xdist 3.8 apply
  (pytest-xdist issue #1386: the groups are silently ignored);
- a test that takes loopback ports holds the ``loopback_ports`` lock, across workers;
- the longest single tests are queued first, so no worker is left with one at the end.
"""

from __future__ import annotations

import os

import pytest

WORKER = os.environ.get("PYTEST_XDIST_WORKER")
CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
SHARE = max(1, CORES // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
THREADED = {"test_tiled.py", "test_every_pattern.py", "test_dropout.py"}
SERIAL = {  # module -> the unit of work it belongs to (modules in one unit share a worker)
    "tests/distributed/test_ring.py": "gloo",
    "tests/viz/test_explorer_browser.py": "chromium",
    "tests/viz/test_hf_browser.py": "chromium",
    "tests/test_docs_site.py": "chromium",
}
# queued first (a name here only changes the order; a missing one changes nothing)
LONGEST = (
    "test_kernels_in_the_interpreter",
    "test_triton_meets_the_contract_in_the_interpreter",
)

# mutated module (prefix of mutmut's mutant name) -> the test files that judge it; the first
# prefix that matches wins, so a module's own entry comes before its package's
MUTATION_TESTS = {
    "causalattn.masks.": ("test_masks.py", "test_pattern.py"),
    # the modules masks was split into: the same tests as masks (test_masks pins
    # every refusal of Pattern in full, the bias, rel_bias, mask_mod and score_mod ones too)
    "causalattn.masks_checks.": ("test_masks.py", "test_pattern.py"),
    "causalattn.masks_dense.": ("test_masks.py", "test_pattern.py"),
    "causalattn.dropout.": ("test_dropout.py",),
    "causalattn.shapes.": ("test_shapes.py",),
    "causalattn.text.": ("test_text.py",),
    "causalattn.matrix_form.": ("test_reference.py",),
    "causalattn.check.measure.": ("test_check_measure.py", "test_diagnose.py"),
    "causalattn.check.judge.": (
        "test_judge.py",
        "test_judge_slices.py",
        "test_judge_scale.py",
        "test_judge_probes.py",
        "test_diagnose.py",
        "test_promises_check.py",
    ),
    "causalattn.io.files.": (
        "test_files.py",
        "test_hostile.py",
        "test_promises_check.py",
    ),
    "causalattn.io.runner.": ("test_runner.py", "test_promises_check.py"),
    "causalattn.check.compare.": ("test_compare_masks.py", "test_promises_check.py"),
    "causalattn.check.conventions.": ("test_mask_conventions.py", "test_check_audit.py"),
    "causalattn.check.mask_arg.": ("test_diagnose_mask_arg.py",),
    "causalattn.check.": (
        "test_audit.py",
        "test_check_audit.py",
        "test_check_scale.py",
        "test_check_stage_qkv.py",
        "test_check_stage_mask.py",
    ),
    "causalattn.distributed.layout.": ("test_layout.py", "test_ring.py"),
    "causalattn.distributed.ring.": ("test_ring_local.py", "test_ring.py"),
    "causalattn.integrations.hf_pattern.": ("test_hf.py",),
    "causalattn.engines.cache.": ("test_cache.py",),
    # score_mod in the native kernels (its tables, grads) and the tile tables of mask_mods
    "causalattn.engines.cpp.": (
        "test_cpp.py",
        "test_promises_cpp.py",
        "test_cpp_score_mod.py",
        "test_cpp_entry.py",  # the constants handed to the compiler (_literal)
        "test_promises_cpp_build.py",
    ),
    "causalattn.engines.auto.": ("test_auto.py", "test_promises_auto_cli.py"),
    "causalattn.masks_mod.": (
        "test_mask_mod.py",
        "test_promises_cpp.py",
        "test_flex_catalogue.py",  # and_masks, or_masks, block_kind: FlexAttention's catalogue
        "test_cpp_score_mod.py",  # apply_score_mod, captured_tensors
        "test_pattern.py",  # block_kind, through Pattern.block_kind
        "test_block_table.py",  # tile_table, through the kept tables
        "test_table_speed_path.py",
        "test_mods_bad_input.py",
        "test_mask_bounds.py",
        "test_promises_mask_mod.py",
    ),
    "causalattn.inspect.": ("test_inspect.py", "test_induction.py", "test_promises_heads.py"),
    "causalattn.integrations.hf_edit.": ("test_hf_edit.py", "test_promises_heads.py"),
    "causalattn.integrations.hf_heads.": ("test_hf_heads.py", "test_promises_heads.py"),
    "causalattn.cli.": ("test_cli_basic.py", "test_promises_auto_cli.py"),
    "causalattn.engines.": (  # tiled and the modules it was split into (tiled_*) too
        "test_engine_contract.py",
        "test_engines.py",
        "test_every_pattern.py",
        "test_tiled.py",
    ),
}

# tests a mutated module's judge files hold that do not judge it: the tiled engine's float64
# gradchecks (finite differences, about a third of a surviving tiled mutant's time) check
# gradients that the same files compare with the reference's autograd, cell by cell
MUTATION_SKIP = {"causalattn.engines.tiled": ("test_gradcheck_float64",)}

if WORKER is not None:
    # subprocesses (CLI, docs blocks, the Triton interpreter) inherit the share too
    os.environ.setdefault("OMP_NUM_THREADS", str(SHARE))
    os.environ.setdefault("MKL_NUM_THREADS", str(SHARE))


def pytest_xdist_make_scheduler(config, log):
    """`-n N` (dist "load"): load balancing, with each SERIAL unit sent whole to one worker
    (largest units first, then single tests in collection order)."""
    if config.getoption("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class Units(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return SERIAL.get(nodeid.split("::", 1)[0], nodeid)

    return Units(config, log)


@pytest.fixture(autouse=True)
def _torch_threads(request):
    """Under xdist: SHARE torch threads per worker; THREADED modules keep all the cores."""
    if WORKER is not None:
        import torch

        torch.set_num_threads(CORES if request.path.name in THREADED else SHARE)


@pytest.fixture(autouse=True)
def _worker_reach_in_mutmut_stats(monkeypatch):
    """mutmut's stats run maps each mutated function to the tests that reach it, counting
    calls in the test's process only. diagnose runs a callable in a forked worker (io.runner), so
    check/measure (and what else the worker reaches) would map to no test, its mutants "not
    covered". In that run only, the forked worker writes the functions it reached next to
    its result and the parent adds them to the test's; everything else runs as always."""
    if os.environ.get("MUTANT_UNDER_TEST") != "stats":
        return
    from pathlib import Path

    from mutmut.state import state

    from causalattn.io import runner

    reached = state()._stats  # mutmut 3's set of functions reached by the running test
    work, outcome = runner._in_worker, runner._outcome

    def worker(job, limits, deadline, result):  # in the forked worker
        try:
            return work(job, limits, deadline, result)
        finally:
            Path(f"{result}.reached").write_text("\n".join(sorted(reached)))

    def parent(what, rc, timed_out, timeout, result, log, max_memory):
        names = Path(f"{result}.reached")
        if names.exists():
            reached.update(names.read_text().split())
        return outcome(what, rc, timed_out, timeout, result, log, max_memory)

    monkeypatch.setattr(runner, "_in_worker", worker)
    monkeypatch.setattr(runner, "_outcome", parent)


@pytest.fixture(scope="module")
def tr():
    """The audit tests' trace (test_check_audit, test_check_stage_mask): T = 6 tokens,
    d_model 4, d_k = d_v = 3, seed 3."""
    import numpy as np

    import causalattn as ca

    rng = np.random.default_rng(3)
    X = rng.normal(size=(6, 4))
    return ca.trace(X, *(rng.normal(size=(4, 3)) for _ in range(3)))


@pytest.fixture
def loopback_ports(tmp_path_factory):
    """Held while a test picks free loopback ports and binds them (free_port, then gloo or
    torchrun): one such test at a time across xdist workers, so none takes another's port."""
    if WORKER is None:  # a serial run: nothing else of this run binds ports meanwhile
        yield
        return
    import fcntl

    # the workers' base temp folders share this run's root
    with open(tmp_path_factory.getbasetemp().parent / "loopback-ports.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        yield


def pytest_collection_modifyitems(config, items):
    """Under xdist, long tests first (a stable sort: the slow-marked ones and LONGEST);
    inside a mutmut worker, only the mutated module's own test files (MUTATION_TESTS),
    quickest first."""
    if WORKER is not None:
        items.sort(key=lambda it: not (it.name in LONGEST or it.get_closest_marker("slow")))
    mutant = os.environ.get("MUTANT_UNDER_TEST", "")
    files = next((f for prefix, f in MUTATION_TESTS.items() if mutant.startswith(prefix)), None)
    if files is None:
        return
    skip = next((t for prefix, t in MUTATION_SKIP.items() if mutant.startswith(prefix)), ())
    keep = [item for item in items if item.path.name in files and item.originalname not in skip]
    if len(keep) < len(items):
        config.hook.pytest_deselected(items=[item for item in items if item not in keep])
    # quickest first (mutmut's stats timed each test; it runs with -x): a killed mutant
    # usually fails a short test, and need not wait for the long ones
    took = _stats_durations(config.rootpath)
    items[:] = sorted(keep, key=lambda it: took.get(it.nodeid, float("inf")))


_DURATIONS: dict = {}


def _stats_durations(root) -> dict:
    """mutmut's per-test durations (mutants/mutmut-stats.json), read once per process."""
    if not _DURATIONS:
        import json
        from pathlib import Path

        try:
            stats = json.loads((Path(root) / "mutmut-stats.json").read_text())
            _DURATIONS.update(stats.get("duration_by_test", {}))
        except (OSError, ValueError):
            _DURATIONS["-"] = 0.0  # no stats: keep the order
    return _DURATIONS
