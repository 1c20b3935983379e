"""The explorer's size and speed on big inputs, in Debian's headless Chromium.

    python benchmarks/bench_explorer.py [--quick]

Cases (issue 15 and 16):
- model: 12 layers × 12 heads at T = 512, d_k = 64, float32 stages (what ``capture()`` of a
  GPT-2-small-sized model gives): write time, file size, open-and-draw time of the model view;
- T = 2048: one layer of 12 heads;
- 10,000 sentences: encode, seeded traces and the page, all sentences paged; then opening
  the page and switching to the last sentence.
Each page is opened alternately with a peer, the four-token chapter page, so the figure the
browser itself costs (start, navigation) is measured in the same run. Reported: the time from
navigation to the first view drawn, in the page (``data-load-ms``), and wall clock.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import causalattn as ca
from causalattn import masks, text, viz
from causalattn.matrix_form import softmax_last

CHROMIUM = os.environ.get("CAUSALATTN_CHROMIUM", "/usr/bin/chromium")


def model_layers(L: int, H: int, T: int, d_k: int = 64, seed: int = 0) -> list[ca.Trace]:
    rng = np.random.default_rng(seed)
    allowed = masks.causal(T)
    toks = [f" tok{i}" for i in range(T)]
    out = []
    for _ in range(L):
        Q, K, V = (rng.normal(size=(H, T, d_k)).astype(np.float32) for _ in range(3))
        S = (Q @ np.swapaxes(K, -1, -2)) / np.float32(np.sqrt(d_k))
        A = softmax_last(S.astype(np.float64), allowed).astype(np.float32)
        out.append(
            ca.Trace(
                {"Q": Q, "K": K, "V": V, "S": S, "A": A, "H": A @ V},
                allowed=allowed,
                scale=1 / np.sqrt(d_k),
                n_heads=H,
                tokens=toks,
            )
        )
    return out


def sentences(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    words = [f"w{i}" for i in range(3000)]
    return [" ".join(rng.choice(words, size=rng.integers(5, 21))) for _ in range(n)]


def open_times(browser, path: Path, peer: Path, repeats: int, after=None) -> dict:
    """In-page ms from navigation to the first view drawn, alternating with the peer page."""
    res = {"page": [], "peer": [], "wall": [], "after": []}
    for _ in range(repeats):
        for which, p in (("page", path), ("peer", peer)):
            pg = browser.new_page(viewport={"width": 1500, "height": 1000})
            errors = []
            pg.on("pageerror", lambda e, errors=errors: errors.append(str(e)))
            pg.on("console", lambda m, errors=errors: m.type == "error" and errors.append(m.text))
            t0 = time.perf_counter()
            pg.goto(p.resolve().as_uri())
            pg.wait_for_selector(".ca-explorer[data-ready='1']", timeout=120_000)
            wall = time.perf_counter() - t0
            res[which].append(float(pg.get_attribute(".ca-explorer", "data-load-ms")))
            if which == "page":
                res["wall"].append(wall * 1000)
                if after is not None:
                    t1 = time.perf_counter()
                    after(pg)
                    res["after"].append((time.perf_counter() - t1) * 1000)
            if errors:
                raise RuntimeError(f"{p.name}: console errors {errors[:3]}")
            pg.close()
    return {k: float(np.median(v)) if v else None for k, v in res.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one opening each, 2,000 sentences")
    args = ap.parse_args()
    from playwright.sync_api import sync_playwright

    reps = 1 if args.quick else 3
    n_sent = 2000 if args.quick else 10_000
    rows = []
    with tempfile.TemporaryDirectory() as tmp, sync_playwright() as pw:
        tmp = Path(tmp)
        X = np.array([[1, 0], [0, 1], [1, 1], [-1, 1]], float)
        peer = viz.write_explorer(ca.trace(X, np.eye(2), np.eye(2), np.eye(2)), tmp / "peer.html")
        browser = pw.chromium.launch(
            executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"]
        )

        def case(name, build, after=None):
            t0 = time.perf_counter()
            path = build()
            built = time.perf_counter() - t0
            t = open_times(browser, path, peer, reps, after)
            rows.append((name, built, path.stat().st_size / 2**20, t))

        case(
            "model 12 layers × 12 heads, T = 512",
            lambda: viz.write_explorer(model_layers(12, 12, 512), tmp / "model.html"),
            after=lambda pg: pg.locator("button.ca-thumb").nth(143).click(),
        )
        case(
            "T = 2048, 12 heads",
            lambda: viz.write_explorer(model_layers(1, 12, 2048)[0], tmp / "t2048.html"),
        )

        def tenk():
            batch = text.encode(sentences(n_sent))
            trs = viz.batch_traces(batch)
            return viz.write_explorer(
                trs,
                tmp / "sent.html",
                names=viz.sentence_names(batch),
                max_bytes=20 * 10**6 - 2**20,
            )

        def last(pg):
            pg.select_option("[data-role=seq]", index=n_sent - 1)
            assert pg.input_value("[data-role=seq]") == str(n_sent - 1)

        case(f"{n_sent:,} sentences (paged)", tenk, after=last)
        browser.close()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(
        f"{'case':<40} {'build s':>8} {'MiB':>7} {'drawn ms':>9} {'peer ms':>8} "
        f"{'wall ms':>8} {'then ms':>8}"
    )
    for name, built, mib, t in rows:
        then = f"{t['after']:.0f}" if t["after"] is not None else "–"
        print(
            f"{name:<40} {built:>8.1f} {mib:>7.1f} {t['page']:>9.0f} {t['peer']:>8.0f} "
            f"{t['wall']:>8.0f} {then:>8}"
        )
    print(f"peak resident memory of this process: {rss:.0f} MiB (Python side; Chromium apart)")
    print(
        "drawn ms: navigation to the first view drawn, in the page (median of "
        f"{reps}); peer: the four-token page, opened alternately; then: the thumbnail of "
        "layer 12 head 12 opened / the last sentence opened"
    )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
