/* causalattn explorer: draws the mask, S, A and ‖A_ij v_j‖ of each sequence and head.
 *
 * The page builds its own DOM. Tokens are data: they reach the page only through
 * textContent, DOM properties and canvas fillText, never through HTML parsing.
 * Matrices arrive as base64 little-endian Float32 arrays of the readable entries,
 * row-major; cells are painted into one T×T image per panel and scaled onto a canvas,
 * so the cost does not grow with DOM elements. Positions shown are 1-based, as in the
 * chapter (h_1 … h_T).
 */
function causalattnExplorer(root, data) {
  "use strict";
  var doc = root.ownerDocument;
  var LITTLE = new Uint8Array(new Uint32Array([1]).buffer)[0] === 1;
  var SAMPLE = 20000; // entries sampled for the colour range of big matrices
  var MAX_LIST = 64; // keys listed in the side panel for one query (largest weights first)
  var PANELS = [
    { key: "M", title: "M: mask (0 = may read, −∞ = blocked)" },
    { key: "S", title: "S = Q Kᵀ / √d_k (scores)" },
    { key: "A", title: "A = softmax_last(S + M): each row sums to 1 (Σ strip)" },
    { key: "N", title: "‖A_ij v_j‖ (contribution norms)" },
  ];
  var COLORS = { allowed: "#2f9e44", causal: "#e9ecef", pad: "#6c757d",
                 vcausal: "#e4e7ea", vpad: "#9aa1a8", nan: "#e64980" };
  var RAMPS = {
    S: ["#2166ac", "#92c5de", "#f7f7f7", "#f4a582", "#b2182b"],
    A: ["#f7fbff", "#c6dbef", "#6baed6", "#2171b5", "#08306b"],
    N: ["#fff5eb", "#fdd0a2", "#fd8d3c", "#d94801", "#7f2704"],
  };

  // -- small helpers -----------------------------------------------------------------
  function el(tag, cls, text) {
    var e = doc.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined && text !== null) e.textContent = String(text);
    return e;
  }
  function rgb(hex) {
    return [parseInt(hex.slice(1, 3), 16), parseInt(hex.slice(3, 5), 16), parseInt(hex.slice(5, 7), 16)];
  }
  function pack(c) {
    return LITTLE ? ((255 << 24) | (c[2] << 16) | (c[1] << 8) | c[0]) >>> 0
                  : ((c[0] << 24) | (c[1] << 16) | (c[2] << 8) | 255) >>> 0;
  }
  function lut(stops) {
    var cs = stops.map(rgb), out = new Uint32Array(256);
    for (var k = 0; k < 256; k++) {
      var t = (k / 255) * (cs.length - 1), a = Math.min(Math.floor(t), cs.length - 2), f = t - a;
      out[k] = pack([0, 1, 2].map(function (c) { return Math.round(cs[a][c] + f * (cs[a + 1][c] - cs[a][c])); }));
    }
    return out;
  }
  function css(c) { // a packed pixel back to a CSS colour
    var b = LITTLE ? [c & 255, (c >>> 8) & 255, (c >>> 16) & 255] : [c >>> 24, (c >>> 16) & 255, (c >>> 8) & 255];
    return "rgb(" + b.join(",") + ")";
  }
  var LUT = { S: lut(RAMPS.S), A: lut(RAMPS.A), N: lut(RAMPS.N) };
  var PX = {};
  Object.keys(COLORS).forEach(function (k) { PX[k] = pack(rgb(COLORS[k])); });

  function bytes(b64) {
    var s = atob(b64), n = s.length, u = new Uint8Array(n);
    for (var i = 0; i < n; i++) u[i] = s.charCodeAt(i);
    return u;
  }
  function floats(b64, size) { // little-endian Float32 (size 4) or Float64 (size 8)
    var u = bytes(b64);
    if (!LITTLE) {
      for (var i = 0; i < u.length; i += size) {
        for (var a = i, b = i + size - 1; a < b; a++, b--) { var t = u[a]; u[a] = u[b]; u[b] = t; }
      }
    }
    return size === 4 ? new Float32Array(u.buffer, 0, u.length >> 2) : new Float64Array(u.buffer, 0, u.length >> 3);
  }
  function fmt(x, digits) {
    if (x === null || x === undefined) return "–";
    if (!isFinite(x)) return String(x);
    var d = digits === undefined ? 3 : digits, ax = Math.abs(x);
    if (x !== 0 && (ax < Math.pow(10, -d) || ax >= 1e5)) return x.toExponential(2);
    return x.toFixed(d);
  }
  function vec(arr, off, n) {
    var parts = [], shown = n <= 4 ? n : 3; // the side panel stays narrow; h_i shows more
    for (var c = 0; c < shown; c++) parts.push(fmt(arr[off + c], 2));
    return "[" + parts.join(", ") + (n > shown ? ", …" : "") + "]";
  }
  function short(tok) { return tok.length > 14 ? tok.slice(0, 13) + "…" : tok; }

  // -- decoding (lazy, cached) ---------------------------------------------------------
  function seqInfo(s) {
    var q = data.sequences[s];
    if (q._info) return q._info;
    var T = q.T, bits = bytes(q.allowed), allowed = new Uint8Array(T * T), n = T * T;
    for (var b = 0; b < bits.length; b++) { // bytes of 0 or 255 (most of a causal mask) go fast
      var v = bits[b], o = b << 3;
      if (v === 0) continue;
      if (v === 255 && o + 8 <= n) { allowed.fill(1, o, o + 8); continue; }
      for (var t = 0; t < 8 && o + t < n; t++) allowed[o + t] = (v >> (7 - t)) & 1;
    }
    var start = new Int32Array(T + 1), count = new Int32Array(T), k = 0;
    for (var i = 0; i < T; i++) {
      start[i] = k;
      for (var j = i * T, e = j + T; j < e; j++) k += allowed[j];
      count[i] = k - start[i];
    }
    start[T] = k;
    var pad = Uint8Array.from(q.pad), nPad = 0;
    for (var p = 0; p < T; p++) nPad += pad[p];
    q._info = { T: T, allowed: allowed, start: start, count: count, pad: pad, nPad: nPad, tokens: q.tokens };
    return q._info;
  }
  function headInfo(s, h) {
    var q = data.sequences[s], hd = q.heads[h];
    if (hd._info) return hd._info;
    var info = seqInfo(s), T = info.T, dv = hd.d_v;
    var V = floats(hd.V, 8), H = hd.H ? floats(hd.H, 8) : null, S, A;
    if (hd.form === "qk") { var r = recompute(info, floats(hd.Q, 8), floats(hd.K, 8), hd.d_k, q.scale); S = r.S; A = r.A; }
    else { S = floats(hd.S, 4); A = floats(hd.A, 4); }
    var vnorm = new Float64Array(T), rowSum = new Float64Array(T);
    for (var j = 0; j < T; j++) {
      var acc = 0;
      for (var c = 0; c < dv; c++) { var x = V[j * dv + c]; acc += x * x; }
      vnorm[j] = Math.sqrt(acc);
    }
    // Colour ranges: the maximum, or for big matrices the 99.5th percentile of a sample
    // (one sharp weight would otherwise wash out a 2048×2048 picture); larger values clip.
    var n = info.start[T], step = n > SAMPLE ? Math.ceil(n / SAMPLE) : 1;
    var ss = [], as = [], ns = [];
    for (var i = 0; i < T; i++) {
      var sum = 0;
      for (var k = info.start[i], jj = 0; k < info.start[i + 1]; k++) {
        while (!info.allowed[i * T + jj]) jj++;
        var av = A[k];
        if (k % step === 0) {
          var sv = Math.abs(S[k]), nv = av * vnorm[jj];
          if (isFinite(sv)) ss.push(sv);
          if (isFinite(av)) as.push(av);
          if (isFinite(nv)) ns.push(nv);
        }
        sum += av; jj++;
      }
      rowSum[i] = sum;
    }
    function top(xs) {
      if (!xs.length) return 1;
      xs.sort(function (a, b) { return a - b; });
      return xs[step === 1 ? xs.length - 1 : Math.floor(0.995 * (xs.length - 1))] || 1;
    }
    hd._info = { S: S, A: A, V: V, H: H, dv: dv, vnorm: vnorm, rowSum: rowSum,
                 smax: top(ss), amax: top(as), nmax: top(ns), clipped: step > 1 };
    return hd._info;
  }

  // S = Q Kᵀ·scale on the readable entries, then the row softmax over them (max subtracted),
  // as reference.softmax_last does; the page is given Q and K only when Python checked
  // that this reproduces the trace's S and A.
  function recompute(info, Q, K, dk, scale) {
    var T = info.T, al = info.allowed, S = new Float64Array(info.start[T]), A = new Float64Array(info.start[T]);
    for (var i = 0; i < T; i++) {
      var k0 = info.start[i], k1 = info.start[i + 1], k = k0, m = -Infinity, qo = i * dk;
      for (var j = 0, row = i * T; j < T; j++) {
        if (!al[row + j]) continue;
        var acc = 0, ko = j * dk;
        for (var c = 0; c < dk; c++) acc += Q[qo + c] * K[ko + c];
        acc *= scale; S[k++] = acc;
        if (acc > m) m = acc;
      }
      var sum = 0;
      for (k = k0; k < k1; k++) { var e = Math.exp(S[k] - m); A[k] = e; sum += e; }
      for (k = k0; k < k1; k++) A[k] /= sum;
    }
    return { S: S, A: A };
  }

  // -- painting: one T×T image per panel, all four in one pass, cached per head -------------
  function paintAll(info, hi) {
    if (hi.images) return hi.images;
    var T = info.T, al = info.allowed, pad = info.pad, vn = hi.vnorm, S = hi.S, A = hi.A;
    var out = {}, px = {}, imgs = {};
    ["M", "S", "A", "N"].forEach(function (key) {
      var cv = doc.createElement("canvas");
      cv.width = T; cv.height = T;
      out[key] = cv; imgs[key] = cv.getContext("2d").createImageData(T, T);
      px[key] = new Uint32Array(imgs[key].data.buffer);
    });
    var pM = px.M, pS = px.S, pA = px.A, pN = px.N, lS = LUT.S, lA = LUT.A, lN = LUT.N;
    var iS = 255 / (2 * hi.smax), iA = 255 / hi.amax, iN = 255 / hi.nmax, sLo = -hi.smax;
    var cM = PX.causal, dM = PX.pad, cV = PX.vcausal, dV = PX.vpad, ok = PX.allowed, nan = PX.nan;
    function idx(table, t) { return t !== t ? nan : t < 0 ? table[0] : t >= 255 ? table[255] : table[t | 0]; }
    for (var i = 0, k = 0; i < T; i++) {
      var pi = pad[i], row = i * T;
      for (var j = 0; j < T; j++) {
        var p = row + j;
        if (!al[p]) {
          if (pi || pad[j]) { pM[p] = dM; pS[p] = pA[p] = pN[p] = dV; } else { pM[p] = cM; pS[p] = pA[p] = pN[p] = cV; }
          continue;
        }
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

  // -- DOM skeleton ----------------------------------------------------------------------
  var fallback = root.querySelector(".ca-fallback");
  if (fallback) fallback.remove();
  var head = el("div", "ca-head");
  head.appendChild(el("span", "ca-title", data.title));
  var seqLabel = el("label", "ca-switch", "sentence "), seqSel = el("select");
  seqSel.setAttribute("data-role", "seq");
  seqLabel.appendChild(seqSel);
  var headLabel = el("label", "ca-switch", "head "), headSel = el("select");
  headSel.setAttribute("data-role", "head");
  headLabel.appendChild(headSel);
  var qLabel = el("label", "ca-switch", "query i "), qIn = el("input");
  qIn.type = "number"; qIn.min = "1"; qIn.setAttribute("data-role", "query");
  qLabel.appendChild(qIn);
  head.appendChild(seqLabel); head.appendChild(headLabel); head.appendChild(qLabel);
  var summary = el("div", "ca-summary"); summary.setAttribute("data-role", "summary");
  var tokBox = el("div", "ca-tokens"); tokBox.setAttribute("data-role", "tokens");
  var hint = el("div", "ca-hint",
    "Rows are queries i, columns are keys j. Hover a row to inspect it, click to pin it (arrow keys move).");
  var main = el("div", "ca-main");
  var panelBox = el("div", "ca-panels");
  var side = el("aside", "ca-side"); side.setAttribute("data-role", "side");
  main.appendChild(panelBox); main.appendChild(side);
  var legend = el("div", "ca-legend");
  [["allowed", "may read (M = 0)"], ["causal", "blocked: future / mask (M = −∞)"],
   ["pad", "blocked: padding (M = −∞, hatched)"]].forEach(function (p) {
    var sw = el("span", "ca-swatch ca-sw-" + p[0]);
    var item = el("span", "ca-legend-item"); item.appendChild(sw); item.appendChild(doc.createTextNode(p[1]));
    legend.appendChild(item);
  });
  [head, summary, tokBox, hint, legend, main].forEach(function (n) { root.appendChild(n); });
  root.tabIndex = 0;

  data.sequences.forEach(function (q, s) {
    var o = el("option", null, q.name); o.value = String(s); seqSel.appendChild(o);
  });
  if (data.sequences.length < 2) seqLabel.classList.add("ca-hidden");

  var panels = PANELS.map(function (p) {
    var fig = el("figure", "ca-panel");
    fig.setAttribute("data-panel", p.key);
    var cap = el("figcaption", null, p.title), range = el("div", "ca-range");
    var stack = el("div", "ca-stack"), base = el("canvas", "ca-base"), over = el("canvas", "ca-over");
    stack.appendChild(base); stack.appendChild(over);
    fig.appendChild(cap); fig.appendChild(stack); fig.appendChild(range);
    panelBox.appendChild(fig);
    return { key: p.key, base: base, over: over, range: range, geo: null };
  });

  var state = { s: 0, h: 0, row: null, col: null, pinned: false };

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
    var right = key === "A" ? (cell >= 12 ? 62 : 24) : 8;
    return { T: T, cell: cell, G: G, ml: margin, mt: margin, mr: right, labels: labels, font: font };
  }
  function sized(cv, w, h) {
    var dpr = window.devicePixelRatio || 1;
    cv.width = Math.round(w * dpr); cv.height = Math.round(h * dpr);
    cv.style.width = w + "px"; cv.style.height = h + "px";
    var ctx = cv.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    return ctx;
  }
  var hatch = null;
  function hatchPattern(ctx) {
    if (hatch) return hatch;
    var c = doc.createElement("canvas"); c.width = 6; c.height = 6;
    var x = c.getContext("2d");
    x.strokeStyle = "rgba(33,37,41,0.55)"; x.lineWidth = 1;
    x.beginPath(); x.moveTo(0, 6); x.lineTo(6, 0); x.moveTo(-1, 1); x.lineTo(1, -1); x.moveTo(5, 7); x.lineTo(7, 5); x.stroke();
    hatch = ctx.createPattern(c, "repeat");
    return hatch;
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
    var al = info.allowed, pad = info.pad, i, j;
    if (cell >= 6) { // hatch padding cells; thin grid lines
      ctx.fillStyle = hatchPattern(ctx);
      for (i = 0; i < T; i++) for (j = 0; j < T; j++) {
        if (!al[i * T + j] && (pad[i] || pad[j])) ctx.fillRect(g.ml + j * cell, g.mt + i * cell, cell, cell);
      }
      ctx.strokeStyle = "rgba(255,255,255,0.8)"; ctx.lineWidth = 1;
      ctx.beginPath();
      for (i = 0; i <= T; i++) {
        ctx.moveTo(g.ml, g.mt + i * cell); ctx.lineTo(g.ml + g.G, g.mt + i * cell);
        ctx.moveTo(g.ml + i * cell, g.mt); ctx.lineTo(g.ml + i * cell, g.mt + g.G);
      }
      ctx.stroke();
    }
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
          var dark = p.key === "M" ? ok : p.key === "S" ? Math.abs(v) > 0.6 * hi.smax
                   : v > 0.55 * (p.key === "A" ? hi.amax : hi.nmax);
          ctx.fillStyle = dark ? "#ffffff" : "#343a40";
          ctx.fillText(t, x, y);
        }
      }
    }
    if (g.labels) { // tokens: queries down the left, keys along the top
      ctx.font = g.font + "px sans-serif"; ctx.fillStyle = "#212529"; ctx.textBaseline = "middle";
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
        ctx.fillStyle = pad[i] ? COLORS.vpad : css(LUT.A[tt]);
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
    var rangeText = { M: "green: may read · light: causally blocked · dark hatched: padding",
      S: "blue ≤ " + fmt(-hi.smax, 2) + " … white 0 … red " + ge + fmt(hi.smax, 2) + clip,
      A: "white 0 … dark blue " + ge + fmt(hi.amax, 3) + clip + " · softmax runs along each row (keys j)",
      N: "white 0 … dark " + ge + fmt(hi.nmax, 3) + clip + " · ‖A_ij v_j‖ = A_ij ‖v_j‖" }[p.key];
    if (!hi.clipped) rangeText = rangeText.replace("blue ≤ ", "blue ");
    p.range.textContent = rangeText;
  }
  function drawOverlay(p) {
    var g = p.geo, ctx = p.over.getContext("2d");
    ctx.clearRect(0, 0, g.ml + g.G + g.mr + 2, g.mt + g.G + 8);
    if (state.row === null) return;
    var y = g.mt + state.row * g.cell, h = Math.max(g.cell, 2);
    ctx.strokeStyle = "#f08c00"; ctx.lineWidth = 2;
    ctx.strokeRect(g.ml - 1, y - 1, g.G + (p.key === "A" ? g.mr - 4 : 0) + 2, h + 2);
    if (state.col !== null && g.cell >= 4) {
      ctx.strokeStyle = "#d6336c";
      ctx.strokeRect(g.ml + state.col * g.cell, y, g.cell, g.cell);
    }
  }

  // -- side panel: the four quantities of one query row ------------------------------------
  function keysToList(info, hi, i) {
    var T = info.T, list = [], j, k;
    if (T <= 16) { for (j = 0; j < T; j++) list.push(j); return { keys: list, note: "" }; }
    for (j = 0, k = info.start[i]; j < T; j++) if (info.allowed[i * T + j]) list.push([j, hi.A[k++]]);
    var n = list.length;
    if (n > MAX_LIST) list = list.slice().sort(function (a, b) { return b[1] - a[1]; }).slice(0, MAX_LIST).sort(function (a, b) { return a[0] - b[0]; });
    return { keys: list.map(function (x) { return x[0]; }),
             note: n > MAX_LIST ? "showing the " + MAX_LIST + " of " + n + " readable keys with the largest weights" : "" };
  }
  function renderSide() {
    while (side.firstChild) side.removeChild(side.firstChild);
    var info = seqInfo(state.s), hi = headInfo(state.s, state.h), i = state.row, T = info.T;
    if (i === null) {
      side.appendChild(el("p", "ca-muted", "Hover or click a query row to see, for each key j: the score S_ij, the weight A_ij, the value v_j and the contribution A_ij v_j with its norm."));
      return;
    }
    var h3 = el("h3", null, "query i = " + (i + 1) + ": ");
    h3.appendChild(el("span", "ca-tok-inline", info.tokens[i]));
    h3.setAttribute("data-role", "query-title");
    side.appendChild(h3);
    var n = info.count[i], off = info.start[i];
    if (info.pad[i] && n === 0) {
      side.appendChild(el("p", "ca-pad-note", "Padding query: it has no readable key, so its weights are all exactly 0 and h_i = 0 (never NaN)."));
    }
    var sums = el("p", "ca-sum", "Σ_j A_ij = " + fmt(hi.rowSum[i], 4) + " over " + n + " readable key" + (n === 1 ? "" : "s") +
      " — softmax runs along this row, over the keys j (the last axis).");
    sums.setAttribute("data-role", "rowsum");
    side.appendChild(sums);
    if (hi.H) {
      var hv = [];
      for (var c0 = 0; c0 < hi.dv; c0++) hv.push(fmt(hi.H[i * hi.dv + c0]));
      side.appendChild(el("p", "ca-h", "h_i = Σ_j A_ij v_j = [" + hv.join(", ") + "]"));
    }
    if (state.col !== null) {
      var j0 = state.col, idx0 = i * T + j0, txt;
      if (info.allowed[idx0]) {
        var kk = off; for (var q = 0; q < j0; q++) kk += info.allowed[i * T + q];
        txt = "cell (i = " + (i + 1) + ", j = " + (j0 + 1) + "): S_ij = " + fmt(hi.S[kk]) + ", A_ij = " + fmt(hi.A[kk]) +
              ", ‖A_ij v_j‖ = " + fmt(hi.A[kk] * hi.vnorm[j0]);
      } else {
        txt = "cell (i = " + (i + 1) + ", j = " + (j0 + 1) + "): blocked (" + (info.pad[i] || info.pad[j0] ? "padding" : "causal") + "), weight exactly 0";
      }
      side.appendChild(el("p", "ca-cell", txt));
    }
    var pick = keysToList(info, hi, i);
    if (pick.note) side.appendChild(el("p", "ca-muted", pick.note));
    var table = el("table", "ca-table"), thead = el("thead"), tr = el("tr");
    ["j", "key", "S_ij", "A_ij", "v_j", "A_ij v_j", "‖A_ij v_j‖"].forEach(function (t) { tr.appendChild(el("th", null, t)); });
    thead.appendChild(tr); table.appendChild(thead);
    var tbody = el("tbody");
    var rank = new Int32Array(T), k2 = off;
    for (var jj = 0; jj < T; jj++) if (info.allowed[i * T + jj]) rank[jj] = k2++; else rank[jj] = -1;
    pick.keys.forEach(function (j) {
      var row = el("tr"), k = rank[j], ok = k >= 0;
      row.setAttribute("data-key", String(j + 1));
      if (j === state.col) row.className = "ca-cur";
      var cells;
      if (ok) {
        var a = hi.A[k], contrib = [];
        for (var c = 0; c < hi.dv; c++) contrib.push(a * hi.V[j * hi.dv + c]);
        cells = [["pos", j + 1], ["token", info.tokens[j]], ["score", fmt(hi.S[k])], ["weight", fmt(a)],
                 ["value", vec(hi.V, j * hi.dv, hi.dv)], ["contribution", vec(contrib, 0, hi.dv)],
                 ["norm", fmt(a * hi.vnorm[j])]];
      } else {
        row.classList.add(info.pad[i] || info.pad[j] ? "ca-blocked-pad" : "ca-blocked");
        var why = info.pad[i] || info.pad[j] ? "blocked: pad" : "blocked: future";
        cells = [["pos", j + 1], ["token", info.tokens[j]], ["score", why], ["weight", "0"],
                 ["value", vec(hi.V, j * hi.dv, hi.dv)], ["contribution", "0"], ["norm", "0"]];
      }
      cells.forEach(function (cv) { var td = el("td", null, cv[1]); td.setAttribute("data-col", cv[0]); row.appendChild(td); });
      tbody.appendChild(row);
    });
    table.appendChild(tbody);
    side.appendChild(table);
  }

  // -- state changes ---------------------------------------------------------------------
  var TOKEN_WINDOW = 240, tokLo = 0, tokHi = 0; // long sequences show the tokens around the query
  function renderTokens(center) {
    while (tokBox.firstChild) tokBox.removeChild(tokBox.firstChild);
    var info = seqInfo(state.s), frag = doc.createDocumentFragment();
    tokLo = 0; tokHi = info.T;
    if (info.T > TOKEN_WINDOW) {
      tokLo = Math.max(0, Math.min(info.T - TOKEN_WINDOW, (center || 0) - TOKEN_WINDOW / 2));
      tokHi = tokLo + TOKEN_WINDOW;
      if (tokLo > 0) frag.appendChild(el("span", "ca-muted", "… " + tokLo + " before"));
    }
    for (var i = tokLo; i < tokHi; i++) {
      var chip = el("span", info.pad[i] ? "ca-tok ca-tok-pad" : "ca-tok", info.tokens[i]);
      chip.title = "position " + (i + 1) + (info.pad[i] ? " (padding)" : "");
      chip.setAttribute("data-i", String(i));
      if (i === state.row) chip.classList.add("ca-tok-cur");
      frag.appendChild(chip);
    }
    if (tokHi < info.T) frag.appendChild(el("span", "ca-muted", "… " + (info.T - tokHi) + " after"));
    tokBox.appendChild(frag);
  }
  function renderAll() {
    var q = data.sequences[state.s], info = seqInfo(state.s), hi = headInfo(state.s, state.h);
    summary.textContent = "T = " + info.T + " positions (" + (info.T - info.nPad) + " tokens, " + info.nPad + " padding) · " +
      q.heads.length + " head" + (q.heads.length === 1 ? "" : "s") + " · d_v = " + hi.dv +
      (q.scale !== null ? " · scale = " + fmt(q.scale, 4) : "") + " · positions are 1-based";
    panels.forEach(function (p) { drawPanel(p, info, hi); drawOverlay(p); });
    qIn.max = String(info.T);
    renderSide();
  }
  function setHeads() {
    while (headSel.firstChild) headSel.removeChild(headSel.firstChild);
    data.sequences[state.s].heads.forEach(function (_, h) {
      var o = el("option", null, String(h + 1)); o.value = String(h); headSel.appendChild(o);
    });
    headLabel.classList.toggle("ca-hidden", data.sequences[state.s].heads.length < 2);
  }
  function setRow(i, j) {
    var T = seqInfo(state.s).T;
    if (i === null || i < 0 || i >= T) return;
    state.row = i; state.col = j === undefined ? null : j;
    qIn.value = String(i + 1);
    if (i < tokLo || i >= tokHi) renderTokens(i);
    var chips = tokBox.querySelectorAll(".ca-tok");
    for (var c = 0; c < chips.length; c++) chips[c].classList.toggle("ca-tok-cur", Number(chips[c].getAttribute("data-i")) === i);
    panels.forEach(drawOverlay);
    renderSide();
  }
  function cellAt(p, ev) {
    var g = p.geo, r = p.over.getBoundingClientRect();
    var x = ev.clientX - r.left - g.ml, y = ev.clientY - r.top - g.mt;
    if (x < 0 || y < 0 || y >= g.G) return null;
    var i = Math.floor(y / g.cell), j = Math.floor(x / g.cell);
    return [Math.min(i, g.T - 1), x < g.G ? Math.min(j, g.T - 1) : null];
  }
  panels.forEach(function (p) {
    p.over.addEventListener("mousemove", function (ev) {
      if (state.pinned) return;
      var c = cellAt(p, ev); if (c) setRow(c[0], c[1]);
    });
    p.over.addEventListener("click", function (ev) {
      var c = cellAt(p, ev); if (!c) return;
      state.pinned = !(state.pinned && state.row === c[0]);
      setRow(c[0], c[1]);
    });
  });
  tokBox.addEventListener("click", function (ev) {
    var t = ev.target;
    if (t && t.getAttribute && t.getAttribute("data-i") !== null) { state.pinned = true; setRow(Number(t.getAttribute("data-i"))); }
  });
  qIn.addEventListener("change", function () { state.pinned = true; setRow(Number(qIn.value) - 1); });
  root.addEventListener("keydown", function (ev) {
    if (ev.target === qIn || state.row === null) return;
    if (ev.key === "ArrowDown" || ev.key === "ArrowUp") {
      ev.preventDefault(); state.pinned = true; setRow(state.row + (ev.key === "ArrowDown" ? 1 : -1));
    }
  });
  seqSel.addEventListener("change", function () {
    state.s = Number(seqSel.value); state.h = 0; state.row = null; state.col = null; state.pinned = false;
    setHeads(); renderTokens(); renderAll();
  });
  headSel.addEventListener("change", function () { state.h = Number(headSel.value); renderAll(); });

  setHeads(); renderTokens(); renderAll();
  root.setAttribute("data-ready", "1");
  root.setAttribute("data-load-ms", String(Math.round(performance.now())));
}
