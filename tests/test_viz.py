"""Heatmaps (matplotlib, Agg) and the explorer's data, without a browser; the CLI's pictures."""

from __future__ import annotations

import base64
import json
import re

import numpy as np
import pytest
from typer.testing import CliRunner

import causalattn as ca
from causalattn import text, viz
from causalattn.cli import app
from causalattn.viz import heatmaps
from causalattn.viz.kinds import ALLOWED, CAUSAL, PADDING

pytest.importorskip("matplotlib")


@pytest.fixture(scope="module")
def batch():
    return text.encode(text.SEED_SENTENCES)


@pytest.fixture(scope="module")
def traces(batch):
    return viz.batch_traces(batch)


def _rgba(fig) -> np.ndarray:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].astype(float)


def _cell_colour(fig, img, ax, i, j) -> np.ndarray:
    """Mean colour inside cell (i, j) (a hatch makes it darker than its face, never equal)."""
    (x0, y0), (x1, y1) = ax.transData.transform([(j - 0.35, i - 0.35), (j + 0.35, i + 0.35)])
    H = img.shape[0]
    rows = slice(int(H - max(y0, y1)), int(H - min(y0, y1)))
    cols = slice(int(min(x0, x1)), int(max(x0, x1)))
    return img[rows, cols].reshape(-1, 3).mean(axis=0)


def test_mask_kinds_follow_causality_and_padding(batch):
    kinds = viz.mask_kinds(batch.mask[3])  # "Cheese and burgers go well together" + 4 <PAD>
    L = int(batch.lengths[3])
    for i in range(batch.N):
        for j in range(batch.N):
            want = PADDING if (i >= L or j >= L) else (ALLOWED if j <= i else CAUSAL)
            assert kinds[i, j] == want, (i, j)
    assert viz.padding_positions(batch.mask[0]).sum() == 0


def test_mask_figure_three_distinct_styles_and_token_ticks(batch):
    fig = viz.plot_mask(batch.mask[3], batch.tokens[3])
    ax = fig.axes[0]
    img = _rgba(fig)
    allowed, causal, pad = (_cell_colour(fig, img, ax, i, j) for i, j in ((3, 1), (1, 3), (8, 2)))
    for a, b in ((allowed, causal), (allowed, pad), (causal, pad)):
        assert np.abs(a - b).max() > 40, (allowed, causal, pad)
    assert [t.get_text() for t in ax.get_xticklabels()] == batch.tokens[3]  # keys: columns
    assert [t.get_text() for t in ax.get_yticklabels()] == batch.tokens[3]  # queries: rows
    assert [t.get_text() for t in ax.get_legend().get_texts()] == list(viz.kinds.KIND_NAMES)


def test_stage_heatmaps_show_the_trace_values_per_head(traces, batch):
    tr = traces[3]
    fig = viz.plot_stage(tr, "A")  # a grid: one panel per head
    axes = [ax for ax in fig.axes if ax.get_visible() and ax.get_images()]
    assert len(axes) == 2 and "head 2" in axes[1].get_title()
    for h, ax in enumerate(axes):
        shown = ax.get_images()[-1].get_array()  # values over the blocked-kind layer
        want = tr.select(h).A
        assert np.array_equal(shown.mask, ~tr.select(h).allowed)
        np.testing.assert_allclose(shown.filled(0), want, atol=1e-12)
        texts = [t.get_text() for t in ax.texts]
        assert texts.count("Σ=1.000") == 6 and texts.count("Σ=0 (pad)") == 4  # the softmax axis
    fig = viz.plot_stage(tr, "norm", head=1)
    shown = fig.axes[0].get_images()[-1].get_array()
    ex = tr.select(1).explain(5)  # ‖A_ij v_j‖ computed independently by Trace.explain
    np.testing.assert_allclose(shown.filled(0)[5], ex.norm, atol=1e-12)


def test_save_png_and_svg_by_extension(tmp_path):
    X = np.array([[1, 0], [0, 1], [1, 1], [-1, 1]], float)
    tr = ca.trace(X, np.eye(2), np.eye(2), np.array([[1, 1], [1, -1]], float),
                  tokens=["$x$", "<b>", "c", "d"])  # a token is text, never mathtext or markup
    fig = viz.plot_stage(tr, "S")
    png = viz.save(fig, tmp_path / "s.png")
    svg = viz.save(fig, tmp_path / "sub" / "s.SVG")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert b"<svg" in svg.read_bytes()[:400]
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()][0] == r"\$x\$"
    with pytest.raises(ValueError, match=r"\.png or \.svg"):
        viz.save(fig, tmp_path / "s.jpg")


def test_bad_input_names_the_problem(traces):
    with pytest.raises(ValueError, match="stage must be one of"):
        viz.plot_stage(traces[0], "Q")
    with pytest.raises(ValueError, match="head=5"):
        viz.plot_stage(traces[0], "A", head=5)
    X = np.random.default_rng(0).normal(size=(2, 3, 4))
    batched = ca.trace(X, np.eye(4), np.eye(4), np.eye(4))
    with pytest.raises(ValueError, match="2 sequences"):
        viz.plot_stage(batched, "A")
    with pytest.raises(ValueError, match="boolean T×T"):
        viz.plot_mask(np.ones((3, 4), bool))


def _data(html: str) -> dict:
    m = re.search(r'<script type="application/json" class="ca-data">(.*?)</script>', html, re.S)
    return json.loads(m.group(1))


def _f(b64: str, dtype: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(b64), dtype=dtype)


def test_explorer_page_is_self_contained_and_escapes_tokens():
    hostile = ["<img src=x onerror=alert(1)>", "</script><script>alert(2)</script>", "a&b", "<!--"]
    rng = np.random.default_rng(0)
    tr = ca.trace(rng.normal(size=(4, 4)), np.eye(4), np.eye(4), np.eye(4), tokens=hostile)
    html = viz.explorer_html(tr, title="<i>title</i>")
    assert "<img" not in html and "alert(2)</script>" not in html and "<i>" not in html
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html)  # nothing to fetch
    assert "Content-Security-Policy" in html and "default-src 'none'" in html
    data = _data(html)
    assert data["sequences"][0]["tokens"] == hostile  # JSON escapes decode back exactly


def test_explorer_data_compact_when_recomputable_and_faithful_otherwise(traces, batch):
    seq = viz.explorer_data(traces[3])["sequences"][0]
    allowed = np.unpackbits(np.frombuffer(base64.b64decode(seq["allowed"]), np.uint8))
    assert np.array_equal(allowed[: batch.N**2].reshape(batch.N, batch.N), batch.mask[3])
    assert seq["pad"] == [0] * 6 + [1] * 4
    assert [h["form"] for h in seq["heads"]] == ["qk", "qk"]
    h1 = traces[3].select(1)
    np.testing.assert_array_equal(_f(seq["heads"][1]["Q"], "<f8").reshape(h1.Q.shape), h1.Q)
    # a trace whose A is not softmax_last(S + M) (a recorded bug) is carried as it is
    X = np.array([[1, 0], [0, 1], [1, 1], [-1, 1]], float)
    tr = ca.trace(X, np.eye(2), np.eye(2), np.eye(2))
    arrays = {st.name: st.value for st in tr}
    arrays["A"] = np.tril(np.full((4, 4), 0.5))
    bad = ca.Trace(arrays, allowed=tr.allowed, scale=tr.scale)
    head = viz.explorer_data(bad)["sequences"][0]["heads"][0]
    assert head["form"] == "dense"
    np.testing.assert_allclose(_f(head["A"], "<f4"), arrays["A"][tr.allowed])


def test_repr_html_for_trace_and_batch(traces, batch):
    frag = traces[0]._repr_html_()
    assert frag.startswith('<div class="ca-explorer"') and "<html" not in frag
    assert "causalattnExplorer(root" in frag
    assert len(_data(batch._repr_html_())["sequences"]) == batch.B
    assert ca.Trace({"X": np.eye(2)})._repr_html_() is None  # partial trace: plain repr


runner = CliRunner()


def test_cli_explore_sentences_file_and_trace(tmp_path):
    out = tmp_path / "e.html"
    r = runner.invoke(app, ["explore", "I love pizza", "you love cheese too", "-o", str(out)])
    assert r.exit_code == 0, r.output
    names = [s["name"] for s in _data(out.read_text())["sequences"]]
    assert names == ["1: I love pizza", "2: you love cheese too"]
    corpus = tmp_path / "c.txt"
    corpus.write_text("one two\n\nthree four five\n", encoding="utf-8")
    r = runner.invoke(app, ["explore", "--file", str(corpus), "-o", str(out), "--json"])
    assert r.exit_code == 0 and json.loads(r.output)["sequences"] == 2
    npz = tmp_path / "t.npz"
    assert runner.invoke(app, ["trace", "--save", str(npz)]).exit_code == 0
    r = runner.invoke(app, ["explore", "--trace", str(npz), "-o", str(out)])
    assert r.exit_code == 0 and _data(out.read_text())["sequences"][0]["T"] == 4
    r = runner.invoke(app, ["explore", "x y", "--trace", str(npz)])
    assert r.exit_code == 2 and "only one of them" in r.output
    r = runner.invoke(app, ["explore", "--trace", str(tmp_path / "missing.npz")])
    assert r.exit_code == 2 and "cannot be read" in r.output


def test_cli_png_for_masks_and_trace(tmp_path):
    r = runner.invoke(app, ["trace", "--png", str(tmp_path / "tr")])
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in (tmp_path / "tr").iterdir()) == ["A.png", "M.png", "S.png",
                                                                   "norm.png"]
    r = runner.invoke(app, ["masks", "a b c", "d e", "--png", str(tmp_path / "m")])
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == ["mask_sentence1.png",
                                                                  "mask_sentence2.png"]
    assert heatmaps.STAGE_TITLES["A"].startswith("weights A")
