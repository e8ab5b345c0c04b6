"""Trains the demo target: a gemma4_text model from scratch on the KJV training split, with
mlx-lm's own Gemma 4 class (so mlx-lm loads and generates from the result unchanged).

    python train_target.py                      # the demo target (resumes if interrupted)
    python train_target.py --preset tiny --steps 20 --run /tmp/r   # the smoke-test size

The run directory keeps the float32 training state; `--export DIR` (default: the preset's model
directory) writes the shipped checkpoint in bfloat16 with the tokenizer and configs.
"""

import argparse
import json
from pathlib import Path
from typing import Dict

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models import gemma4_text
from tokenizers import Tokenizer

import corpus
import fused
import loop
import tokenizer as tk

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SW, FA = "sliding_attention", "full_attention"


def text_config(hidden: int, layer_types, heads: int, kv_heads: int, head_dim: int,
                global_head_dim: int, intermediate: int, window: int, ple: int,
                kv_shared: int) -> Dict:
    """A gemma4_text config as released Gemma 4 checkpoints write it."""
    return {
        "architectures": ["Gemma4ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attention_k_eq_v": False,
        "bos_token_id": tk.BOS_ID,
        "dtype": "bfloat16",
        "enable_moe_block": False,
        "eos_token_id": [tk.EOS_ID, tk.END_OF_TURN_ID],
        "final_logit_softcapping": 30.0,
        "global_head_dim": global_head_dim,
        "head_dim": head_dim,
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": hidden,
        "hidden_size_per_layer_input": ple,
        "initializer_range": 0.02,
        "intermediate_size": intermediate,
        "layer_types": list(layer_types),
        "max_position_embeddings": 131072,
        "model_type": "gemma4_text",
        "num_attention_heads": heads,
        "num_global_key_value_heads": None,
        "num_hidden_layers": len(layer_types),
        "num_key_value_heads": kv_heads,
        "num_kv_shared_layers": kv_shared,
        "pad_token_id": tk.PAD_ID,
        "rms_norm_eps": 1e-06,
        "rope_parameters": {
            "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0,
                               "rope_type": "proportional"},
            "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
        },
        "sliding_window": window,
        "tie_word_embeddings": True,
        "use_cache": True,
        "use_double_wide_mlp": False,
        "vocab_size": tk.VOCAB_SIZE,
        "vocab_size_per_layer_input": tk.VOCAB_SIZE,
    }


# The demo target: sliding and full layers (window 128, so a 256-token generation wraps it),
# proportional RoPE on the full layers, softcap, tied embeddings, per-layer inputs, and the
# last two layers reading the K/V of earlier ones, as Gemma 4's small models do.
PRESETS = {
    "demo": dict(
        config=text_config(hidden=256, layer_types=[SW, SW, FA, SW, SW, FA], heads=4,
                           kv_heads=1, head_dim=64, global_head_dim=128, intermediate=1024,
                           window=128, ple=32, kv_shared=2),
        model_dir=ROOT / "models" / "kjv-gemma4",
        steps=3700, batch=8, seq=256, lr=3e-3, warmup=100, dropout=0.15, weight_decay=1.0,
        average_last=500, average_every=50),
    "tiny": dict(
        config=text_config(hidden=64, layer_types=[SW, FA, SW, FA], heads=2, kv_heads=1,
                           head_dim=32, global_head_dim=64, intermediate=128, window=16,
                           ple=8, kv_shared=1),
        model_dir=None, steps=30, batch=4, seq=64, lr=3e-3, warmup=5, dropout=0.1,
        weight_decay=0.1, average_last=20, average_every=5),
}


# The held-out loss logged during training: the first 16K held-out tokens, every 300 steps.
HELDOUT_TOKENS, HELDOUT_LOG_EVERY = 16 * 1024, 300


def token_stream(tok, docs) -> np.ndarray:
    """Every document as <bos> text <eos>, concatenated."""
    out = []
    for d in docs:
        out.append(tk.BOS_ID)
        out.extend(tok.encode(d["text"], add_special_tokens=False).ids)
        out.append(tk.EOS_ID)
    return np.array(out, dtype=np.int32)


def batches(stream: np.ndarray, batch: int, seq: int, seed: int):
    """Batch of a step: `batch` windows of seq+1 tokens at offsets drawn from (seed, step)."""
    def at(step: int):
        rng = np.random.default_rng([seed, step])
        starts = rng.integers(0, len(stream) - seq - 1, size=batch)
        windows = np.stack([stream[s:s + seq + 1] for s in starts])
        return mx.array(windows[:, :-1]), mx.array(windows[:, 1:])
    return at


def recipe(p: Dict) -> Dict:
    """A preset's `loop.train` arguments."""
    return dict(lr=p["lr"], warmup=p["warmup"], weight_decay=p["weight_decay"],
                average_last=p["average_last"], average_every=p["average_every"],
                tokens_per_step=p["batch"] * p["seq"])


def lm_loss(model, inputs, targets):
    """Mean cross-entropy of the model's softcapped logits (`fused`: the same as mlx-lm's)."""
    logits = model.model.embed_tokens.as_linear(model.model(inputs))
    ce = fused.softcap_cross_entropy(model.final_logit_softcapping)
    return ce(logits, targets).mean()


def heldout_loss(stream: np.ndarray, seq: int, batch: int = 8):
    """Mean cross-entropy over consecutive windows of `stream` (held-out tokens), no dropout."""
    n = len(stream) // (seq + 1)
    windows = stream[:n * (seq + 1)].reshape(n, seq + 1)

    def measure(model) -> float:
        model.eval()
        total = 0.0
        for i in range(0, n, batch):
            w = mx.array(windows[i:i + batch])
            total += lm_loss(model, w[:, :-1], w[:, 1:]).item() * len(w)
        model.train()
        return total / n
    return measure


class NormThenDropout(nn.RMSNorm):
    """The norm that closes a residual branch, then dropout while training.

    The KJV training split is under a million tokens, a few epochs for a 10M-parameter model:
    without dropout the held-out loss stops falling after three epochs while the training loss
    keeps falling. The norm keeps its `weight`, so the checkpoint's tensor names do not change.
    """

    def __init__(self, norm: nn.RMSNorm, p: float):
        super().__init__(norm.weight.shape[0], eps=norm.eps)
        self.weight = norm.weight
        self.p = p

    def __call__(self, x: mx.array) -> mx.array:
        h = super().__call__(x)
        if not self.training or self.p == 0:
            return h
        keep = mx.random.bernoulli(1 - self.p, h.shape)
        return mx.where(keep, h / (1 - self.p), mx.zeros_like(h))


def build(config: Dict, seed: int, dropout: float = 0.0):
    """mlx-lm's Gemma 4, with dropout on the attention and MLP branches when training, and
    its MLPs' GELU computed as in `fused`."""
    mx.random.seed(seed)
    args = gemma4_text.ModelArgs.from_dict(config)
    model = gemma4_text.Model(args)
    for i, layer in enumerate(model.model.layers):
        mlp = fused.MLP(args, i)
        mlp.update(layer.mlp.parameters())
        layer.mlp = mlp
        layer.post_attention_layernorm = NormThenDropout(layer.post_attention_layernorm, dropout)
        layer.post_feedforward_layernorm = NormThenDropout(layer.post_feedforward_layernorm,
                                                           dropout)
    mx.eval(model.parameters())
    model.train()
    return model


def export(model, config: Dict, tok, out: Path, dtype=mx.bfloat16) -> None:
    """The checkpoint as Hugging Face lays it out, weights in `dtype`. Other files in `out` (the
    model card, the drafters' bench prompts and figures) are kept."""
    out.mkdir(parents=True, exist_ok=True)
    weights = {k: v.astype(dtype) for k, v in tree_flatten(model.parameters())}
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tk.save(tok, out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="demo")
    ap.add_argument("--run", type=Path, help="run directory (default training/runs/<preset>)")
    ap.add_argument("--steps", type=int, help="total steps (default: the preset's)")
    ap.add_argument("--export", type=Path, help="checkpoint directory to write at the end")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--processes", type=int, default=2,
                    help="data-parallel processes (default 2: see loop.py)")
    args = ap.parse_args()
    loop.spawn(args.processes)

    p = PRESETS[args.preset]
    run = args.run or HERE / "runs" / f"target-{args.preset}"
    steps = args.steps or p["steps"]
    run.mkdir(parents=True, exist_ok=True)

    train_docs = corpus.load("train")
    tok_path = run / "tokenizer.json"
    if not tok_path.exists():
        if loop.leader():
            tk.save(tk.train([d["text"] for d in train_docs]), run)
        loop.barrier()
    tok = Tokenizer.from_file(str(tok_path))
    stream = token_stream(tok, train_docs)
    heldout = token_stream(tok, corpus.load("heldout"))[:HELDOUT_TOKENS]

    config = p["config"]
    model = build(config, args.seed, p["dropout"])
    n_params = sum(v.size for _, v in tree_flatten(model.parameters()))
    if loop.leader():
        print(f"{args.preset}: {n_params / 1e6:.2f}M parameters, {len(stream)} training tokens, "
              f"{steps} steps of {p['batch']}x{p['seq']} "
              f"({steps * p['batch'] * p['seq'] / len(stream):.2f} epochs)")
    last = loop.train(run, model, lm_loss, batches(stream, p["batch"], p["seq"], args.seed),
                      steps=steps, desc=args.preset, **recipe(p),
                      heldout=heldout_loss(heldout, p["seq"]), heldout_every=HELDOUT_LOG_EVERY,
                      seed=args.seed)
    if not loop.leader():
        return
    print(json.dumps(last))
    out = args.export or p["model_dir"]
    if out is not None:
        export(model, config, tok, out)
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
