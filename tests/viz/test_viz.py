"""Heatmaps (matplotlib, Agg) and the explorer's data, without a browser; the CLI's pictures."""

from __future__ import annotations

import base64
import json
import re

import numpy as np
import pytest
from _helpers import QUESTIONS
from typer.testing import CliRunner

import causalattn as ca
from causalattn import masks, text, viz
from causalattn.cli import app
from causalattn.viz import heatmaps
from causalattn.viz.kinds import FUTURE, KINDS, MASK, PADDING, READABLE, WINDOW

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
            want = PADDING if (i >= L or j >= L) else (READABLE if j <= i else FUTURE)
            assert kinds[i, j] == want, (i, j)
    assert viz.padding_positions(batch.mask[0]).sum() == 0
    odd = np.tril(np.ones((4, 4), bool)) & ~np.eye(4, k=-2, dtype=bool)  # a past key blocked
    assert viz.mask_kinds(odd)[2, 0] == MASK and viz.mask_kinds(odd)[0, 2] == FUTURE


def test_kinds_follow_the_pattern_reasons_not_just_the_boolean_mask():
    pat = masks.Pattern(window=2, lengths=[3, 5])
    X = np.random.default_rng(0).normal(size=(2, 5, 4))
    tr = ca.trace(X, np.eye(4), np.eye(4), np.eye(4), window=2, lengths=[3, 5])
    kinds = viz.trace_kinds(tr)  # the reasons the trace recorded
    np.testing.assert_array_equal(kinds, pat.reasons(2, 1, 5, 5)[:, 0])
    assert kinds[1, 4, 1] == WINDOW and kinds[1, 1, 3] == FUTURE and kinds[0, 4, 0] == PADDING
    # a Trace with only its Pattern (no recorded reasons) is drawn from the pattern
    arrays = {n: tr[n] for n in ("Q", "K", "V", "S", "A")}
    bare = ca.Trace(arrays, allowed=tr.allowed, scale=tr.scale, pattern=pat)
    np.testing.assert_array_equal(viz.trace_kinds(bare), kinds)
    other = ca.Trace(
        arrays, allowed=tr.allowed, scale=tr.scale, pattern=masks.Pattern(window=3, lengths=[3, 5])
    )  # disagrees: not used
    assert (viz.trace_kinds(other) == WINDOW).sum() == 0
    # the explorer carries the kinds; with a bare mask, a window reads "blocked by the mask"
    plain = ca.Trace({n: a[1] for n, a in arrays.items()}, allowed=tr.allowed[1, 0], scale=tr.scale)
    seq = viz.explorer_data(plain)["sequences"][0]
    assert _kinds(seq["layers"][0])[4, 1] == MASK
    seq = viz.explorer_data(tr)["sequences"][1]
    assert _kinds(seq["layers"][0])[4, 1] == WINDOW


def test_pattern_pictures_draw_each_kind_distinctly_with_a_legend():
    fig = viz.plot_mask(masks.Pattern(window=3, lengths=[6]), T=8)
    ax = fig.axes[0]
    img = _rgba(fig)
    cells = {"readable": (5, 4), "window": (5, 1), "future": (2, 4), "padding": (7, 2)}
    colours = {k: _cell_colour(fig, img, ax, i, j) for k, (i, j) in cells.items()}
    names = list(colours)
    for a in range(len(names)):
        for b in range(a + 1, len(names)):
            assert np.abs(colours[names[a]] - colours[names[b]]).max() > 40, (names[a], names[b])
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        KINDS[c].label for c in (READABLE, PADDING, FUTURE, WINDOW)
    ]
    pats = {
        "causal": masks.Pattern(),
        "window 3": masks.Pattern(window=3),
        "chunk 4": masks.Pattern(chunk=4),
        "documents": masks.Pattern(cu_seqlens=[0, 3, 8]),
        "prefix 3": masks.Pattern(prefix_lengths=[3]),
    }
    fig = viz.plot_patterns(pats, 8)
    assert [ax.get_title() for ax in fig.axes if ax.get_visible()][:5] == list(pats)
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert legend == [KINDS[c].label for c in (0, 2, 3, 4, 5)]  # no padding: none in them
    with pytest.raises(ValueError, match="give T= or tokens="):
        viz.plot_mask(masks.Pattern(window=3))


def test_mask_figure_three_distinct_styles_and_token_ticks(batch):
    fig = viz.plot_mask(batch.mask[3], batch.tokens[3])
    ax = fig.axes[0]
    img = _rgba(fig)
    allowed, causal, pad = (_cell_colour(fig, img, ax, i, j) for i, j in ((3, 1), (1, 3), (8, 2)))
    for a, b in ((allowed, causal), (allowed, pad), (causal, pad)):
        assert np.abs(a - b).max() > 40, (allowed, causal, pad)
    assert [t.get_text() for t in ax.get_xticklabels()] == batch.tokens[3]  # keys: columns
    assert [t.get_text() for t in ax.get_yticklabels()] == batch.tokens[3]  # queries: rows
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        KINDS[c].label for c in (READABLE, PADDING, FUTURE)
    ]


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
    tr = ca.trace(
        X, np.eye(2), np.eye(2), np.array([[1, 1], [1, -1]], float), tokens=["$x$", "<b>", "c", "d"]
    )  # a token is text, never mathtext or markup
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


def _kinds(layer: dict) -> np.ndarray:
    """The T×T kinds of a layer's data (run-length form) back as an array."""
    codes = _f(layer["kinds"]["codes"], "u1")
    runs = _f(layer["kinds"]["runs"], "<u4")
    flat = np.repeat(codes, runs)
    T = int(np.sqrt(flat.size))
    return flat.reshape(T, T)


def _data(html: str) -> dict:
    """The page's index with every paged block put back in place (as explorer_data gives)."""
    m = re.search(r'<script type="application/json" class="ca-data">(.*?)</script>', html, re.S)
    index = json.loads(m.group(1))
    blocks = {
        int(k): json.loads(b)
        for k, b in re.findall(
            r'<script type="application/json" class="ca-block" data-k="(\d+)">(.*?)</script>',
            html,
            re.S,
        )
    }
    for s in index["sequences"]:
        s.update(blocks[s["block"]])
        for lay in s["layers"]:
            lay.update(blocks[lay["block"]])
    index["xsets"] = [blocks[k] for k in index["xsets"]]
    return index


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


def test_explorer_script_is_its_modules_inlined_in_order_in_one_script():
    from causalattn.viz import explorer

    html = viz.explorer_html(ca.trace(np.eye(3), np.eye(3), np.eye(3), np.eye(3)))
    sources = [explorer.script_source(m) for m in explorer.SCRIPTS]
    at = [html.index(src) for src in sources]  # each module whole, in SCRIPTS' order
    assert at == sorted(at) and all(html.count(src) == 1 for src in sources)
    assert explorer.SCRIPTS[0] == "decode" and explorer.SCRIPTS[-1] == "main"
    assert html.count("<script nonce=") == 1  # one script element; the rest is JSON data
    assert "causalattnExplorer(root" in html.split(sources[-1])[1]  # main runs last


def test_explorer_data_compact_when_recomputable_and_faithful_otherwise(traces, batch):
    seq = viz.explorer_data(traces[3])["sequences"][0]
    layer = seq["layers"][0]
    assert np.array_equal(_kinds(layer) == READABLE, batch.mask[3])
    assert seq["pad"] == [0] * 6 + [1] * 4
    assert [h["form"] for h in layer["heads"]] == ["x", "x"]  # X W, from shared weights
    data = viz.explorer_data(traces)
    (shared,) = data["xsets"]  # one set of weights for all sentences
    layer = data["sequences"][3]["layers"][0]
    tr = traces[3]
    np.testing.assert_array_equal(_f(shared["W_q"], "<f8").reshape(16, 16), tr["W_q"])
    table = _f(shared["X"], "<f8").reshape(-1, 16)
    np.testing.assert_array_equal(table[_f(layer["rows"], "<u2")], tr.X)  # each row once
    assert len(table) == len(batch.vocab) - 1  # every token of the corpus, and <PAD>
    assert "H" not in layer["heads"][1] and "Q" not in layer["heads"][1]
    # a trace whose A is not softmax_last(S + M) (a recorded bug) is carried as it is
    X = np.array([[1, 0], [0, 1], [1, 1], [-1, 1]], float)
    tr = ca.trace(X, np.eye(2), np.eye(2), np.eye(2))
    arrays = {st.name: st.value for st in tr}
    arrays["A"] = np.tril(np.full((4, 4), 0.5))
    bad = ca.Trace(arrays, allowed=tr.allowed, scale=tr.scale)
    head = viz.explorer_data(bad)["sequences"][0]["layers"][0]["heads"][0]
    assert head["form"] == "dense" and "H" in head  # its H is not its A V either
    np.testing.assert_allclose(_f(head["A"], "<f4"), arrays["A"][tr.allowed])


def _model(L=3, H=2, T=6, dtype=np.float32, seed=0, d=4):
    """Layers of one model as capture() gives them: heads on a leading axis, shared tokens."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(L):
        Q, K, V = (rng.normal(size=(H, T, d)).astype(dtype) for _ in range(3))
        S = (Q @ np.swapaxes(K, -1, -2)) * dtype(0.5)
        A = ca.matrix_form.softmax_last(S.astype(np.float64), masks.causal(T)).astype(dtype)
        out.append(
            ca.Trace(
                {"Q": Q, "K": K, "V": V, "S": S, "A": A, "H": A @ V},
                allowed=masks.causal(T),
                scale=0.5,
                n_heads=H,
                tokens=[f"t{i}" for i in range(T)],
            )
        )
    return out


def test_a_list_of_layers_gets_a_model_view_with_head_summaries():
    layers = _model()
    data = viz.explorer_data(layers)
    (seq,) = data["sequences"]
    assert seq["n_layers"] == 3 and [lay["name"] for lay in seq["layers"]] == [
        "layer 1",
        "layer 2",
        "layer 3",
    ]
    lay = seq["layers"][1]
    A = layers[1].A.astype(np.float64)
    rows = np.arange(6)
    ent = -(np.where(A > 0, A * np.log(np.where(A > 0, A, 1)), 0)).sum(-1).mean(-1)
    np.testing.assert_allclose(lay["summary"]["entropy"], ent, atol=1e-4)
    np.testing.assert_allclose(lay["summary"]["first"], A[:, :, 0].mean(-1), atol=1e-4)
    dist = (A * (rows[:, None] - rows[None, :])).sum(-1).mean(-1)
    np.testing.assert_allclose(lay["summary"]["distance"], dist, atol=1e-4)
    th = _f(lay["thumb"]["px"], "u1").reshape(2, 6, 6)  # T <= 48: one pixel per cell
    assert th[0, 0, 0] == 255 and th[0, 0, 1] == 0  # row 1 reads only itself
    # float32 Q and K travel as float32, and the page's recomputed A is within 2e-5
    assert lay["heads"][0]["qprec"] == "f4" and data["notes"][-1].startswith("S and A")
    # sentences (different tokens) stay sentences; layers= overrides the guess
    assert viz.explorer_data(layers, layers=False)["sequences"][0]["n_layers"] == 1
    with pytest.raises(ValueError, match="layers=True needs"):
        viz.explorer_data(layers + _model(L=1, T=5), layers=True)


def test_a_page_that_would_be_too_big_uses_float16_then_keeps_the_first_sequences():
    layers = _model(L=2, H=2, T=40, dtype=np.float64, d=8)  # 3840 numbers: 41 kB in float64
    small = viz.explorer_data(layers, max_bytes=15_000)
    head = small["sequences"][0]["layers"][0]["heads"][0]
    assert head["qprec"] == "f2" and head["v_shown"] == 4 and head["form"] == "qk"
    assert any("float16" in n for n in small["notes"])
    assert len(_f(head["vnorm"], "<f4")) == 40  # exact norms beside the cut V
    np.testing.assert_allclose(
        _f(head["vnorm"], "<f4"), np.linalg.norm(layers[0].V[0], axis=-1), rtol=1e-6
    )
    sents = _model(L=30, H=2, T=20, d=8)  # as 30 sequences of their own (no shared weights)
    capped = viz.explorer_data(sents, max_bytes=20_000, layers=False)
    n = len(capped["sequences"])
    assert 1 <= n < 30 and f"first {n} of 30 sequences" in capped["notes"][0]
    with pytest.raises(ValueError, match="max_bytes"):
        viz.explorer_data(sents, max_bytes=0)


def test_score_modifiers_travel_as_parameters_not_as_dense_matrices():
    rng = np.random.default_rng(3)
    W = [rng.normal(size=(8, 8)) for _ in range(3)]
    tr = ca.trace(
        rng.normal(size=(1, 12, 8)),
        *W,
        n_heads=2,
        window=5,
        softcap=3.0,
        alibi_slopes=np.array([0.5, 0.25]),
        sinks=np.array([0.3, 2.0]),
    )
    bare = ca.Trace(
        {n: tr[n][0] for n in ("Q", "K", "V", "S", "A", "H")},
        n_heads=2,
        allowed=np.broadcast_to(tr.allowed, tr.A.shape)[0],
        scale=tr.scale,
        pattern=tr.pattern,
    )  # no X: Q, K
    lay = viz.explorer_data(bare)["sequences"][0]["layers"][0]
    assert [h["form"] for h in lay["heads"]] == ["qk", "qk"]
    assert lay["mods"] == {"softcap": 3.0, "slopes": [0.5, 0.25], "sinks": [0.3, 2.0]}
    no_pattern = ca.Trace(
        {n: tr[n][0] for n in ("Q", "K", "V", "S", "A")},
        n_heads=2,
        allowed=np.broadcast_to(tr.allowed, tr.A.shape)[0],
        scale=tr.scale,
    )  # modifiers unknown: as is
    lay = viz.explorer_data(no_pattern)["sequences"][0]["layers"][0]
    assert [h["form"] for h in lay["heads"]] == ["dense", "dense"]


def test_traces_with_and_without_their_weights_share_a_page():
    """Layers of the same shapes are checked together; one with X and weights and one with
    only Q, K, V are not one group (this raised a KeyError for W_q)."""
    rng = np.random.default_rng(4)
    tr = ca.trace(rng.normal(size=(6, 4)), *(rng.normal(size=(4, 4)) for _ in range(3)))
    bare = ca.Trace(
        {n: tr[n] for n in ("Q", "K", "V", "S", "A", "H")}, allowed=tr.allowed, scale=tr.scale
    )
    data = viz.explorer_data([tr, bare], layers=False)
    assert [s["layers"][0]["heads"][0]["form"] for s in data["sequences"]] == ["x", "qk"]


def test_questions_travel_with_their_matrix():
    learn = viz.explorer_data(_model(L=1), questions=QUESTIONS)["learn"]
    assert [q["answer"] for q in learn] == [1, 1]
    pic = learn[0]["picture"]
    tr = ca.trace(
        np.array(QUESTIONS[0]["data"]["X"], float),
        np.eye(2),
        np.eye(2),
        np.array([[1, 1], [1, -1]], float),
    )
    assert pic["matrix"] == "A" and pic["values"][3] == [round(x, 4) for x in tr.A[3]]
    assert pic["values"][0][1] is None  # blocked: no value
    m = learn[1]["picture"]
    assert m["matrix"] == "M" and m["kinds"][7][1] == PADDING and m["tokens"][7] == text.PAD
    with pytest.raises(ValueError, match="answer 5"):
        viz.explorer_data(_model(L=1), questions=[dict(QUESTIONS[0], answer=5)])


def test_repr_html_for_trace_and_batch(traces, batch):
    frag = traces[0]._repr_html_()
    assert frag.startswith('<div class="ca-explorer"') and "<html" not in frag
    assert "causalattnExplorer(root" in frag
    assert len(_data(batch._repr_html_())["sequences"]) == batch.B
    assert 'class="ca-block"' in frag
    assert ca.Trace({"X": np.eye(2)})._repr_html_() is None  # partial trace: plain repr


runner = CliRunner()


def test_cli_explore_sentences_file_and_trace(tmp_path):
    out = tmp_path / "e.html"
    r = runner.invoke(
        app, ["explore", "text", "I love pizza", "you love cheese too", "-o", str(out)]
    )
    assert r.exit_code == 0, r.output
    names = [s["name"] for s in _data(out.read_text())["sequences"]]
    assert names == ["1: I love pizza", "2: you love cheese too"]
    corpus = tmp_path / "c.txt"
    corpus.write_text("one two\n\nthree four five\n", encoding="utf-8")
    r = runner.invoke(app, ["explore", "text", "--file", str(corpus), "-o", str(out), "--json"])
    assert r.exit_code == 0 and json.loads(r.output)["sequences"] == 2
    npz = tmp_path / "t.npz"
    assert runner.invoke(app, ["trace", "--save", str(npz)]).exit_code == 0
    r = runner.invoke(app, ["explore", "trace", str(npz), "-o", str(out)])
    assert r.exit_code == 0 and _data(out.read_text())["sequences"][0]["T"] == 4
    r = runner.invoke(app, ["explore", "trace", str(tmp_path / "missing.npz")])
    assert r.exit_code == 2 and "cannot be read" in r.output


def test_cli_explore_with_check_yourself_questions(tmp_path):
    from causalattn import learn

    out = tmp_path / "q.html"
    r = runner.invoke(
        app, ["explore", "text", "I love pizza", "--questions", "3", "--seed", "2", "-o", str(out)]
    )
    assert r.exit_code == 0, r.output
    shown = _data(out.read_text())["learn"]
    want = learn.questions(2, 3)
    assert [q["prompt"] for q in shown] == [q["prompt"] for q in want]
    assert [q["answer"] for q in shown] == [q["answer"] for q in want]
    r = runner.invoke(app, ["explore", "text", "--questions", "-1", "-o", str(out)])
    assert r.exit_code == 2 and "--questions must be 0" in r.output


def test_cli_png_for_masks_and_trace(tmp_path):
    r = runner.invoke(app, ["trace", "--png", str(tmp_path / "tr")])
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in (tmp_path / "tr").iterdir()) == [
        "A.png",
        "M.png",
        "S.png",
        "norm.png",
    ]
    r = runner.invoke(app, ["masks", "a b c", "d e", "--png", str(tmp_path / "m")])
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == [
        "mask_sentence1.png",
        "mask_sentence2.png",
    ]
    assert heatmaps.STAGE_TITLES["A"].startswith("weights A")
