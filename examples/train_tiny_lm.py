"""Train a tiny character-level causal language model on this repository's own docs.

    .venv/bin/python examples/train_tiny_lm.py --steps 300

A few pre-norm blocks of CausalSelfAttention + MLP; attention forward and backward run on
causalattn's engines ("auto": the tiled engine on CPU). Prints the loss under a rich
progress bar, then samples a few lines greedily with one KVCache per layer.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch
from torch import nn

from causalattn import KVCache
from causalattn.layer import CausalSelfAttention

ROOT = Path(__file__).resolve().parent.parent


def corpus() -> str:
    """README.md and docs/**/*.md of the repository this script ships in."""
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]
    text = "\n".join(f.read_text(encoding="utf-8") for f in files if f.is_file())
    if len(text) < 1000:
        raise SystemExit(f"train_tiny_lm: found only {len(text)} characters of docs under {ROOT}")
    return text


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int, engine: str):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads, engine=engine)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model)
        )

    def forward(self, x, kv_cache=None):
        x = x + self.attn(self.ln1(x), kv_cache=kv_cache)
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    """Token + position embeddings, n_layers blocks, a linear head: ids (B, T) -> logits (B, T,
    V)."""

    def __init__(
        self, vocab: int, block: int, d_model: int, n_heads: int, n_layers: int, engine: str
    ):
        super().__init__()
        self.block = block
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(block, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads, engine) for _ in range(n_layers))
        self.ln = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, ids, start: int = 0, caches=None):
        pos = torch.arange(start, start + ids.shape[1], device=ids.device)
        x = self.tok(ids) + self.pos(pos)
        for i, blk in enumerate(self.blocks):
            x = blk(x, None if caches is None else caches[i])
        return self.head(self.ln(x))

    @torch.no_grad()
    def generate(self, ids, n: int):
        """Greedy decoding: the prompt once, then one token a step against the KV caches."""
        caches = [KVCache() for _ in self.blocks]
        logits = self(ids, 0, caches)
        out = ids
        for _ in range(n):
            nxt = logits[:, -1:].argmax(-1)
            out = torch.cat([out, nxt], dim=1)
            if out.shape[1] >= self.block:
                break
            logits = self(nxt, out.shape[1] - 1, caches)
        return out


def train(
    steps: int = 300,
    *,
    engine: str = "auto",
    d_model: int = 64,
    n_heads: int = 4,
    n_layers: int = 2,
    block: int = 64,
    batch: int = 16,
    lr: float = 3e-3,
    seed: int = 0,
    progress: bool = True,
    sample: bool = False,
) -> list[float]:
    """Train for ``steps`` AdamW steps on random windows of the docs; return every step's loss."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    torch.manual_seed(seed)
    text = corpus()
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([stoi[c] for c in text], dtype=torch.long)
    model = TinyLM(len(chars), block, d_model, n_heads, n_layers, engine)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * s / steps))
    )
    console = Console()
    losses: list[float] = []
    cols = (
        TextColumn("[bold]train"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]:.3f}"),
        TimeElapsedColumn(),
    )
    with Progress(*cols, console=console, disable=not progress) as bar:
        task = bar.add_task("train", total=steps, loss=float("nan"))
        for step in range(steps):
            starts = torch.randint(0, len(data) - block - 1, (batch,))
            x = torch.stack([data[s : s + block] for s in starts])
            y = torch.stack([data[s + 1 : s + block + 1] for s in starts])
            logits = model(x)
            loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            losses.append(loss.item())
            bar.update(task, advance=1, loss=losses[-1])
            if progress and (step % 50 == 0 or step == steps - 1):
                bar.console.print(f"step {step:5d}  loss {losses[-1]:.3f}")
    if sample:
        model.eval()
        prompt = torch.tensor([[stoi[c] for c in "Causal "]])
        out = model.generate(prompt, block - prompt.shape[1])
        console.print("sample:", repr("".join(chars[i] for i in out[0].tolist())))
    return losses


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument(
        "--engine", default="auto", help="causalattn engine: auto, tiled, sdpa, reference"
    )
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=64)
    args = ap.parse_args()
    losses = train(
        args.steps, engine=args.engine, n_layers=args.layers, d_model=args.d_model, sample=True
    )
    print(
        f"loss: {losses[0]:.3f} at the start, {sum(losses[-10:]) / len(losses[-10:]):.3f} over the "
        "last 10 steps"
    )


if __name__ == "__main__":
    main()
