"""Train the small induction model that examples/induction/ holds (about a minute of CPU).

    .venv/bin/python examples/train_induction.py examples/induction [--seed 0]

A 2-layer Llama learns to copy in context (causalattn.learn.train_induction); then
`causalattn heads --model examples/induction` measures its heads' roles.
"""

from __future__ import annotations

import argparse
import json

from causalattn.learn import train_induction


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir", help="the folder to write (its parent must exist)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    path = train_induction(args.out_dir, seed=args.seed)
    facts = json.loads((path / "training.json").read_text())
    print(
        f"wrote {path}: {facts['steps']} steps in {facts['seconds']} s; held-out loss on the "
        f"second repeat {facts['second_repeat_loss']:.4f} vs {facts['first_repeat_loss']:.3f} "
        f"on the first (ratio {facts['ratio']:.4f})"
    )


if __name__ == "__main__":
    main()
