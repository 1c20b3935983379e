/* causalattn explorer, learn panel ("check yourself"): questions with choices, check, hint,
 * and the answer drawn on the question's own matrix. Keeps its own place (the question shown,
 * the answers given); the explorer's state is not its business.
 */
function caLearn(doc, U, uid) {
  "use strict";
  var el = U.el, role = U.role, css = U.css, short = U.short, sized = U.sized;
  var hatchPattern = U.hatchPattern, KIND = U.KIND, LUT = U.LUT;
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

  return { render: renderLearn };
}
