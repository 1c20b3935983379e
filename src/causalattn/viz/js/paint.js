/* causalattn explorer, paint: the four panels (M, S, A, ‖A_ij v_j‖) of one head. Cells are
 * painted into one T×T image per panel (all four in one pass, cached on the head) and scaled
 * onto a canvas, so the cost does not grow with DOM elements; labels, numbers and the Σ
 * strip are drawn on top, the query row on an overlay. Reads the state, never changes it.
 */
function caPaint(doc, U, kindList) {
  "use strict";
  var el = U.el, short = U.short, fmt = U.fmt, css = U.css, sized = U.sized, hatchPattern = U.hatchPattern;
  var KIND = U.KIND, LUT = U.LUT, KPX = U.KPX, KMUTED = U.KMUTED, NAN_PX = U.NAN_PX;
  var PANELS = [
    { key: "M", title: "M: mask (0 = may read, −∞ = blocked)" },
    { key: "S", title: "S = Q Kᵀ / √d_k (scores)" },
    { key: "A", title: "A = softmax_last(S + M): each row sums to 1 (Σ strip)" },
    { key: "N", title: "‖A_ij v_j‖ (contribution norms)" },
  ];
  function makePanels(panelBox) { // the four figures: a base canvas and an overlay each
    return PANELS.map(function (p) {
      var fig = el("figure", "ca-panel");
      fig.setAttribute("data-panel", p.key);
      var cap = el("figcaption", null, p.title), range = el("div", "ca-range");
      var stack = el("div", "ca-stack"), base = el("canvas", "ca-base"), over = el("canvas", "ca-over");
      stack.appendChild(base); stack.appendChild(over);
      fig.appendChild(cap); fig.appendChild(stack); fig.appendChild(range);
      panelBox.appendChild(fig);
      return { key: p.key, base: base, over: over, range: range, geo: null };
    });
  }

  // -- legend: the kinds of cell present in this layer's mask ------------------------------
  function renderLegend(legend, info) {
    while (legend.firstChild) legend.removeChild(legend.firstChild);
    kindList.forEach(function (k) {
      if (!info.present[k.code]) return;
      var sw = el("span", "ca-swatch" + (k.hatch ? " ca-sw-hatch" : ""));
      sw.style.backgroundColor = k.color;
      var item = el("span", "ca-legend-item"); item.setAttribute("data-kind", k.name);
      item.appendChild(sw); item.appendChild(doc.createTextNode(k.label));
      legend.appendChild(item);
    });
  }

  // -- painting: one T×T image per panel, all four in one pass, cached per head -------------
  function paintAll(info, hi) {
    if (hi.images) return hi.images;
    var T = info.T, kinds = info.kinds, vn = hi.vnorm, S = hi.S, A = hi.A;
    var out = {}, px = {}, imgs = {};
    ["M", "S", "A", "N"].forEach(function (key) {
      var cv = doc.createElement("canvas");
      cv.width = T; cv.height = T;
      out[key] = cv; imgs[key] = cv.getContext("2d").createImageData(T, T);
      px[key] = new Uint32Array(imgs[key].data.buffer);
    });
    var pM = px.M, pS = px.S, pA = px.A, pN = px.N, lS = LUT.S, lA = LUT.A, lN = LUT.N;
    var iS = 255 / (2 * hi.smax), iA = 255 / hi.amax, iN = 255 / hi.nmax, sLo = -hi.smax;
    var ok = KPX[0];
    function idx(table, t) { return t !== t ? NAN_PX : t < 0 ? table[0] : t >= 255 ? table[255] : table[t | 0]; }
    for (var i = 0, k = 0; i < T; i++) {
      for (var j = 0, p = i * T; j < T; j++, p++) {
        var kd = kinds[p];
        if (kd) { pM[p] = KPX[kd]; pS[p] = pA[p] = pN[p] = KMUTED[kd]; continue; }
        var a = A[k];
        pM[p] = ok;
        pS[p] = idx(lS, (S[k] - sLo) * iS + 0.5);
        pA[p] = idx(lA, a * iA + 0.5);
        pN[p] = idx(lN, a * vn[j] * iN + 0.5);
        k++;
      }
    }
    Object.keys(out).forEach(function (key) { out[key].getContext("2d").putImageData(imgs[key], 0, 0); });
    hi.images = out;
    return out;
  }

  // -- geometry and drawing of one panel ---------------------------------------------------
  function geometry(info, key, ctx) {
    var T = info.T, cell = Math.min(40, 340 / T), G = cell * T;
    var labels = cell >= 9, font = Math.max(8, Math.min(12, Math.floor(cell * 0.8)));
    var margin = 10;
    if (labels) {
      ctx.font = font + "px sans-serif";
      var w = 0;
      for (var i = 0; i < T; i++) w = Math.max(w, ctx.measureText(short(info.tokens[i])).width);
      margin = Math.min(110, Math.ceil(w) + 10);
    }
    var rightM = key === "A" ? (cell >= 12 ? 62 : 24) : 8;
    return { T: T, cell: cell, G: G, ml: margin, mt: margin, mr: rightM, labels: labels, font: font };
  }
  function drawPanel(p, info, hi) {
    var probe = p.base.getContext("2d");
    var g = geometry(info, p.key, probe), T = g.T, cell = g.cell;
    p.geo = g;
    var W = g.ml + g.G + g.mr, Hh = g.mt + g.G + 6;
    var ctx = sized(p.base, W, Hh);
    sized(p.over, W, Hh);
    p.over.setAttribute("data-grid", [g.ml, g.mt, g.cell, T].join(",")); // left, top, cell, T (for tests)
    ctx.clearRect(0, 0, W, Hh);
    ctx.imageSmoothingEnabled = cell < 1;
    ctx.imageSmoothingQuality = "high";
    ctx.drawImage(paintAll(info, hi)[p.key], g.ml, g.mt, g.G, g.G);
    var kinds = info.kinds, pad = info.pad, i, j;
    if (cell >= 6) { // hatch the hatched kinds (padding); thin grid lines
      ctx.fillStyle = hatchPattern(ctx);
      for (i = 0; i < T; i++) for (j = 0; j < T; j++) {
        var kd = kinds[i * T + j];
        if (kd && KIND[kd].hatch) ctx.fillRect(g.ml + j * cell, g.mt + i * cell, cell, cell);
      }
      ctx.strokeStyle = "rgba(255,255,255,0.8)"; ctx.lineWidth = 1;
      ctx.beginPath();
      for (i = 0; i <= T; i++) {
        ctx.moveTo(g.ml, g.mt + i * cell); ctx.lineTo(g.ml + g.G, g.mt + i * cell);
        ctx.moveTo(g.ml + i * cell, g.mt); ctx.lineTo(g.ml + i * cell, g.mt + g.G);
      }
      ctx.stroke();
    }
    var al = info.allowed;
    if (cell >= 34) { // numbers in the cells
      ctx.font = "10px sans-serif"; ctx.textAlign = "center"; ctx.textBaseline = "middle";
      for (i = 0; i < T; i++) {
        for (var k = info.start[i], jj = 0; jj < T; jj++) {
          var x = g.ml + (jj + 0.5) * cell, y = g.mt + (i + 0.5) * cell, ok = al[i * T + jj];
          var v = null, t;
          if (ok && p.key !== "M") { v = p.key === "S" ? hi.S[k] : hi.A[k]; if (p.key === "N") v *= hi.vnorm[jj]; }
          if (ok) k++;
          if (p.key === "M") t = ok ? "0" : "−∞";
          else if (!ok) continue;
          else t = fmt(v, p.key === "S" ? 2 : 3);
          var dark = p.key === "M" ? (ok || KIND[kinds[i * T + jj]].hatch)
                   : p.key === "S" ? Math.abs(v) > 0.6 * hi.smax
                   : v > 0.55 * (p.key === "A" ? hi.amax : hi.nmax);
          ctx.fillStyle = dark ? "#ffffff" : "#343a40";
          ctx.fillText(t, x, y);
        }
      }
    }
    if (g.labels) { // tokens: queries down the left, keys along the top
      ctx.font = g.font + "px sans-serif"; ctx.textBaseline = "middle";
      for (i = 0; i < T; i++) {
        ctx.fillStyle = pad[i] ? "#868e96" : "#212529";
        ctx.textAlign = "right";
        ctx.fillText(short(info.tokens[i]), g.ml - 4, g.mt + (i + 0.5) * cell);
        ctx.save();
        ctx.translate(g.ml + (i + 0.5) * cell, g.mt - 4);
        ctx.rotate(-Math.PI / 2);
        ctx.textAlign = "left";
        ctx.fillText(short(info.tokens[i]), 0, 0);
        ctx.restore();
      }
    }
    if (p.key === "A") { // the softmax axis: Σ_j A_ij for every row, next to the matrix
      var sx = g.ml + g.G + 4, sw = Math.min(14, g.mr - 6);
      for (i = 0; i < T; i++) {
        var r = hi.rowSum[i], tt = Math.round(Math.max(0, Math.min(1, r)) * 255);
        ctx.fillStyle = pad[i] ? KIND[1].muted : css(LUT.A[tt]);
        ctx.fillRect(sx, g.mt + i * cell, sw, Math.max(cell, 1));
        if (cell >= 12) {
          ctx.fillStyle = "#495057"; ctx.font = "10px sans-serif"; ctx.textAlign = "left"; ctx.textBaseline = "middle";
          ctx.fillText(fmt(r, 3), sx + sw + 3, g.mt + (i + 0.5) * cell);
        }
      }
      ctx.fillStyle = "#495057"; ctx.font = "10px sans-serif"; ctx.textAlign = "left"; ctx.textBaseline = "bottom";
      ctx.fillText("Σ_j", sx, g.mt - 2);
    }
    var ge = hi.clipped ? "≥ " : "", clip = hi.clipped ? " (99.5th percentile; beyond it clipped)" : "";
    var rangeText = { M: "green: may read · every other colour: blocked, by the reason in the legend",
      S: "blue ≤ " + fmt(-hi.smax, 2) + " … white 0 … red " + ge + fmt(hi.smax, 2) + clip,
      A: "white 0 … dark blue " + ge + fmt(hi.amax, 3) + clip + " · softmax runs along each row (keys j)",
      N: "white 0 … dark " + ge + fmt(hi.nmax, 3) + clip + " · ‖A_ij v_j‖ = A_ij ‖v_j‖" }[p.key];
    if (!hi.clipped) rangeText = rangeText.replace("blue ≤ ", "blue ");
    p.range.textContent = rangeText;
  }
  function drawOverlay(p, state) { // the query row, the cell and the search hits
    var g = p.geo, ctx = p.over.getContext("2d");
    ctx.clearRect(0, 0, g.ml + g.G + g.mr + 2, g.mt + g.G + 8);
    if (state.matches.length) { // search hits: a mark left of their rows
      ctx.fillStyle = "#e8590c";
      state.matches.forEach(function (i) { ctx.fillRect(Math.max(0, g.ml - 4), g.mt + i * g.cell, 3, Math.max(g.cell, 2)); });
    }
    if (state.row === null) return;
    var y = g.mt + state.row * g.cell, h = Math.max(g.cell, 2);
    ctx.strokeStyle = state.pinned ? "#c92a2a" : "#f08c00"; ctx.lineWidth = 2;
    ctx.strokeRect(g.ml - 1, y - 1, g.G + (p.key === "A" ? g.mr - 4 : 0) + 2, h + 2);
    if (state.col !== null && g.cell >= 4) {
      ctx.strokeStyle = "#d6336c";
      ctx.strokeRect(g.ml + state.col * g.cell, y, g.cell, g.cell);
    }
  }

  return { makePanels: makePanels, renderLegend: renderLegend, drawPanel: drawPanel, drawOverlay: drawOverlay };
}
