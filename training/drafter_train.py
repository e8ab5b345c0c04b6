"""What the drafter trainers share: the frozen target's head, blocks at many anchors in one
pass, RoPE at arbitrary positions, and the command line every `train_<kind>.py` takes.

A training batch holds `rows` target continuations (drafter_data.py) and `anchors` anchor
positions in each. Every block of every anchor runs in one pass: the block rows attend to the
row's context through a mask that keeps each block to the positions before its anchor (what the
drafter would have been given at that point of decoding) and apart from the other blocks.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Callable, Dict, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

import drafter_data
import loop
from drafter_data import TargetHead

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def rope(x: mx.array, positions: mx.array, inv_freq: mx.array) -> mx.array:
    """Half-split RoPE (dims i and i + hd/2 rotate together) at a position per row:
    x [B, heads, N, hd], positions [B, N], inv_freq [hd/2] (zeros leave a pair unrotated)."""
    half = x.shape[-1] // 2
    angles = positions[:, None, :, None].astype(mx.float32) * inv_freq
    cos, sin = mx.cos(angles), mx.sin(angles)
    x1, x2 = x[..., :half], x[..., half:]
    return mx.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def block_positions(anchors: mx.array, block: int) -> mx.array:
    """Absolute positions of every block row [B, A·block]: anchor p's rows sit at p, p+1, …"""
    b, a = anchors.shape
    return (anchors[:, :, None] + mx.arange(block)).reshape(b, a * block)


def block_inputs(tokens: mx.array, anchors: mx.array, block: int, mask_id: int) -> mx.array:
    """[anchor token, mask, …, mask] for every anchor [B, A·block]."""
    b, a = anchors.shape
    anchor_ids = mx.take_along_axis(tokens, anchors, axis=1)[..., None]
    masks = mx.full((b, a, block - 1), mask_id, dtype=tokens.dtype)
    return mx.concatenate([anchor_ids, masks], axis=-1).reshape(b, a * block)


def tokens_after(tokens: mx.array, anchors: mx.array, first: int, count: int) -> mx.array:
    """tokens[p + first + k] for k < count at every anchor p: [B, A, count]."""
    idx = anchors[:, :, None] + first + mx.arange(count)
    b, a, _ = idx.shape
    return mx.take_along_axis(tokens, idx.reshape(b, -1), axis=1).reshape(b, a, count)


def rows_after(values: mx.array, anchors: mx.array, first: int, count: int) -> mx.array:
    """values[p + first + k] for k < count at every anchor p: [B, A, count, …]."""
    idx = anchors[:, :, None] + first + mx.arange(count)
    b, a, _ = idx.shape
    picked = mx.take_along_axis(values, idx.reshape(b, -1)[..., None], axis=1)
    return picked.reshape(b, a, count, *values.shape[2:])


def block_mask(anchors: mx.array, context: int, block: int, window: Optional[int] = None,
               causal: bool = False) -> mx.array:
    """Which keys each block row reads [B, 1, A·block, context + A·block]: context positions
    before its anchor (and inside `window` of the row's own position, if given), and the rows
    of its own block (up to itself if `causal`)."""
    b, a = anchors.shape
    n = a * block
    key = mx.arange(context)
    q_anchor = mx.repeat(anchors, block, axis=1)[:, :, None]              # [B, Q, 1]
    ctx = key < q_anchor
    if window is not None:
        ctx = ctx & (block_positions(anchors, block)[:, :, None] - key < window)
    q_block, q_row = mx.arange(n) // block, mx.arange(n) % block
    own = q_block[:, None] == q_block[None, :]
    if causal:
        own = own & (q_row[None, :] <= q_row[:, None])
    own = mx.broadcast_to(own[None], (b, n, n))
    return mx.concatenate([ctx, own], axis=-1)[:, None]


class Run:
    """A trainer's command line and what every kind reads: the target's config, the taps, the
    shared continuations and the frozen head."""

    def __init__(self, kind: str, presets: Dict, doc: str):
        self.args = arguments(kind, presets, doc)
        self.p = presets[self.args.preset]
        self.target = drafter_data.target_facts(self.args.target)
        layers = self.target["num_hidden_layers"]
        self.taps = default_taps(layers)
        loop.spawn(self.args.processes)
        # The first process makes the shared continuations (or finds them made); the others
        # then read them from its cache.
        self.data = loop.leader_first(
            lambda: data_for(self.args, self.taps, self.p.get("examples")))
        self.head = TargetHead(self.args.target)

    def last_layer(self, hidden: mx.array) -> mx.array:
        """The target's last layer's output, from a batch's concatenated taps."""
        return self.data.tap(hidden, self.target["num_hidden_layers"] - 1)

    def p_target(self, hidden: mx.array, anchors: mx.array, rows: int) -> mx.array:
        """The target's next-token distributions after positions p .. p+rows−1 of every anchor
        p: [B, A, rows, V]."""
        return self.head.distribution(rows_after(self.last_layer(hidden), anchors, 0, rows))


# DeepSpec's weights for the DSpark objective (config/dspark/dspark_gemma4_12b.py).
CE_ALPHA, L1_ALPHA, CONFIDENCE_ALPHA = 0.1, 0.9, 1.0


def dspark_objective(logits: mx.array, labels: mx.array, p_target: mx.array,
                     confidence: Optional[mx.array], weights: mx.array) -> mx.array:
    """The DSpark paper's loss per row, as DeepSpec weights it: 0.1 × cross-entropy with the
    target's token plus 0.9 × ½‖p_draft − p_target‖₁, and, for a confidence head (logits), binary
    cross-entropy with 1 − ½‖p_draft − p_target‖₁, the chance the row is accepted; rows weighted
    by `weights`."""
    logits = logits.astype(mx.float32)
    tv = 0.5 * mx.abs(mx.softmax(logits, axis=-1) - p_target).sum(axis=-1)
    per_row = CE_ALPHA * nn.losses.cross_entropy(logits, labels, reduction="none") + L1_ALPHA * tv
    if confidence is not None:
        per_row = per_row + CONFIDENCE_ALPHA * nn.losses.binary_cross_entropy(
            confidence, mx.stop_gradient(1.0 - tv), with_logits=True, reduction="none")
    return weighted_mean(per_row, weights)


def decay_weights(rows: int, decay: float) -> mx.array:
    """exp(−k/decay) for block row k = 0, 1, …: early rows, which every accepted draft needs,
    count most (DFlash and DSpark's `loss_decay_gamma`)."""
    return mx.exp(-mx.arange(rows, dtype=mx.float32) / decay)


def weighted_mean(per_row: mx.array, weights: mx.array) -> mx.array:
    """Mean over [B, A, rows] with row weights."""
    return (per_row * weights).sum() / (weights.sum() * per_row.shape[0] * per_row.shape[1])


def arguments(kind: str, presets: Dict, doc: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--target", type=Path, default=ROOT / "models" / "kjv-gemma4",
                    help="the Gemma 4 checkpoint directory the drafter is for")
    ap.add_argument("--out", type=Path,
                    help=f"drafter directory to write (default: <target>-{kind}, beside it)")
    ap.add_argument("--preset", choices=sorted(presets), default="demo")
    ap.add_argument("--run", type=Path,
                    help=f"run directory (default training/runs/{kind}-<preset>)")
    ap.add_argument("--steps", type=int, help="total steps (default: the preset's)")
    ap.add_argument("--data", type=Path, help="drafter-data cache directory")
    ap.add_argument("--examples", type=int, help="target continuations to learn from")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--processes", type=int, default=2,
                    help="data-parallel processes (default 2: see loop.py)")
    args = ap.parse_args()
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        if not (args.target / name).is_file():
            ap.error(f"--target {args.target}: no {name} (a Gemma 4 checkpoint directory as "
                     f"Hugging Face lays it out, with its tokenizer)")
    args.run = args.run or HERE / "runs" / f"{kind}-{args.preset}"
    args.out = args.out or args.target.parent / f"{args.target.name}-{kind}"
    return args


def default_taps(layers: int):
    """Three target layers spread over the depth, the last included: (1, 3, 5) of six."""
    return tuple(sorted({max(1, layers // 6), layers // 2, layers - 1}))


# The smoke test's data: a few short continuations.
TINY_DATA = dict(examples=32, prefix=16, greedy=24, batch=32)


def data_for(args: argparse.Namespace, taps, examples: Optional[int] = None) -> drafter_data.DrafterData:
    """The drafter data: --examples continuations, else `examples`, else the default number."""
    sizes = dict(TINY_DATA) if args.preset == "tiny" else {}
    if args.examples or examples:
        sizes["examples"] = args.examples or examples
    spec = drafter_data.DataSpec(taps=tuple(taps), seed=args.seed, **sizes)
    return drafter_data.build(args.target, spec, args.data)


def train(kind: str, args: argparse.Namespace, p: Dict, model: nn.Module, loss_fn: Callable,
          data: drafter_data.DrafterData, anchor_block: int, labels_per_block: int,
          extra: Optional[Callable] = None) -> Dict:
    """The shared loop (loop.py) over the data's batches (with `extra(indices)` appended to
    each); returns the last logged figures."""
    steps = args.steps or p["steps"]
    start = time.time()
    n_params = sum(v.size for _, v in tree_flatten(model.trainable_parameters()))
    print(f"{kind} {args.preset}: {n_params / 1e6:.2f}M trained parameters, "
          f"{len(data.tokens)} examples, {steps} steps of {p['rows']}x{p['anchors']} blocks")
    last = loop.train(args.run, model, loss_fn,
                      data.batches(p["rows"], p["anchors"], anchor_block, args.seed, extra),
                      steps=steps, lr=p["lr"], warmup=p["warmup"], desc=f"{kind} {args.preset}",
                      tokens_per_step=p["rows"] * p["anchors"] * labels_per_block,
                      log_every=min(10, max(1, steps // 4)), seed=args.seed)
    if not loop.leader():
        sys.exit(0)  # the first process writes the drafter
    last["trained_parameters"] = n_params
    last["seconds"] = round(time.time() - start)
    last["labels_per_step"] = p["rows"] * p["anchors"] * labels_per_block
    print(json.dumps(last))
    return last


def shown(path: Path) -> str:
    """A path as the repository root sees it."""
    return os.path.relpath(path.resolve(), ROOT)


def write_card(out: Path, kind: str, title: str, args: argparse.Namespace, p: Dict,
               last: Dict, doc: str) -> None:
    """The drafter's model card (README.md in its directory): what it is, the recipe and the
    command that made it, how long that took here and what it weighs."""
    size = sum(f.stat().st_size for f in out.iterdir() if f.suffix == ".safetensors")
    recipe = ", ".join(f"{k} {v}" for k, v in p.items())
    log = [json.loads(line) for line in (args.run / "log.jsonl").read_text().splitlines()]
    first_log = log[0]
    # The undisturbed rate: the 90th percentile of the logged rates (other work may have
    # shared the machine for part of the run).
    rates = sorted(line["tokens_per_s"] for line in log if "tokens_per_s" in line)
    undisturbed = rates[int(0.9 * (len(rates) - 1))]
    undisturbed_min = last["step"] * last["labels_per_step"] / undisturbed / 60
    text = f"""# {out.name}: {title}

{"An" if kind[0] in "aeiou" else "A"} {kind} drafter for [{args.target.name}](../{args.target.name}), trained by
`training/train_{kind}.py` (`make train-drafter KIND={kind}`) on the target's own greedy
continuations of the training split (`training/drafter_data.py`); no held-out chapter is in it.

{doc.split(chr(10) + chr(10), 2)[2].strip()}

- Recipe (preset `{args.preset}`): {recipe}; seed {args.seed}.
- {last['trained_parameters'] / 1e6:.2f}M trained parameters; {size / 1e6:.1f} MB of weights.
- Training loss {first_log['loss']:.3f} at step {first_log['step']}, {last['loss']:.3f} at step {last['step']}.
- Training time on the 2-core machine that made it: {last['seconds'] / 60:.1f} min for the steps
  run last, {undisturbed_min:.1f} min at its undisturbed rate ({undisturbed:.0f} labels/s, the 90th
  percentile of the logged rates); the shared continuations are made once before (about
  5 min) and cached.
- Command (from the repository root): `training/.venv/bin/python training/train_{kind}.py --target {shown(args.target)} --out {shown(out)}`

The speed-up it buys is measured by `make drafter-bench` (the demo target's model card and the
repository's docs/performance.md).
"""
    (out / "README.md").write_text(text)
    refresh_target_card(args.target)


def refresh_target_card(target: Path) -> None:
    """The target's model card ends with a section per drafter that sits beside it (named
    <target>-<kind>), made of the figures in the drafters' own cards."""
    card = target / "README.md"
    if not card.exists():
        return
    head = card.read_text().split("\n## Drafters\n")[0].rstrip() + "\n"
    parts = []
    for d in sorted(target.parent.glob(f"{target.name}-*")):
        if not (d / "README.md").exists():
            continue
        lines = (d / "README.md").read_text().splitlines()
        figures, keep = [], False
        for line in lines:
            keep = line.startswith("- ") or (keep and line.startswith("  "))
            if keep:
                figures.append(line)
        title = lines[0].split(": ", 1)[-1]
        parts.append(f"### [{d.name}](../{d.name}): {title}\n\n" + "\n".join(figures))
    if parts:
        card.write_text(head + "\n## Drafters\n\nDrafters trained for this model, each beside it "
                        "with its own card. What they buy, measured by `make drafter-bench` on "
                        "20 held-out prompts: [drafters.md](drafters.md), "
                        "[drafters.png](drafters.png).\n\n" + "\n\n".join(parts) + "\n")
