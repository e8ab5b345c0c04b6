"""Trains a DSpark drafter in the seeds' `dspark.json` format (served by the dflash plugin) for a
Gemma 4 target, and writes `dspark.json` + `model.safetensors` (float32, as trained).

    python train_dspark.py --target ../models/kjv-gemma4 --out ../models/kjv-gemma4-dspark

The network is the format's own (no third-party class exists; the NumPy oracle in
tests/oracle/dspark_oracle.py is its reference): a DFlash backbone without RoPE over the
projected taps, whose block is the anchor's (unscaled) target embedding through `tok_proj` then
γ−1 learned mask rows, each plus a learned position; `out_proj` maps back to the target's width
and the target's own head gives the base logits; a Markov head W1[x_{k−1}]·W2 and a confidence
head σ([h_k; W1[x_{k−1}]]·w + b) follow. Row k predicts token p+k+1.

The objective is the DSpark paper's (arXiv:2607.05147) as DeepSpec configures it for Gemma 4:
per row 0.1 × cross-entropy with the target's token plus 0.9 × ½‖p_draft − p_target‖₁, weighted
by exp(−k/4), the Markov head fed the true previous token; the confidence head learns
1 − ½‖p_draft − p_target‖₁ with binary cross-entropy.
"""

import json
import shutil
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

import drafter_train as dt

PRESETS = {
    "demo": dict(gamma=8, d_draft=256, layers=2, heads=4, ff_mult=2, markov_rank=64, steps=600,
                 rows=12, anchors=16, lr=1e-3, warmup=60, decay=4.0),
    "tiny": dict(gamma=4, d_draft=32, layers=1, heads=2, ff_mult=2, markov_rank=8, steps=8,
                 rows=4, anchors=4, lr=1e-3, warmup=2, decay=4.0),
}


def normal(shape, fan_in: int) -> mx.array:
    return mx.random.normal(shape) * fan_in ** -0.5


class BackboneLayer(nn.Module):
    def __init__(self, d: int, ff: int):
        super().__init__()
        self.attn_norm = mx.ones((d,))
        self.q, self.k, self.v, self.o = (normal((d, d), d) for _ in range(4))
        self.ff_norm = mx.ones((d,))
        self.gate, self.up = normal((d, ff), d), normal((d, ff), d)
        self.down = normal((ff, d), ff)


class Markov(nn.Module):
    def __init__(self, vocab: int, rank: int):
        super().__init__()
        self.w1 = normal((vocab, rank), rank)
        self.w2 = mx.zeros((rank, vocab))


class Confidence(nn.Module):
    def __init__(self, features: int):
        super().__init__()
        self.w = mx.zeros((features, 1))
        self.b = mx.zeros((1,))


class Dspark(nn.Module):
    """Attribute names are the checkpoint's tensor names; every matrix is [in, out]."""

    def __init__(self, p: dict, hidden: int, vocab: int, taps: int, eps: float):
        super().__init__()
        d, g = p["d_draft"], p["gamma"]
        self.heads, self.eps = p["heads"], eps
        self.bb = [BackboneLayer(d, p["ff_mult"] * d) for _ in range(p["layers"])]
        self.W_c = normal((taps * hidden, d), taps * hidden)
        self.ctx_norm = mx.ones((d,))
        self.tok_proj = normal((hidden, d), hidden)
        self.mask_emb = mx.random.normal((g - 1, d)) * 0.02
        self.block_pos = mx.random.normal((g, d)) * 0.02
        self.out_norm = mx.ones((d,))
        self.out_proj = normal((d, hidden), d)
        self.markov = Markov(vocab, p["markov_rank"])
        self.conf = Confidence(d + p["markov_rank"])

    def split(self, x: mx.array) -> mx.array:
        b, n, d = x.shape
        return x.reshape(b, n, self.heads, d // self.heads).transpose(0, 2, 1, 3)

    def forward(self, head: dt.TargetHead, hidden: mx.array, tokens: mx.array,
                anchors: mx.array):
        """Base logits [B, A, γ, V] and final hidden states [B, A, γ, d] of every anchor's
        block in one pass (the plugin's `draft`, with a mask in place of its context cache)."""
        b, length, _ = hidden.shape
        a = anchors.shape[1]
        g, d = self.block_pos.shape
        anchor_ids = mx.take_along_axis(tokens, anchors, axis=1)
        first = head.embed[anchor_ids] @ self.tok_proj                      # [B, A, d]
        rest = mx.broadcast_to(self.mask_emb, (b, a, g - 1, d))
        h = (mx.concatenate([first[:, :, None], rest], axis=2) + self.block_pos).reshape(
            b, a * g, d)
        ctx = mx.fast.rms_norm(hidden @ self.W_c, self.ctx_norm, self.eps)
        mask = dt.block_mask(anchors, length, g)
        scale = (d // self.heads) ** -0.5
        for layer in self.bb:
            nc = mx.fast.rms_norm(ctx, layer.attn_norm, self.eps)
            nd = mx.fast.rms_norm(h, layer.attn_norm, self.eps)
            keys = self.split(mx.concatenate([nc @ layer.k, nd @ layer.k], axis=1))
            values = self.split(mx.concatenate([nc @ layer.v, nd @ layer.v], axis=1))
            out = mx.fast.scaled_dot_product_attention(self.split(nd @ layer.q), keys, values,
                                                       scale=scale, mask=mask)
            h = h + out.transpose(0, 2, 1, 3).reshape(b, a * g, d) @ layer.o
            f = mx.fast.rms_norm(h, layer.ff_norm, self.eps)
            h = h + (nn.gelu_approx(f @ layer.gate) * (f @ layer.up)) @ layer.down
        h = mx.fast.rms_norm(h, self.out_norm, self.eps)
        logits = head.logits(h @ self.out_proj)
        return logits.reshape(b, a, g, -1), h.reshape(b, a, g, d)


def export(model: Dspark, p: dict, target: dict, target_dir: Path, taps, out: Path) -> None:
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    weights = dict(tree_flatten(model.parameters()))
    names = [k for k, _ in tree_flatten(model.parameters())]
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    meta = {
        "kind": "dspark-drafter",
        "variant": "dspark",
        "version": 1,
        "target_id": target_dir.name,
        "config": {"gamma": p["gamma"], "dDraft": p["d_draft"], "nLayers": p["layers"],
                   "nHeads": p["heads"], "markovRank": p["markov_rank"], "ffMult": p["ff_mult"],
                   "tapLayers": list(taps), "seqHead": "markov"},
        "dims": {"hiddenSize": target["hidden_size"], "vocabSize": target["vocab_size"],
                 "eps": target["rms_norm_eps"]},
        "param_names": names,
    }
    (out / "dspark.json").write_text(json.dumps(meta, indent=1) + "\n")


def main() -> None:
    run = dt.Run("dspark", PRESETS, __doc__)
    args, p, target = run.args, run.p, run.target
    mx.random.seed(args.seed)
    model = Dspark(p, target["hidden_size"], target["vocab_size"], len(run.taps),
                   target["rms_norm_eps"])
    mx.eval(model.parameters())
    gamma, weights = p["gamma"], dt.decay_weights(p["gamma"], p["decay"])

    def loss_fn(model, hidden, tokens, anchors):
        logits, h = model.forward(run.head, hidden, tokens, anchors)
        prev = dt.tokens_after(tokens, anchors, 0, gamma)                 # x_{p+k}
        labels = dt.tokens_after(tokens, anchors, 1, gamma)               # x_{p+k+1}
        w1 = model.markov.w1[prev]
        confidence = (mx.concatenate([h, w1], axis=-1) @ model.conf.w)[..., 0] + model.conf.b
        return dt.dspark_objective(logits.astype(mx.float32) + w1 @ model.markov.w2, labels,
                                   run.p_target(hidden, anchors, gamma), confidence, weights)

    last = dt.train("dspark", args, p, model, loss_fn, run.data, gamma + 1, gamma)
    export(model, p, target, args.target, run.taps, args.out)
    dt.write_card(args.out, "dspark", "a DSpark drafter (dspark.json)", args, p, last, __doc__)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
