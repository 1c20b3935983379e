/* causalattn explorer: draws the mask, S, A and ‖A_ij v_j‖ of each sequence, layer and head.
 *
 * The page builds its own DOM. Tokens are data: they reach the page only through
 * textContent, DOM properties and canvas fillText, never through HTML parsing.
 * `data` is the index (names, lengths, the kinds of blocked cells, notes, questions); the
 * paged JSON blocks (script.ca-block, data-k = their number) are parsed only when a sequence
 * or layer is opened. Only the first view's blocks precede this script: the rest may still
 * be arriving while it draws, so whatever opens another block waits for the parse to end.
 * Matrices arrive as base64 little-endian floats; cells are painted into one T×T image per
 * panel and scaled onto a canvas, so the cost does not grow with DOM elements. Positions
 * shown are 1-based, as in the chapter (h_1 … h_T).
 */
function causalattnExplorer(root, data) {
  "use strict";
  var doc = root.ownerDocument, T0 = performance.now();
  root.setAttribute("data-start-ms", String(Math.round(T0)));
  var LITTLE = new Uint8Array(new Uint32Array([1]).buffer)[0] === 1;
  var SAMPLE = 20000; // entries sampled for the colour range of big matrices
  var MAX_LIST = 64; // keys listed in the side panel for one query (largest weights first)
  var PANELS = [
    { key: "M", title: "M: mask (0 = may read, −∞ = blocked)" },
    { key: "S", title: "S = Q Kᵀ / √d_k (scores)" },
    { key: "A", title: "A = softmax_last(S + M): each row sums to 1 (Σ strip)" },
    { key: "N", title: "‖A_ij v_j‖ (contribution norms)" },
  ];
  var RAMPS = {
    S: ["#2166ac", "#92c5de", "#f7f7f7", "#f4a582", "#b2182b"],
    A: ["#f7fbff", "#c6dbef", "#6baed6", "#2171b5", "#08306b"],
    N: ["#fff5eb", "#fdd0a2", "#fd8d3c", "#d94801", "#7f2704"],
  };
  var KIND = {}; // code -> {name, label, color, muted, hatch}
  data.kinds.forEach(function (k) { KIND[k.code] = k; });

  // -- small helpers -----------------------------------------------------------------
  function el(tag, cls, text) {
    var e = doc.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined && text !== null) e.textContent = String(text);
    return e;
  }
  function role(e, r) { e.setAttribute("data-role", r); return e; }
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
  var KPX = new Uint32Array(256), KMUTED = new Uint32Array(256), NAN_PX = pack(rgb("#e64980"));
  data.kinds.forEach(function (k) { KPX[k.code] = pack(rgb(k.color)); KMUTED[k.code] = pack(rgb(k.muted)); });

  function bytes(b64) {
    var s = atob(b64), n = s.length, u = new Uint8Array(n);
    for (var i = 0; i < n; i++) u[i] = s.charCodeAt(i);
    return u;
  }
  var HALF = null;
  function halfTable() { // float16 bit pattern -> value
    if (HALF) return HALF;
    HALF = new Float32Array(65536);
    for (var h = 0; h < 65536; h++) {
      var sg = h & 0x8000 ? -1 : 1, e = (h >> 10) & 31, m = h & 1023;
      HALF[h] = e === 0 ? sg * m * Math.pow(2, -24) : e === 31 ? (m ? NaN : sg * Infinity)
              : sg * (1 + m / 1024) * Math.pow(2, e - 15);
    }
    return HALF;
  }
  var SIZE = { f8: 8, f4: 4, f2: 2, u4: 4, u2: 2 };
  function floats(b64, prec) { // little-endian float64 / float32 / float16, uint32 / uint16
    var u = bytes(b64), size = SIZE[prec];
    if (!LITTLE) {
      for (var i = 0; i < u.length; i += size) {
        for (var a = i, b = i + size - 1; a < b; a++, b--) { var t = u[a]; u[a] = u[b]; u[b] = t; }
      }
    }
    if (prec === "f8") return new Float64Array(u.buffer, 0, u.length >> 3);
    if (prec === "f4") return new Float32Array(u.buffer, 0, u.length >> 2);
    if (prec === "u4") return new Uint32Array(u.buffer, 0, u.length >> 2);
    if (prec === "u2") return new Uint16Array(u.buffer, 0, u.length >> 1);
    var h = new Uint16Array(u.buffer, 0, u.length >> 1), tab = halfTable(), out = new Float32Array(h.length);
    for (var k = 0; k < h.length; k++) out[k] = tab[h[k]];
    return out;
  }
  function fmt(x, digits) {
    if (x === null || x === undefined) return "–";
    if (!isFinite(x)) return String(x);
    var d = digits === undefined ? 3 : digits, ax = Math.abs(x);
    if (x !== 0 && (ax < Math.pow(10, -d) || ax >= 1e5)) return x.toExponential(2);
    return x.toFixed(d);
  }
  function vec(arr, off, n, total) {
    var parts = [], shown = n <= 4 ? n : 3; // the side panel stays narrow; h_i shows more
    for (var c = 0; c < shown; c++) parts.push(fmt(arr[off + c], 2));
    return "[" + parts.join(", ") + ((total || n) > shown ? ", …" : "") + "]";
  }
  function short(tok) { return tok.length > 14 ? tok.slice(0, 13) + "…" : tok; }

  // -- paged data (parsed once, when first opened) -------------------------------------------
  var parsed = {};
  function block(k) {
    if (!(k in parsed)) {
      var b = root.querySelector('script.ca-block[data-k="' + k + '"]');
      if (!b) throw new Error("causalattn explorer: data block " + k + " is missing");
      parsed[k] = JSON.parse(b.textContent);
    }
    return parsed[k];
  }
  function whenParsed(fn) { // an event handler that may open blocks after the first view's
    return function (ev) {
      if (doc.readyState === "loading") doc.addEventListener("DOMContentLoaded", function () { fn(ev); });
      else fn(ev);
    };
  }
  function seqMeta(s) { return block(data.sequences[s].block); }

  // -- decoding (lazy, cached) ---------------------------------------------------------
  var layerCache = {};
  function layerInfo(s, l) { // the mask of one layer of one sequence: kinds, readable, rows
    var key = s + "." + l;
    if (layerCache[key]) return layerCache[key];
    var meta = seqMeta(s), lay = meta.layers[l], T = data.sequences[s].T, n = T * T;
    var codes = bytes(lay.kinds.codes), runs = floats(lay.kinds.runs, "u4");
    var kinds = new Uint8Array(n), allowed = new Uint8Array(n), present = {};
    for (var r = 0, o = 0; r < codes.length; r++) {
      kinds.fill(codes[r], o, o + runs[r]);
      if (codes[r] === 0) allowed.fill(1, o, o + runs[r]);
      present[codes[r]] = true; o += runs[r];
    }
    var start = new Int32Array(T + 1), count = new Int32Array(T), k = 0;
    for (var i = 0; i < T; i++) {
      start[i] = k;
      for (var j = i * T, e = j + T; j < e; j++) k += allowed[j];
      count[i] = k - start[i];
    }
    start[T] = k;
    var pad = Uint8Array.from(meta.pad), nPad = 0;
    for (var p = 0; p < T; p++) nPad += pad[p];
    layerCache[key] = { T: T, kinds: kinds, allowed: allowed, present: present, start: start,
                        count: count, pad: pad, nPad: nPad, tokens: meta.tokens, layer: lay,
                        gen: T - (meta.gen || 0) }; // positions from gen on were generated
    return layerCache[key];
  }
  var headCache = {};
  function headInfo(s, l, h) {
    var key = s + "." + l + "." + h;
    if (headCache[key]) return headCache[key];
    var info = layerInfo(s, l), lb = block(info.layer.block), hd = lb.heads[h], T = info.T;
    var dv = hd.d_v, vs = hd.v_shown, V, S, A, r;
    if (hd.form === "x") { // Q, K, V = X W from the shared weights, head h's columns
      var w = xset(lb.xset), rows = floats(lb.rows, lb.rprec), dk = hd.d_k;
      V = project(w, rows, w.Wv, w.cols[2], h * dv, dv);
      r = recompute(info, project(w, rows, w.Wq, w.cols[0], h * dk, dk),
                    project(w, rows, w.Wk, w.cols[1], h * dk, dk), dk, lb.scale, mod(lb, h));
      S = r.S; A = r.A;
    } else if (hd.form === "qk") {
      V = floats(hd.V, hd.vprec);
      r = recompute(info, floats(hd.Q, hd.qprec), floats(hd.K, hd.qprec), hd.d_k, lb.scale, mod(lb, h));
      S = r.S; A = r.A;
    } else { V = floats(hd.V, hd.vprec); S = floats(hd.S, hd.sprec); A = floats(hd.A, hd.aprec); }
    var vnorm;
    if (hd.vnorm) vnorm = floats(hd.vnorm, "f4");
    else {
      vnorm = new Float64Array(T);
      for (var j = 0; j < T; j++) {
        var acc = 0;
        for (var c = 0; c < vs; c++) { var x = V[j * vs + c]; acc += x * x; }
        vnorm[j] = Math.sqrt(acc);
      }
    }
    // Colour ranges: the maximum, or for big matrices the 99.5th percentile of a sample
    // (one sharp weight would otherwise wash out a 2048×2048 picture); larger values clip.
    var rowSum = new Float64Array(T), n = info.start[T], step = n > SAMPLE ? Math.ceil(n / SAMPLE) : 1;
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
    headCache[key] = { S: S, A: A, V: V, H: hd.H ? floats(hd.H, hd.hprec) : null, dv: dv, vs: vs,
                       vnorm: vnorm, rowSum: rowSum, smax: top(ss), amax: top(as), nmax: top(ns),
                       clipped: step > 1 };
    return headCache[key];
  }
  var xsets = {};
  function xset(k) { // shared weights and distinct rows of X (decoded once)
    if (xsets[k]) return xsets[k];
    var b = block(data.xsets[k]);
    xsets[k] = { X: floats(b.X, "f8"), Wq: floats(b.W_q, "f8"), Wk: floats(b.W_k, "f8"),
                 Wv: floats(b.W_v, "f8"), dm: b.d_model, cols: b.cols };
    return xsets[k];
  }
  function project(w, rows, W, cols, c0, d) { // (X W)[:, c0:c0+d] for the rows of one sequence
    var T = rows.length, dm = w.dm, out = new Float64Array(T * d);
    for (var t = 0; t < T; t++) {
      var xo = rows[t] * dm;
      for (var c = 0; c < d; c++) {
        var acc = 0;
        for (var m = 0; m < dm; m++) acc += w.X[xo + m] * W[m * cols + c0 + c];
        out[t * d + c] = acc;
      }
    }
    return out;
  }
  function hRow(info, hi, i) { // h_i = Σ_j A_ij v_j over the components the page holds
    if (hi.H) return { v: hi.H.subarray(i * hi.dv, (i + 1) * hi.dv), n: hi.dv };
    var T = info.T, out = new Float64Array(hi.vs);
    for (var j = 0, k = info.start[i]; j < T; j++) {
      if (!info.allowed[i * T + j]) continue;
      var a = hi.A[k++];
      for (var c = 0; c < hi.vs; c++) out[c] += a * hi.V[j * hi.vs + c];
    }
    return { v: out, n: hi.vs };
  }

  function mod(lb, h) { // head h's score modifiers: softcap, ALiBi slope, sink logit
    var m = lb.mods || {};
    return { cap: m.softcap || null, slope: m.slopes ? m.slopes[h] : null, sink: m.sinks ? m.sinks[h] : null };
  }
  // S = Q Kᵀ·scale on the readable entries; Z = softcap, then ALiBi, of S; then the row
  // softmax over Z (max subtracted; a sink logit joins the denominator), as
  // reference.softmax_last does. The page is given Q and K only when Python checked that
  // this reproduces the trace's S and A (and says how closely).
  function recompute(info, Q, K, dk, scale, md) {
    var T = info.T, al = info.allowed, S = new Float64Array(info.start[T]), A = new Float64Array(info.start[T]);
    for (var i = 0; i < T; i++) {
      var k0 = info.start[i], k1 = info.start[i + 1], k = k0, m = -Infinity, qo = i * dk;
      for (var j = 0, row = i * T; j < T; j++) {
        if (!al[row + j]) continue;
        var acc = 0, ko = j * dk;
        for (var c = 0; c < dk; c++) acc += Q[qo + c] * K[ko + c];
        acc *= scale; S[k] = acc;
        var z = acc;
        if (md.cap) z = md.cap * Math.tanh(z / md.cap);
        if (md.slope !== null) z -= md.slope * Math.abs(i - j);
        A[k++] = z;
        if (z > m) m = z;
      }
      if (k1 === k0) continue;
      if (md.sink !== null) m = Math.max(m, md.sink);
      var sum = md.sink !== null ? Math.exp(Math.min(md.sink - m, 0)) : 0;
      for (k = k0; k < k1; k++) { var e = Math.exp(A[k] - m); A[k] = e; sum += e; }
      for (k = k0; k < k1; k++) A[k] /= sum;
    }
    return { S: S, A: A };
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

  // -- DOM skeleton ----------------------------------------------------------------------
  var fallback = root.querySelector(".ca-fallback");
  if (fallback) fallback.remove();
  var uid = root.id || "ca";
  var head = el("div", "ca-head");
  head.appendChild(el("span", "ca-title", data.title));
  function labelled(text, ctl, r) {
    var lab = el("label", "ca-switch", text);
    role(ctl, r); lab.appendChild(ctl); head.appendChild(lab);
    return lab;
  }
  var seqSel = el("select"), seqLabel = labelled("sentence ", seqSel, "seq");
  var layerSel = el("select"), layerLabel = labelled("layer ", layerSel, "layer");
  var headSel = el("select"), headLabel = labelled("head ", headSel, "head");
  var qIn = el("input"); qIn.type = "number"; qIn.min = "1";
  labelled("query i ", qIn, "query");
  var pinBox = el("input"); pinBox.type = "checkbox";
  labelled("pin ", pinBox, "pin");
  var search = el("input"); search.type = "search"; search.placeholder = "token…"; search.size = 10;
  labelled("search ", search, "search");
  var searchNext = role(el("button", "ca-btn", "next"), "search-next");
  searchNext.type = "button";
  head.appendChild(searchNext);
  var searchCount = role(el("span", "ca-muted", ""), "search-count");
  head.appendChild(searchCount);
  var notes = el("div", "ca-notes");
  (data.notes || []).forEach(function (t) { notes.appendChild(role(el("p", "ca-note", t), "note")); });
  var summary = role(el("div", "ca-summary"), "summary");
  var model = role(el("section", "ca-model"), "model");
  var tokBox = role(el("div", "ca-tokens"), "tokens");
  var hint = el("div", "ca-hint",
    "Rows are queries i, columns are keys j. Hover a row to inspect it, click to pin it (arrow keys move).");
  var main = el("div", "ca-main");
  var panelBox = el("div", "ca-panels");
  var right = el("div", "ca-right");
  var side = role(el("aside", "ca-side"), "side");
  main.appendChild(panelBox); main.appendChild(right);
  var legend = role(el("div", "ca-legend"), "legend");
  [head, notes, summary, model, tokBox, hint, legend, main].forEach(function (n) { root.appendChild(n); });
  root.tabIndex = 0;

  var frag = doc.createDocumentFragment();
  data.sequences.forEach(function (q, s) {
    var o = el("option", null, q.name); o.value = String(s); frag.appendChild(o);
  });
  seqSel.appendChild(frag);
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

  var state = { s: 0, l: 0, h: 0, row: null, col: null, pinned: false, matches: [], m: -1 };

  // -- legend: the kinds of cell present in this layer's mask ------------------------------
  function renderLegend(info) {
    while (legend.firstChild) legend.removeChild(legend.firstChild);
    data.kinds.forEach(function (k) {
      if (!info.present[k.code]) return;
      var sw = el("span", "ca-swatch" + (k.hatch ? " ca-sw-hatch" : ""));
      sw.style.backgroundColor = k.color;
      var item = el("span", "ca-legend-item"); item.setAttribute("data-kind", k.name);
      item.appendChild(sw); item.appendChild(doc.createTextNode(k.label));
      legend.appendChild(item);
    });
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
  function drawOverlay(p) {
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
  function why(info, i, j) { return KIND[info.kinds[i * info.T + j]]; }
  function renderSide() {
    while (side.firstChild) side.removeChild(side.firstChild);
    var info = layerInfo(state.s, state.l), hi = headInfo(state.s, state.l, state.h), i = state.row, T = info.T;
    if (i === null) {
      side.appendChild(el("p", "ca-muted", "Hover or click a query row to see, for each key j: the score S_ij, the weight A_ij, the value v_j and the contribution A_ij v_j with its norm."));
      return;
    }
    var h3 = role(el("h3", null, "query i = " + (i + 1) + ": "), "query-title");
    h3.appendChild(el("span", "ca-tok-inline", info.tokens[i]));
    if (state.pinned) h3.appendChild(el("span", "ca-pinned", " (pinned)"));
    side.appendChild(h3);
    var n = info.count[i], off = info.start[i];
    if (info.pad[i] && n === 0) {
      side.appendChild(el("p", "ca-pad-note", "Padding query: it has no readable key, so its weights are all exactly 0 and h_i = 0 (never NaN)."));
    }
    side.appendChild(role(el("p", "ca-sum", "Σ_j A_ij = " + fmt(hi.rowSum[i], 4) + " over " + n + " readable key" + (n === 1 ? "" : "s") +
      " — softmax runs along this row, over the keys j (the last axis)."), "rowsum"));
    var hv = hRow(info, hi, i), parts = [];
    for (var c0 = 0; c0 < hv.n; c0++) parts.push(fmt(hv.v[c0]));
    side.appendChild(el("p", "ca-h", "h_i = Σ_j A_ij v_j = [" + parts.join(", ") + (hv.n < hi.dv ? ", … (" + hi.dv + " in all)" : "") + "]"));
    if (state.col !== null) {
      var j0 = state.col, txt;
      if (info.allowed[i * T + j0]) {
        var kk = off; for (var q = 0; q < j0; q++) kk += info.allowed[i * T + q];
        txt = "cell (i = " + (i + 1) + ", j = " + (j0 + 1) + "): S_ij = " + fmt(hi.S[kk]) + ", A_ij = " + fmt(hi.A[kk]) +
              ", ‖A_ij v_j‖ = " + fmt(hi.A[kk] * hi.vnorm[j0]);
      } else {
        txt = "cell (i = " + (i + 1) + ", j = " + (j0 + 1) + "): " + why(info, i, j0).label + ", weight exactly 0";
      }
      side.appendChild(role(el("p", "ca-cell", txt), "cell"));
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
        for (var c = 0; c < hi.vs; c++) contrib.push(a * hi.V[j * hi.vs + c]);
        cells = [["pos", j + 1], ["token", info.tokens[j]], ["score", fmt(hi.S[k])], ["weight", fmt(a)],
                 ["value", vec(hi.V, j * hi.vs, hi.vs, hi.dv)], ["contribution", vec(contrib, 0, hi.vs, hi.dv)],
                 ["norm", fmt(a * hi.vnorm[j])]];
      } else {
        var kd = why(info, i, j);
        row.classList.add(kd.hatch ? "ca-blocked-pad" : "ca-blocked");
        row.setAttribute("data-kind", kd.name);
        cells = [["pos", j + 1], ["token", info.tokens[j]], ["score", "blocked: " + kd.name], ["weight", "0"],
                 ["value", vec(hi.V, j * hi.vs, hi.vs, hi.dv)], ["contribution", "0"], ["norm", "0"]];
      }
      cells.forEach(function (cv) { var td = el("td", null, cv[1]); td.setAttribute("data-col", cv[0]); row.appendChild(td); });
      tbody.appendChild(row);
    });
    table.appendChild(tbody);
    side.appendChild(table);
  }

  // -- model view: layers × heads thumbnails, a summary per head ------------------------------
  var thumbs = [];
  function renderModel() {
    while (model.firstChild) model.removeChild(model.firstChild);
    thumbs = [];
    var meta = seqMeta(state.s), L = meta.layers.length;
    if (L < 2) { model.classList.add("ca-hidden"); return; }
    model.classList.remove("ca-hidden");
    model.appendChild(el("h3", null, "model view: " + L + " layers × heads (A, each row scaled to its largest weight; click one to open it)"));
    var grid = el("div", "ca-grid");
    meta.layers.forEach(function (lay, l) {
      var row = el("div", "ca-grid-row");
      row.appendChild(el("span", "ca-grid-label", lay.name));
      var n = lay.thumb.n, px = bytes(lay.thumb.px);
      for (var h = 0; h < lay.n_heads; h++) {
        var btn = el("button", "ca-thumb");
        btn.type = "button";
        btn.setAttribute("data-layer", String(l)); btn.setAttribute("data-head", String(h));
        var sm = lay.summary, roleName = sm.role ? sm.role[h] : "";
        btn.title = lay.name + ", head " + (h + 1) + (roleName ? " (" + roleName + " head)" : "") +
                    ": previous token " + fmt(sm.previous[h], 2) + ", induction " + fmt(sm.induction[h], 2) +
                    ", first token " + fmt(sm.first[h], 2) + ", mean distance " + fmt(sm.distance[h], 1) +
                    ", entropy " + fmt(sm.entropy[h], 2) + " nats";
        btn.setAttribute("aria-label", btn.title);
        btn.setAttribute("data-role-name", roleName);
        var cv = el("canvas"); cv.width = n; cv.height = n;
        var ctx = cv.getContext("2d"), img = ctx.createImageData(n, n), u = new Uint32Array(img.data.buffer);
        for (var p = 0, o = h * n * n; p < n * n; p++) u[p] = LUT.A[px[o + p]];
        ctx.putImageData(img, 0, 0);
        btn.appendChild(cv);
        btn.appendChild(el("span", "ca-thumb-role", roleName || "·"));
        row.appendChild(btn); thumbs.push(btn);
      }
      grid.appendChild(row);
    });
    grid.addEventListener("click", whenParsed(function (ev) {
      var b = ev.target.closest ? ev.target.closest("button.ca-thumb") : null;
      if (!b) return;
      state.l = Number(b.getAttribute("data-layer")); state.h = Number(b.getAttribute("data-head"));
      layerSel.value = String(state.l); setHeads(); headSel.value = String(state.h);
      renderAll(); panelBox.scrollIntoView({ block: "nearest" });
    }));
    model.appendChild(grid);
    model.appendChild(role(el("div", "ca-headsum"), "head-summary"));
  }
  function renderHeadSummary() {
    var box = model.querySelector("[data-role=head-summary]");
    thumbs.forEach(function (b) {
      b.classList.toggle("ca-thumb-cur", Number(b.getAttribute("data-layer")) === state.l && Number(b.getAttribute("data-head")) === state.h);
    });
    if (!box) return;
    while (box.firstChild) box.removeChild(box.firstChild);
    var lay = seqMeta(state.s).layers[state.l], sm = lay.summary;
    box.appendChild(el("p", "ca-muted", lay.name + ": per head, over the query rows it is defined on — weight on the previous token, " +
      "induction (weight on the token after the earlier copy of the query's token; – when no token repeats), weight on the first token, " +
      "mean distance i − j read, entropy of A_i· (nats); the role is the largest of the first three when it is at least 0.5."));
    var table = el("table", "ca-table"), tr = el("tr");
    ["head", "role", "previous token", "induction", "first token", "mean distance", "entropy"].forEach(function (t) { tr.appendChild(el("th", null, t)); });
    table.appendChild(tr);
    for (var h = 0; h < lay.n_heads; h++) {
      var r = el("tr");
      r.setAttribute("data-head", String(h));
      if (h === state.h) r.className = "ca-cur";
      [String(h + 1), (sm.role && sm.role[h]) || "–", fmt(sm.previous[h], 3), fmt(sm.induction[h], 3), fmt(sm.first[h], 3),
       fmt(sm.distance[h], 2), fmt(sm.entropy[h], 3)].forEach(function (t, c) {
        var td = el("td", null, t);
        td.setAttribute("data-col", ["head", "role", "previous", "induction", "first", "distance", "entropy"][c]);
        r.appendChild(td);
      });
      table.appendChild(r);
    }
    table.addEventListener("click", function (ev) {
      var r = ev.target.closest ? ev.target.closest("tr[data-head]") : null;
      if (!r) return;
      state.h = Number(r.getAttribute("data-head")); headSel.value = String(state.h); renderAll();
    });
    box.appendChild(table);
  }

  // -- state changes ---------------------------------------------------------------------
  var TOKEN_WINDOW = 240, tokLo = 0, tokHi = 0; // long sequences show the tokens around the query
  function renderTokens(center) {
    while (tokBox.firstChild) tokBox.removeChild(tokBox.firstChild);
    var info = layerInfo(state.s, state.l), frag = doc.createDocumentFragment(), hit = {};
    state.matches.forEach(function (i) { hit[i] = true; });
    tokLo = 0; tokHi = info.T;
    if (info.T > TOKEN_WINDOW) {
      tokLo = Math.max(0, Math.min(info.T - TOKEN_WINDOW, (center || 0) - TOKEN_WINDOW / 2));
      tokHi = tokLo + TOKEN_WINDOW;
      if (tokLo > 0) frag.appendChild(el("span", "ca-muted", "… " + tokLo + " before"));
    }
    for (var i = tokLo; i < tokHi; i++) {
      var chip = el("span", info.pad[i] ? "ca-tok ca-tok-pad" : i >= info.gen ? "ca-tok ca-tok-gen" : "ca-tok", info.tokens[i]);
      chip.title = "position " + (i + 1) + (info.pad[i] ? " (padding)" : i >= info.gen ? " (generated)" : "");
      chip.setAttribute("data-i", String(i));
      if (i === state.row) chip.classList.add("ca-tok-cur");
      if (hit[i]) chip.classList.add("ca-tok-match");
      frag.appendChild(chip);
    }
    if (tokHi < info.T) frag.appendChild(el("span", "ca-muted", "… " + (info.T - tokHi) + " after"));
    tokBox.appendChild(frag);
  }
  function renderAll() {
    var q = data.sequences[state.s], info = layerInfo(state.s, state.l), hi = headInfo(state.s, state.l, state.h);
    var lay = info.layer, scale = block(lay.block).scale;
    summary.textContent = "T = " + info.T + " positions (" + (info.T - info.nPad) + " tokens, " + info.nPad + " padding) · " +
      (info.gen < info.T ? "the last " + (info.T - info.gen) + " generated · " : "") +
      (q.n_layers > 1 ? lay.name + " of " + q.n_layers + " · " : "") +
      lay.n_heads + " head" + (lay.n_heads === 1 ? "" : "s") + " · d_v = " + hi.dv +
      (scale !== null ? " · scale = " + fmt(scale, 4) : "") + " · positions are 1-based";
    renderLegend(info);
    panels.forEach(function (p) { drawPanel(p, info, hi); drawOverlay(p); });
    qIn.max = String(info.T);
    renderHeadSummary();
    renderSide();
  }
  function setLayers() {
    while (layerSel.firstChild) layerSel.removeChild(layerSel.firstChild);
    seqMeta(state.s).layers.forEach(function (lay, l) {
      var o = el("option", null, String(l + 1)); o.value = String(l); layerSel.appendChild(o);
    });
    layerLabel.classList.toggle("ca-hidden", seqMeta(state.s).layers.length < 2);
  }
  function setHeads() {
    while (headSel.firstChild) headSel.removeChild(headSel.firstChild);
    var n = seqMeta(state.s).layers[state.l].n_heads;
    for (var h = 0; h < n; h++) { var o = el("option", null, String(h + 1)); o.value = String(h); headSel.appendChild(o); }
    if (state.h >= n) state.h = 0;
    headSel.value = String(state.h);
    headLabel.classList.toggle("ca-hidden", n < 2);
  }
  function setRow(i, j) {
    var T = layerInfo(state.s, state.l).T;
    if (i === null || i < 0 || i >= T || i !== i) return;
    state.row = i; state.col = j === undefined ? null : j;
    qIn.value = String(i + 1);
    pinBox.checked = state.pinned;
    if (i < tokLo || i >= tokHi) renderTokens(i);
    var chips = tokBox.querySelectorAll(".ca-tok");
    for (var c = 0; c < chips.length; c++) chips[c].classList.toggle("ca-tok-cur", Number(chips[c].getAttribute("data-i")) === i);
    panels.forEach(drawOverlay);
    renderSide();
  }
  function runSearch() {
    var needle = search.value.trim().toLowerCase(), toks = layerInfo(state.s, state.l).tokens;
    state.matches = []; state.m = -1;
    if (needle) for (var i = 0; i < toks.length; i++) if (toks[i].toLowerCase().indexOf(needle) >= 0) state.matches.push(i);
    searchCount.textContent = needle ? state.matches.length + " match" + (state.matches.length === 1 ? "" : "es") : "";
    renderTokens(state.row === null ? 0 : state.row);
    panels.forEach(drawOverlay);
  }
  function nextMatch() {
    if (!state.matches.length) return;
    state.m = (state.m + 1) % state.matches.length;
    state.pinned = true;
    searchCount.textContent = (state.m + 1) + " of " + state.matches.length;
    setRow(state.matches[state.m]);
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
  pinBox.addEventListener("change", function () {
    state.pinned = pinBox.checked && state.row !== null; pinBox.checked = state.pinned;
    panels.forEach(drawOverlay); renderSide();
  });
  search.addEventListener("input", runSearch);
  search.addEventListener("keydown", function (ev) { if (ev.key === "Enter") { ev.preventDefault(); nextMatch(); } });
  searchNext.addEventListener("click", nextMatch);
  root.addEventListener("keydown", function (ev) {
    var tag = ev.target && ev.target.tagName;
    if (tag === "INPUT" || tag === "SELECT" || tag === "BUTTON" || tag === "TEXTAREA" || state.row === null) return;
    if (ev.key === "ArrowDown" || ev.key === "ArrowUp") {
      ev.preventDefault(); state.pinned = true; setRow(state.row + (ev.key === "ArrowDown" ? 1 : -1));
    }
  });
  seqSel.addEventListener("change", whenParsed(function () {
    state.s = Number(seqSel.value); state.l = 0; state.h = 0; state.row = null; state.col = null; state.pinned = false;
    pinBox.checked = false;
    setLayers(); setHeads(); renderModel(); runSearch(); renderAll();
  }));
  layerSel.addEventListener("change", whenParsed(function () { state.l = Number(layerSel.value); setHeads(); renderAll(); }));
  headSel.addEventListener("change", function () { state.h = Number(headSel.value); renderAll(); });

  // -- check yourself: questions with choices, check, hint, the answer drawn on its matrix ----
  function renderLearn(qs) {
    var box = role(el("section", "ca-learn"), "learn");
    box.setAttribute("aria-label", "check yourself");
    box.appendChild(el("h3", null, "Check yourself"));
    var count = role(el("p", "ca-muted"), "learn-count"), prompt = role(el("p", "ca-prompt"), "learn-prompt");
    var form = el("fieldset", "ca-choices"); role(form, "learn-choices");
    var legendQ = el("legend", "ca-hidden-label", "choices"); form.appendChild(legendQ);
    var bar = el("div", "ca-learn-bar");
    function button(text, r) { var b = role(el("button", "ca-btn", text), r); b.type = "button"; bar.appendChild(b); return b; }
    var prev = button("previous", "learn-prev"), check = button("check", "learn-check");
    var hintB = button("hint", "learn-hint"), next = button("next", "learn-next");
    var feedback = role(el("p", "ca-feedback"), "learn-feedback"); feedback.setAttribute("aria-live", "polite");
    var hintP = role(el("p", "ca-hint-text ca-hidden"), "learn-hint-text");
    var expl = role(el("p", "ca-explanation ca-hidden"), "learn-explanation");
    var pic = role(el("canvas", "ca-learn-pic ca-hidden"), "learn-picture");
    var score = role(el("p", "ca-score"), "learn-score");
    [count, prompt, form, bar, feedback, hintP, expl, pic, score].forEach(function (n) { box.appendChild(n); });
    var cur = 0, answered = {}, right = {};
    function show(k) {
      cur = k;
      var q = qs[k];
      count.textContent = "question " + (k + 1) + " of " + qs.length;
      prompt.textContent = q.prompt;
      while (form.childNodes.length > 1) form.removeChild(form.lastChild);
      q.choices.forEach(function (c, n) {
        var lab = el("label", "ca-choice"), r = el("input");
        r.type = "radio"; r.name = uid + "-q" + k; r.value = String(n);
        r.setAttribute("data-choice", String(n));
        if (answered[k] === n) r.checked = true;
        lab.appendChild(r); lab.appendChild(doc.createTextNode(" " + c));
        form.appendChild(lab);
      });
      hintP.textContent = q.hint ? "Hint: " + q.hint : "No hint for this one.";
      hintP.classList.add("ca-hidden");
      prev.disabled = k === 0; next.disabled = k === qs.length - 1;
      if (k in answered) reveal(); else { feedback.textContent = ""; feedback.className = "ca-feedback"; expl.classList.add("ca-hidden"); pic.classList.add("ca-hidden"); }
      updateScore();
    }
    function chosen() {
      var r = form.querySelector("input:checked");
      return r ? Number(r.value) : null;
    }
    function reveal() {
      var q = qs[cur], ok = right[cur];
      feedback.textContent = (ok ? "Right: " : "Not quite. The answer is: ") + q.choices[q.answer];
      feedback.className = "ca-feedback " + (ok ? "ca-ok" : "ca-bad");
      feedback.setAttribute("data-correct", ok ? "1" : "0");
      expl.textContent = q.explanation; expl.classList.toggle("ca-hidden", !q.explanation);
      var labels = form.querySelectorAll("label.ca-choice");
      for (var n = 0; n < labels.length; n++) labels[n].classList.toggle("ca-choice-answer", n === q.answer);
      if (q.picture) { drawPicture(pic, q.picture, q.highlight); pic.classList.remove("ca-hidden"); }
    }
    function updateScore() {
      var n = Object.keys(answered).length, r = 0;
      Object.keys(right).forEach(function (k) { if (right[k]) r++; });
      score.textContent = "score: " + r + " of " + n + " answered right (" + qs.length + " questions)";
    }
    check.addEventListener("click", function () {
      var c = chosen();
      if (c === null) { feedback.textContent = "Choose one answer first."; feedback.className = "ca-feedback"; return; }
      answered[cur] = c; right[cur] = c === qs[cur].answer;
      reveal(); updateScore();
    });
    hintB.addEventListener("click", function () { hintP.classList.remove("ca-hidden"); });
    prev.addEventListener("click", function () { if (cur > 0) show(cur - 1); });
    next.addEventListener("click", function () { if (cur < qs.length - 1) show(cur + 1); });
    show(0);
    return box;
  }
  // The question's own matrix (M by kinds, S or A by value), with the answer outlined:
  // a row (with the softmax arrow along it), a column, every row, or single cells.
  function drawPicture(cv, pic, hl) {
    var T = pic.T, cell = Math.max(8, Math.min(28, Math.floor(260 / T)));
    var ml = 0, probe = cv.getContext("2d"), i, j;
    probe.font = "11px sans-serif";
    pic.tokens.forEach(function (t) { ml = Math.max(ml, probe.measureText(short(t)).width); });
    ml = Math.ceil(ml) + 8;
    var mt = ml, G = cell * T, ctx = sized(cv, ml + G + 70, mt + G + 8);
    cv.setAttribute("data-grid", [ml, mt, cell, T].join(","));
    var vmax = 0;
    if (pic.values) pic.values.forEach(function (r) { r.forEach(function (v) { if (v !== null) vmax = Math.max(vmax, Math.abs(v)); }); });
    vmax = vmax || 1;
    for (i = 0; i < T; i++) for (j = 0; j < T; j++) {
      var kd = pic.kinds[i][j], x = ml + j * cell, y = mt + i * cell, v = pic.values ? pic.values[i][j] : null;
      if (kd) ctx.fillStyle = pic.values ? KIND[kd].muted : KIND[kd].color;
      else if (!pic.values) ctx.fillStyle = KIND[0].color;
      else if (v === null) ctx.fillStyle = KIND[0].muted;
      else if (pic.matrix === "S") ctx.fillStyle = css(LUT.S[Math.max(0, Math.min(255, Math.round((v / vmax + 1) * 127.5)))]);
      else ctx.fillStyle = css(LUT.A[Math.max(0, Math.min(255, Math.round(v / vmax * 255)))]);
      ctx.fillRect(x, y, cell, cell);
      if (kd && KIND[kd].hatch) { ctx.fillStyle = hatchPattern(ctx); ctx.fillRect(x, y, cell, cell); }
    }
    ctx.strokeStyle = "rgba(255,255,255,0.9)"; ctx.lineWidth = 1; ctx.beginPath();
    for (i = 0; i <= T; i++) { ctx.moveTo(ml, mt + i * cell); ctx.lineTo(ml + G, mt + i * cell); ctx.moveTo(ml + i * cell, mt); ctx.lineTo(ml + i * cell, mt + G); }
    ctx.stroke();
    ctx.fillStyle = "#212529"; ctx.font = "11px sans-serif"; ctx.textBaseline = "middle";
    for (i = 0; i < T; i++) {
      ctx.textAlign = "right"; ctx.fillText(short(pic.tokens[i]), ml - 4, mt + (i + 0.5) * cell);
      ctx.save(); ctx.translate(ml + (i + 0.5) * cell, mt - 4); ctx.rotate(-Math.PI / 2);
      ctx.textAlign = "left"; ctx.fillText(short(pic.tokens[i]), 0, 0); ctx.restore();
    }
    if (!hl) return;
    ctx.strokeStyle = "#e8590c"; ctx.lineWidth = 3; ctx.fillStyle = "#e8590c";
    var rows = hl.axis === "row" ? (typeof hl.row === "number" ? [hl.row] : Array.from({ length: T }, function (_, k) { return k; })) : [];
    rows.forEach(function (r) {
      ctx.strokeRect(ml, mt + r * cell, G, cell);
      ctx.beginPath(); ctx.moveTo(ml + G + 6, mt + (r + 0.5) * cell); ctx.lineTo(ml + G + 26, mt + (r + 0.5) * cell); ctx.stroke();
      ctx.beginPath(); ctx.moveTo(ml + G + 32, mt + (r + 0.5) * cell); ctx.lineTo(ml + G + 24, mt + (r + 0.5) * cell - 5);
      ctx.lineTo(ml + G + 24, mt + (r + 0.5) * cell + 5); ctx.fill();
    });
    if (rows.length) { ctx.textAlign = "left"; ctx.fillText("Σ_j = 1", ml + G + 34, mt + (rows[0] + 0.5) * cell); }
    var col = typeof hl.column === "number" ? hl.column : typeof hl.col === "number" ? hl.col : null;
    if (hl.axis === "column") {
      (col === null ? Array.from({ length: T }, function (_, k) { return k; }) : [col]).forEach(function (c) { ctx.strokeRect(ml + c * cell, mt, cell, G); });
    }
    if (hl.axis === "all") ctx.strokeRect(ml, mt, G, G);
    (hl.cells || []).forEach(function (c) { ctx.strokeRect(ml + c[1] * cell, mt + c[0] * cell, cell, cell); });
    cv.setAttribute("data-highlight", JSON.stringify(hl));
  }
  if (data.learn && data.learn.length) right.appendChild(renderLearn(data.learn));
  right.appendChild(side);

  var marks = [];
  function mark(n) { marks.push(n + " " + Math.round(performance.now() - T0)); }
  setLayers(); setHeads(); mark("meta"); renderModel(); mark("model"); renderTokens(); layerInfo(0, 0); mark("layer");
  headInfo(0, 0, 0); mark("head"); renderAll(); mark("all");
  root.setAttribute("data-marks", marks.join(","));
  root.setAttribute("data-ready", "1");
  root.setAttribute("data-load-ms", String(Math.round(performance.now())));
}
