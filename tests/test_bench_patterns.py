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
