/* causalattn explorer, util: DOM elements, colours (ramps, the kinds' colours as packed
 * pixels), number formats, canvases sized for the screen, the padding hatch. Tokens reach
 * the page only through textContent (el), DOM properties and canvas fillText.
 */
function caUtil(doc, kinds, LITTLE) {
  "use strict";
  var RAMPS = {
    S: ["#2166ac", "#92c5de", "#f7f7f7", "#f4a582", "#b2182b"],
    A: ["#f7fbff", "#c6dbef", "#6baed6", "#2171b5", "#08306b"],
    N: ["#fff5eb", "#fdd0a2", "#fd8d3c", "#d94801", "#7f2704"],
  };
  var KIND = {}; // code -> {name, label, color, muted, hatch}
  kinds.forEach(function (k) { KIND[k.code] = k; });

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
  kinds.forEach(function (k) { KPX[k.code] = pack(rgb(k.color)); KMUTED[k.code] = pack(rgb(k.muted)); });

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

  return { el: el, role: role, css: css, fmt: fmt, vec: vec, short: short, sized: sized,
           hatchPattern: hatchPattern, KIND: KIND, LUT: LUT, KPX: KPX, KMUTED: KMUTED, NAN_PX: NAN_PX };
}
