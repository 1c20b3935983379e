"""The pattern benchmark's rows and targets on tiny shapes (no timing claims: shapes only)."""

from causalattn.bench import patterns as bench


def test_rows_name_their_peers_and_bars_read_them():
    rows = []
    for case, peers, pass_ in (
        ("window", ("sdpa (bool mask)",), "fwd+bwd"),
        ("documents", ("sdpa (bool mask)",), "fwd"),
        ("modifiers", ("cpp", "tiled"), "fwd"),
        ("dropout", ("cpp p=0", "tiled p=0", "sdpa p=0.1"), "fwd+bwd"),
    ):
        gr = bench.Group(case, (1, 2, 256, 8), pass_, peers, budget_s=0.01)
        rows += bench._rows(gr)
    assert all(r["ms"] > 0 and r["reps"] >= 3 for r in rows)
    drop = next(r for r in rows if r["engine"] == "tiled p=0.1")
    assert set(drop["vs"]) == {"cpp p=0", "tiled p=0", "sdpa p=0.1"}
    assert {r["engine"] for r in rows} >= {"cpp (cu_seqlens)", "cpp (ALiBi)", "cpp p=0.1"}
    docs = next(r for r in rows if r["engine"] == "tiled (cu_seqlens)")
    assert docs["causal_over_readable"] > 1
    names = [b[0] for b in bench.targets(rows)]
    assert any(n.startswith("documents fwd") for n in names)
    assert any(n.startswith("dropout 0.1") for n in names)
    assert any(n.startswith("softcap 30 fwd") for n in names)
    assert any(n.startswith("ALiBi fwd: cpp") for n in names)
    lengths = bench._doc_lengths(8192, 16)
    assert len(lengths) == 16 and sum(lengths) == 8192 and min(lengths) >= 16


def test_mask_mod_rows_pair_each_engine_with_its_keywords_and_report_memory():
    import torch

    _, fn = bench._window_docs(512)
    i = torch.arange(512)
    assert bool(fn(0, 0, i[:, None], i[None, :]).any())
    gr = bench.Group("mask_mod", (1, 2, 512, 8), "fwd+bwd", bench._mod_peers(), budget_s=0.01)
    rows = bench._rows(gr)
    mods = [r for r in rows if r["engine"].endswith("(mask_mod)")]
    assert {r["engine"] for r in mods} >= {"tiled (mask_mod)"}
    assert all("tiled (keywords)" in r["vs"] for r in mods)
    names = [b[0] for b in bench.targets(rows)]
    assert any(n.startswith("mask_mod window+documents T=8192 tiled fwd+bwd") for n in names)


def test_bias_rows_time_learned_biases_against_the_plain_native_engine():
    gr = bench.Group("bias", (1, 2, 128, 8), "fwd+bwd", ("cpp",), budget_s=0.01)
    rows = bench._rows(gr)
    assert {r["engine"] for r in rows} == {"cpp", "cpp (bias)", "cpp (rel_bias)"}
    assert all(r["ms"] > 0 and "cpp" in r["vs"] for r in rows if r["engine"] != "cpp")
    names = [b[0] for b in bench.targets(rows)]
    assert "bias fwd+bwd: cpp <= 1.5x without" in names
    assert "rel_bias fwd+bwd: cpp <= 1.2x without" in names
