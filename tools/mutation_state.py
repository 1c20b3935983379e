"""mutmut's verdicts kept in the repository, so that a mutation run can stop and resume in a
later checkout (``make mutate`` restores them before it runs and saves them after).

mutmut keeps each module's verdicts in ``mutants/<path>.meta``, with a hash of each
function's source, and forgets a function's verdicts when its hash changes. That folder is
build output and is lost with the checkout; a module such as the native engine's takes
longer on two cores than one sitting, so its run only ends if it can be taken up again.

    python tools/mutation_state.py save      # mutants/**.meta -> tools/mutation/<module>.json
    python tools/mutation_state.py restore   # tools/mutation/<module>.json -> mutants/**.meta
    python tools/mutation_state.py score     # a table per module, equivalent ones left out
    python tools/mutation_state.py recheck   # forget the saved survivors (after new tests)

Only decided verdicts are kept (mutmut's exit codes: 1 or 3 killed, 0 survived, 33 no
tests, and the timeouts). A survivor stays a survivor until a run names it again (mutmut
reruns the mutants a run names: ``make mutate MUTANTS="<name>"``) or ``recheck`` forgets the
saved survivors, so that the next run tries each against the tests as they are then.

``tools/mutation/equivalent.tsv`` names the survivors read and found equivalent (name, tab,
why): they leave the score's denominator. docs/mutation.md says, in words, what each run found.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STATE = ROOT / "tools" / "mutation"
MUTANTS = ROOT / "mutants"
EQUIVALENT = STATE / "equivalent.tsv"

KILLED, SURVIVED, NO_TESTS = {1, 3}, {0}, {5, 33}
TIMEOUT = {24, 36, 152, 255, -24, -9, -11}  # mutmut's "timeout" and "segfault" (its SIGKILL)


def _module(meta: Path) -> str:
    """mutants/src/causalattn/engines/cpp.py.meta -> causalattn.engines.cpp"""
    rel = meta.relative_to(MUTANTS / "src").with_suffix("").with_suffix("")
    return ".".join(rel.parts)


def save() -> list[Path]:
    """Write the decided verdicts of every module in mutants/ (one JSON each)."""
    STATE.mkdir(parents=True, exist_ok=True)
    written = []
    for meta in sorted((MUTANTS / "src").rglob("*.py.meta")):
        data = json.loads(meta.read_text())
        decided = {k: v for k, v in data["exit_code_by_key"].items() if v is not None}
        if not decided:
            continue
        out = STATE / f"{_module(meta)}.json"
        body = {
            "path": str(meta.relative_to(MUTANTS).with_suffix("")),
            "hash_by_function_name": data.get("hash_by_function_name", {}),
            "exit_code_by_key": dict(sorted(decided.items(), key=lambda kv: _order(kv[0]))),
        }
        out.write_text(json.dumps(body, indent=0, sort_keys=False) + "\n")
        written.append(out)
    return written


def restore() -> list[Path]:
    """Write a .meta for each saved module that mutants/ does not hold yet; mutmut then keeps
    the verdicts of the functions whose hash is unchanged and forgets the others."""
    written = []
    for saved in sorted(STATE.glob("*.json")):
        body = json.loads(saved.read_text())
        meta = MUTANTS / (body["path"] + ".meta")
        if meta.exists():
            continue  # mutants/ is newer than what was saved: keep it
        meta.parent.mkdir(parents=True, exist_ok=True)
        data = {
            "exit_code_by_key": body["exit_code_by_key"],
            "hash_by_function_name": body["hash_by_function_name"],
            "type_check_error_by_key": {},
            "durations_by_key": {},
            "estimated_durations_by_key": {},
        }
        meta.write_text(json.dumps(data, indent=4))
        written.append(meta)
    return written


def recheck() -> int:
    """Forget every saved survivor (the next run checks it again); how many were forgotten."""
    n = 0
    for saved in sorted(STATE.glob("*.json")):
        body = json.loads(saved.read_text())
        codes = body["exit_code_by_key"]
        kept = {k: v for k, v in codes.items() if v not in SURVIVED}
        n += len(codes) - len(kept)
        body["exit_code_by_key"] = kept
        saved.write_text(json.dumps(body, indent=0) + "\n")
    return n


def _order(name: str):
    """causalattn.x_f__mutmut_12 sorts by function, then by number."""
    head, _, n = name.rpartition("__mutmut_")
    return (head, int(n) if n.isdigit() else 0)


def equivalent() -> dict[str, str]:
    """name -> why, from equivalent.tsv (lines starting with # are comments)."""
    out = {}
    if EQUIVALENT.exists():
        for line in EQUIVALENT.read_text().splitlines():
            if line.strip() and not line.startswith("#"):
                name, _, why = line.partition("\t")
                out[name.strip()] = why.strip()
    return out


def score() -> list[dict]:
    """One row per saved module: counts by verdict, and killed / (decided - equivalent)."""
    eq = equivalent()
    rows = []
    for saved in sorted(STATE.glob("*.json")):
        codes = json.loads(saved.read_text())["exit_code_by_key"]
        n = Counter()
        for name, code in codes.items():
            if name in eq and code in SURVIVED:
                n["equivalent"] += 1
            elif code in KILLED:
                n["killed"] += 1
            elif code in SURVIVED:
                n["survived"] += 1
            elif code in NO_TESTS:
                n["no tests"] += 1
            elif code in TIMEOUT:
                n["timeout"] += 1
            else:
                n["other"] += 1
        judged = n["killed"] + n["timeout"] + n["survived"] + n["no tests"]
        rows.append(
            {
                "module": saved.stem,
                "decided": len(codes),
                **n,
                "score": (n["killed"] + n["timeout"]) / judged if judged else float("nan"),
            }
        )
    return rows


def main(argv: list[str]) -> int:
    verb = argv[1] if len(argv) > 1 else ""
    if verb == "save":
        for p in save():
            print(f"saved {p.relative_to(ROOT)}")
    elif verb == "restore":
        for p in restore():
            print(f"restored {p.relative_to(ROOT)}")
    elif verb == "recheck":
        print(f"forgot {recheck()} survivors: the next run checks them again")
    elif verb == "score":
        cols = ["decided", "killed", "timeout", "survived", "no tests", "equivalent", "other"]
        print("| module | " + " | ".join(cols) + " | score of the decided, non-equivalent |")
        print("|---" * (len(cols) + 2) + "|")
        for r in score():
            cells = " | ".join(str(r.get(c, 0)) for c in cols)
            print(f"| {r['module']} | {cells} | {r['score']:.1%} |")
    else:
        print("error: usage: mutation_state.py save|restore|score|recheck", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
