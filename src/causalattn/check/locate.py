"""Judging, in the code: where a finding's fault sits among the operations the white-box
recorder saw (:mod:`.record`), and what those operations say (the softmax axis, a mask
before or after it, the scale applied). Pure: events in, ``(file:line, code, facts)`` out."""

from __future__ import annotations

from .faults import BY_ID

__all__ = ["locate"]


def locate(events: list[dict], fault: str | None) -> tuple[str | None, str, dict]:
    """(location, code, facts) for the fault from the recorded ops."""
    sm = [i for i, e in enumerate(events) if e["op"] in ("softmax", "log_softmax")]
    exp = [i for i, e in enumerate(events) if e["op"] == "exp"]
    maskops = [i for i, e in enumerate(events) if e.get("kind") == "mask"]
    zeroing = [i for i, e in enumerate(events) if e.get("kind") == "zero"]
    scores = [
        i
        for i, e in enumerate(events)
        if e["op"] in ("matmul", "__matmul__", "bmm", "einsum", "baddbmm")
        and len(e.get("shape", ())) >= 2
        and e["shape"][-1] == e["shape"][-2]
    ]
    sdpa = [i for i, e in enumerate(events) if e["op"] == "scaled_dot_product_attention"]
    norm_at = sm[0] if sm else (exp[0] if exp else (sdpa[0] if sdpa else None))
    facts: dict = {}
    if sm:
        facts["softmax dim"] = events[sm[0]]["dim"]
        facts["softmax over the key axis"] = events[sm[0]]["last"]
    elif exp:
        facts["softmax"] = "written by hand (exp)"
        norm = [e for e in events[exp[0] :] if e["op"] == "sum"]
        if norm:
            ax, nd = norm[0].get("axis"), norm[0].get("ndim")
            facts["normalized over axis"] = ax
            if isinstance(ax, int) and nd:
                facts["softmax over the key axis"] = ax % nd == nd - 1
    elif sdpa:
        facts["softmax"] = "inside scaled_dot_product_attention"
    if norm_at is not None and not (sdpa and norm_at == sdpa[0]):
        before = [i for i in maskops if i < norm_at]
        after = [i for i in maskops + zeroing if i > norm_at]
        facts["mask before softmax"] = bool(before)
        if after:
            facts["mask after softmax"] = True
    scales = [
        e["scalar"]
        for i, e in enumerate(events)
        if e.get("kind") == "scale" and (norm_at is None or i < norm_at)
    ]
    if scales:
        facts["scale op"] = scales[0]

    def at(i):
        return (
            (events[i]["at"], events[i]["code"])
            if i is not None and 0 <= i < len(events)
            else (None, "")
        )

    pick = None
    stage = BY_ID[fault].stage if fault in BY_ID else None
    if fault in ("softmax-query-axis", "softmax-all-entries"):
        norm = [i for i in range(norm_at or 0, len(events)) if events[i]["op"] == "sum"]
        pick = norm[0] if not sm and norm else norm_at  # a hand-written softmax: its sum
    elif fault == "unstable-softmax":
        pick = norm_at
    elif fault == "mask-after-softmax":
        guards = [i for i, e in enumerate(events) if e.get("kind") == "guard"]
        after = sorted(i for i in maskops + zeroing + guards if norm_at is not None and i > norm_at)
        pick = after[0] if after else norm_at
    elif fault == "no-mask":
        pick = norm_at  # no causal mask reaches this softmax
    elif fault == "nan-on-empty-rows":
        pick = norm_at  # the softmax that divides 0 by 0 on a row of -inf
    elif stage == "M":
        before = [i for i in maskops if norm_at is None or i < norm_at]
        # the second finite minimum is where the overflow happens: point at the last mask op
        pick = (
            (before[-1] if fault == "finite-min-added-twice" else before[0]) if before else norm_at
        )
    elif fault in ("missing-scale", "scale-by-dk", "k-not-transposed"):
        sc = [
            i
            for i, e in enumerate(events)
            if e.get("kind") == "scale" and (norm_at is None or i < norm_at)
        ]
        pick = sc[0] if sc and fault == "scale-by-dk" else (scores[0] if scores else norm_at)
    elif stage == "O":
        mm = [i for i, e in enumerate(events) if e["op"] in ("matmul", "__matmul__", "linear")]
        pick = mm[-1] if mm and (norm_at is None or mm[-1] > norm_at) else None
        if pick is None and events:
            pick = len(events) - 1
    loc, code = at(pick)
    return loc, code, facts
