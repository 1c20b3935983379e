/* causalattn explorer, main: the page's DOM, its one state object and its events.
 *
 * The page builds its own DOM. Tokens are data: they reach the page only through
 * textContent, DOM properties and canvas fillText, never through HTML parsing. Only the
 * first view's blocks precede this script: the rest may still be arriving while it draws,
 * so whatever opens another block waits for the parse to end (whenParsed). Positions shown
 * are 1-based, as in the chapter (h_1 … h_T).
 *
 * The modules before this one (decode, util, paint, side, model, learn; inlined in that
 * order by causalattn.viz.explorer) are factories: main builds each once and hands the
 * state to the ones that draw it. `state` is the sequence s, layer l, head h, the query
 * row and key col, whether the row is pinned, the search matches and the current match m;
 * only main changes it.
 */
function causalattnExplorer(root, data) {
  "use strict";
  var doc = root.ownerDocument, T0 = performance.now();
  root.setAttribute("data-start-ms", String(Math.round(T0)));
  var D = caDecode(root, data), U = caUtil(doc, data.kinds, D.LITTLE), P = caPaint(doc, U, data.kinds);
  var el = U.el, role = U.role, fmt = U.fmt, block = D.block, seqMeta = D.seqMeta;
  var layerInfo = D.layerInfo, headInfo = D.headInfo;
  function whenParsed(fn) { // an event handler that may open blocks after the first view's
    return function () {
      var args = arguments;
      if (doc.readyState === "loading") doc.addEventListener("DOMContentLoaded", function () { fn.apply(null, args); });
      else fn.apply(null, args);
    };
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

  var panels = P.makePanels(panelBox);
  var state = { s: 0, l: 0, h: 0, row: null, col: null, pinned: false, matches: [], m: -1 };
  var Side = caSide(U, D, side);
  var M = caModel(U, D, model, {
    open: whenParsed(function (l, h) { // a thumbnail: its layer and head
      state.l = l; state.h = h;
      layerSel.value = String(state.l); setHeads(); headSel.value = String(state.h);
      renderAll(); panelBox.scrollIntoView({ block: "nearest" });
    }),
    head: function (h) { state.h = h; headSel.value = String(state.h); renderAll(); },
  });
  function drawOverlays() { panels.forEach(function (p) { P.drawOverlay(p, state); }); }

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
    P.renderLegend(legend, info);
    panels.forEach(function (p) { P.drawPanel(p, info, hi); P.drawOverlay(p, state); });
    qIn.max = String(info.T);
    M.renderHeadSummary(state);
    Side.render(state);
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
    drawOverlays();
    Side.render(state);
  }
  function runSearch() {
    var needle = search.value.trim().toLowerCase(), toks = layerInfo(state.s, state.l).tokens;
    state.matches = []; state.m = -1;
    if (needle) for (var i = 0; i < toks.length; i++) if (toks[i].toLowerCase().indexOf(needle) >= 0) state.matches.push(i);
    searchCount.textContent = needle ? state.matches.length + " match" + (state.matches.length === 1 ? "" : "es") : "";
    renderTokens(state.row === null ? 0 : state.row);
    drawOverlays();
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
    drawOverlays(); Side.render(state);
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
    setLayers(); setHeads(); M.render(state); runSearch(); renderAll();
  }));
  layerSel.addEventListener("change", whenParsed(function () { state.l = Number(layerSel.value); setHeads(); renderAll(); }));
  headSel.addEventListener("change", function () { state.h = Number(headSel.value); renderAll(); });

  if (data.learn && data.learn.length) right.appendChild(caLearn(doc, U, uid).render(data.learn));
  right.appendChild(side);

  var marks = [];
  function mark(n) { marks.push(n + " " + Math.round(performance.now() - T0)); }
  setLayers(); setHeads(); mark("meta"); M.render(state); mark("model"); renderTokens(); layerInfo(0, 0); mark("layer");
  headInfo(0, 0, 0); mark("head"); renderAll(); mark("all");
  root.setAttribute("data-marks", marks.join(","));
  root.setAttribute("data-ready", "1");
  root.setAttribute("data-load-ms", String(Math.round(performance.now())));
}
