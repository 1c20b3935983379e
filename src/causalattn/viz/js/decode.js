/* causalattn explorer, decode: the page's data blocks to typed arrays (no DOM but reading
 * the blocks). `data` is the index (names, lengths, the kinds of blocked cells, notes,
 * questions); the paged JSON blocks (script.ca-block, data-k = their number) are parsed only
 * when a sequence or layer is opened. Matrices arrive as base64 little-endian numbers.
 * Everything decoded is cached: a layer's mask (layerInfo), a head's S, A, V and colour
 * ranges (headInfo). Where the page carries Q and K (or X and shared weights), S and A are
 * recomputed here (recompute), as causalattn.matrix_form computes them; Python checked that
 * this reproduces the trace, and tests/viz/test_explorer_browser.py pins it to the reference
 * for every score modifier and mask rule.
 */
function caDecode(root, data) {
  "use strict";
  var LITTLE = new Uint8Array(new Uint32Array([1]).buffer)[0] === 1;
  var SAMPLE = 20000; // entries sampled for the colour range of big matrices

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
  // matrix_form.softmax_last does. The page is given Q and K only when Python checked that
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

  return { LITTLE: LITTLE, bytes: bytes, floats: floats, block: block, seqMeta: seqMeta,
           layerInfo: layerInfo, headInfo: headInfo, hRow: hRow, recompute: recompute };
}
