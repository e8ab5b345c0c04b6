"""Fits the centroid head of a trained Gemma 4 assistant drafter and adds it to the drafter's
directory: `masked_embedding.centroids.weight` [C, D], `masked_embedding.token_ordering` [V] and
the config keys `use_ordered_embeddings`, `num_centroids`, `centroid_intermediate_top_k`, as
Gemma 4's own assistants ship them (transformers' Gemma4AssistantForCausalLM reads them).

    python fit_centroids.py --target ../models/kjv-gemma4 --out ../models/kjv-gemma4-assistant

With the head, a draft step scores C centroids, keeps the best k, and scores only their V/C
tokens each instead of the whole vocabulary: the tied head is most of the drafter's weights, and
a step reads k·V/C of its rows instead of V.

Two parts. The vocabulary is split into C groups of V/C tokens by balanced spherical k-means on
the tied embedding's rows (tokens whose rows point the same way win for the same hidden states).
The centroids are then trained as a linear classifier of the group of the token the tied head
would draft, by cross-entropy, on the hidden states the assistant's head reads along rounds over
the target's own continuations (drafter_data.py), so that the draft's group is among the best
k. The figure that matters, printed per k: how often the tied head's draft lies in the k best
groups on hidden states held out of the fit (then the centroid head drafts the same token).
"""

import json
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from tqdm import tqdm

import drafter_data
import drafter_train as dt
import train_assistant as ta

PRESETS = {
    "demo": dict(centroids=128, top_k=8, examples=512, kmeans_iterations=12, steps=400,
                 lr=3e-3, batch=8192),
    "tiny": dict(centroids=4, top_k=2, kmeans_iterations=2, steps=8,
                 lr=3e-3, batch=256),
}
HELD_OUT = 0.1  # share of the hidden states kept out of the fit, to measure it


def round_hiddens(run: dt.Run, model: ta.Assistant, config: dict, donors: dict, steps: int,
                  examples: int, rows: int = 16) -> np.ndarray:
    """The normed hidden states the assistant's head reads, float32 [N, D]: every step of a
    round at every anchor of the first `examples` examples."""
    data = run.data
    anchors = np.array(data.anchors(steps + 1), dtype=np.int32)
    examples = min(examples, len(data.tokens))
    out = []
    for i in tqdm(range(0, examples, rows), desc="hidden states", unit="batch"):
        idx = np.arange(i, min(i + rows, examples))
        hidden = mx.array(data.hidden[idx]).astype(mx.float32)
        final = mx.fast.rms_norm(run.last_layer(hidden), run.head.norm_weight, run.head.eps)
        kv = {t: tuple(mx.array(donors[t][j][idx]).astype(mx.float32) for j in (0, 1))
              for t in (ta.SW, ta.FA)}
        picks = mx.array(np.tile(anchors, (len(idx), 1)))
        for h in ta.round_hidden(model, config, run.head, final, mx.array(data.tokens[idx]),
                                 picks, kv, steps):
            out.append(np.array(h.reshape(-1, h.shape[-1])))
    return np.concatenate(out)


def tied_drafts(h: np.ndarray, embed: np.ndarray, chunk: int = 16384) -> np.ndarray:
    """The tied head's greedy token for each hidden state (the soft cap keeps the order)."""
    e = mx.array(embed)
    return np.concatenate([np.array(mx.argmax(mx.array(h[i:i + chunk]) @ e.T, axis=-1))
                           for i in range(0, len(h), chunk)])


def balanced_groups(embed: np.ndarray, groups: int, iterations: int, seed: int) -> np.ndarray:
    """Each token's group, every group of V / groups tokens: spherical k-means whose assignment
    step fills groups greedily, best (token, group) similarity first."""
    vocab = len(embed)
    size = vocab // groups
    x = embed / np.maximum(np.linalg.norm(embed, axis=1, keepdims=True), 1e-12)
    centers = x[np.random.default_rng(seed).choice(vocab, groups, replace=False)]
    group = np.zeros(vocab, dtype=np.int64)
    for _ in tqdm(range(iterations), desc="balanced k-means", unit="iteration"):
        scores = x @ centers.T
        group[:] = -1
        counts = np.zeros(groups, dtype=np.int64)
        for flat in np.argsort(-scores, axis=None):
            t, c = divmod(int(flat), groups)
            if group[t] < 0 and counts[c] < size:
                group[t] = c
                counts[c] += 1
                if counts.sum() == vocab:
                    break
        centers = np.stack([x[group == c].mean(axis=0) for c in range(groups)])
        centers /= np.maximum(np.linalg.norm(centers, axis=1, keepdims=True), 1e-12)
    return group


def fit_centroids(h: np.ndarray, labels: np.ndarray, init: np.ndarray, p: dict, steps: int,
                  seed: int):
    """Centroids [C, D] trained by cross-entropy to score each hidden state's draft group first."""
    centroids = nn.Linear(init.shape[1], init.shape[0], bias=False)
    centroids.weight = mx.array(init)
    opt = optim.Adam(learning_rate=p["lr"])
    rng = np.random.default_rng(seed)

    def loss_fn(model, x, y):
        return nn.losses.cross_entropy(model(x), y, reduction="mean")

    step = nn.value_and_grad(centroids, loss_fn)
    bar = tqdm(range(steps), desc="centroids", unit="step")
    for _ in bar:
        pick = rng.integers(0, len(h), size=min(p["batch"], len(h)))
        loss, grads = step(centroids, mx.array(h[pick]), mx.array(labels[pick]))
        opt.update(centroids, grads)
        mx.eval(centroids.parameters(), opt.state)
        bar.set_postfix(loss=f"{loss.item():.3f}")
    return np.array(centroids.weight)


def hit_rates(h: np.ndarray, labels: np.ndarray, centroids: np.ndarray, ks) -> dict:
    """For each k, the share of hidden states whose draft group is among the k best scored."""
    scores = h @ centroids.T
    rank = (scores > scores[np.arange(len(h)), labels][:, None]).sum(axis=1)
    return {k: float((rank < k).mean()) for k in ks}


def write(out: Path, weights: dict, config: dict, centroids: np.ndarray, group: np.ndarray,
          top_k: int) -> None:
    """The drafter's safetensors and config with the centroid head added."""
    weights = dict(weights)
    weights["masked_embedding.centroids.weight"] = mx.array(centroids).astype(mx.bfloat16)
    weights["masked_embedding.token_ordering"] = mx.array(np.argsort(group, kind="stable").astype(np.int64))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "pt"})
    config = dict(config, use_ordered_embeddings=True, num_centroids=int(centroids.shape[0]),
                  centroid_intermediate_top_k=top_k)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def add_centroid_head(run: dt.Run, model: ta.Assistant, config: dict, donors: dict, out: Path,
                      p: dict, steps: int, seed: int) -> dict:
    """Fits the centroid head of the assistant `model` (float32, trained) and writes it into
    `out`, beside the weights exported there; returns the figures for its card."""
    start = time.time()
    weights = {k: v for k, v in mx.load(str(out / "model.safetensors")).items()
               if not k.startswith("masked_embedding.")}
    mx.eval(list(weights.values()))  # read before the file is written over
    h = round_hiddens(run, model, config, donors, ta.PRESETS[run.args.preset]["steps_per_round"],
                      p.get("examples", len(run.data.tokens)))
    embed = np.array(model.model.embed_tokens.weight)
    drafts = tied_drafts(h, embed)
    group = balanced_groups(embed, p["centroids"], p["kmeans_iterations"], seed)
    labels = group[drafts]
    order = np.random.default_rng(seed).permutation(len(h))
    held = order[:int(len(h) * HELD_OUT)]
    fit = order[len(held):]
    init = np.stack([embed[group == c].mean(axis=0) for c in range(p["centroids"])])
    centroids = fit_centroids(h[fit], labels[fit], init, p, steps, seed)
    ks = sorted({1, 4, p["top_k"]} & set(range(1, p["centroids"] + 1)))
    rates = hit_rates(h[held], labels[held], centroids, ks)
    write(out, weights, config, centroids, group, p["top_k"])
    return {"centroids": p["centroids"], "group": len(embed) // p["centroids"], "top_k": p["top_k"],
            "held_out": len(held), "draft_in_top_k": rates, "minutes": (time.time() - start) / 60}


def card_section(figures: dict, preset: str) -> str:
    """The centroid head's part of the drafter's card (its bullet joins the target's card)."""
    rates = figures["draft_in_top_k"]
    shown = ", ".join(f"{100 * rates[k]:.1f}% at {k}" for k in sorted(rates, reverse=True))
    return f"""
## Centroid head

- Centroid head (`training/fit_centroids.py`, preset `{preset}`): {figures['centroids']} groups of
  {figures['group']} tokens, the best {figures['top_k']} scored per step; the tied head's draft lies in
  the groups kept for {shown} of {figures['held_out']} held-out hidden states; fitted in
  {figures['minutes']:.1f} min.
"""


def add_card_section(out: Path, section: str) -> None:
    """Replaces the card's centroid-head section, or appends it."""
    card = out / "README.md"
    text = card.read_text() if card.exists() else f"# {out.name}\n"
    card.write_text(text.split("\n## Centroid head\n")[0].rstrip() + "\n" + section)


def main() -> None:
    run = dt.Run("assistant", PRESETS, __doc__)
    args = run.args
    config = json.loads((args.out / "config.json").read_text())
    model = ta.Assistant(config)
    model.load_weights(str(args.out / "model.safetensors"), strict=False)
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    cache_dir = args.data or drafter_data.HERE / "runs" / "drafter-data"
    key = drafter_data.cache_key(args.target, run.data.spec)
    donors = ta.build_donors(args.target, run.data, cache_dir / f"{key}-donors.npz")
    figures = add_centroid_head(run, model, config, donors, args.out, run.p,
                                args.steps or run.p["steps"], args.seed)
    add_card_section(args.out, card_section(figures, args.preset))
    dt.refresh_target_card(args.target)
    print(json.dumps(figures))
    print(f"wrote the centroid head into {args.out}")


if __name__ == "__main__":
    main()
