/* causalattn explorer, side panel: the four quantities of one query row (S_ij, A_ij, v_j,
 * A_ij v_j and its norm, for each key j; why a blocked key is blocked), h_i and the row's
 * sum. Reads the state, never changes it.
 */
function caSide(U, D, side) {
  "use strict";
  var el = U.el, role = U.role, fmt = U.fmt, vec = U.vec, KIND = U.KIND;
  var layerInfo = D.layerInfo, headInfo = D.headInfo, hRow = D.hRow;
  var MAX_LIST = 64; // keys listed in the side panel for one query (largest weights first)
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
  function renderSide(state) {
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

  return { render: renderSide };
}
