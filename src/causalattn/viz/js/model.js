/* causalattn explorer, model view: layers × heads thumbnails of A and a summary per head
 * (previous token, induction, first token, mean distance, entropy, role). Reads the state;
 * a click asks main to change it: on.open(layer, head) for a thumbnail, on.head(head) for a
 * row of the summary table.
 */
function caModel(U, D, model, on) {
  "use strict";
  var el = U.el, role = U.role, fmt = U.fmt, LUT = U.LUT, bytes = D.bytes, seqMeta = D.seqMeta;
  var thumbs = [];
  function renderModel(state) {
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
    grid.addEventListener("click", function (ev) {
      var b = ev.target.closest ? ev.target.closest("button.ca-thumb") : null;
      if (b) on.open(Number(b.getAttribute("data-layer")), Number(b.getAttribute("data-head")));
    });
    model.appendChild(grid);
    model.appendChild(role(el("div", "ca-headsum"), "head-summary"));
  }
  function renderHeadSummary(state) {
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
      if (r) on.head(Number(r.getAttribute("data-head")));
    });
    box.appendChild(table);
  }

  return { render: renderModel, renderHeadSummary: renderHeadSummary };
}
