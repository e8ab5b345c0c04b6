"""Trains a z-lab DFlash drafter for a Gemma 4 target, with dflash 0.1.0's own model class, and
writes it in z-lab's checkpoint format (`config.json` + `model.safetensors`, no embedding and
no head: DFlash borrows the target's).

    python train_dflash.py --target ../models/kjv-gemma4 --out ../models/kjv-gemma4-dflash

The objective is DFlash's (Chen et al., "DFlash: Block Diffusion for Flash Speculative
Decoding", arXiv:2602.06036, training section): blocks start at random anchors of the target's
own responses; the block is [anchor token, mask, mask, …] and attends to the projected target
hidden states of every position before the anchor; each masked row predicts its own token with
cross-entropy, weighted by exp(−(k−1)/decay) for block row k so that the early rows, which every
accepted draft needs, count most. Here the responses are the target's greedy continuations of
training text (drafter_data.py), so a label is always the target's own next token.

The drafter's layers are `sliding_attention` with a window past any demo context: in dflash's
code that makes each block row read only the rows before it, so a block of n+1 rows drafts
exactly the first n tokens of a longer block, and every draft depth is the depth trained.
"""

import json
import shutil
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from dflash.model_mlx import DFlashConfig, DFlashDraftModel
from mlx.utils import tree_flatten

import drafter_train as dt
import tokenizer as tk

PRESETS = {
    # The demo drafter: two layers of the target's width, eight drafts per block.
    "demo": dict(layers=2, heads=4, kv_heads=2, head_dim=64, intermediate=768, block=9,
                 window=2048, steps=1000, rows=16, anchors=16, lr=1e-3, warmup=100, decay=4.0),
    # The smoke-test size: a few steps on a tiny target.
    "tiny": dict(layers=1, heads=2, kv_heads=1, head_dim=32, intermediate=64, block=4,
                 window=64, steps=8, rows=4, anchors=4, lr=1e-3, warmup=2, decay=4.0),
}


def draft_config(target: dict, p: dict, taps) -> dict:
    """The drafter's config.json, as z-lab writes one (Qwen3 keys plus `dflash_config`)."""
    return {
        "architectures": ["DFlashDraftModel"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "block_size": p["block"],
        "dflash_config": {
            "mask_token_id": tk.MASK_ID,
            "target_layer_ids": list(taps),
            "final_logit_softcapping": target["final_logit_softcapping"],
        },
        "dtype": "bfloat16",
        "head_dim": p["head_dim"],
        "hidden_act": "silu",
        "hidden_size": target["hidden_size"],
        "initializer_range": 0.02,
        "intermediate_size": p["intermediate"],
        "layer_types": ["sliding_attention"] * p["layers"],
        "max_position_embeddings": 131072,
        "max_window_layers": p["layers"],
        "model_type": "qwen3",
        "num_attention_heads": p["heads"],
        "num_hidden_layers": p["layers"],
        "num_key_value_heads": p["kv_heads"],
        "num_target_layers": target["num_hidden_layers"],
        "rms_norm_eps": target["rms_norm_eps"],
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "sliding_window": p["window"],
        "tie_word_embeddings": False,
        "use_cache": True,
        "use_sliding_window": True,
        "vocab_size": target["vocab_size"],
    }


def build(config: dict, seed: int) -> DFlashDraftModel:
    """dflash's model for `config`, built as its `load_draft` builds one."""
    mx.random.seed(seed)
    d = config["dflash_config"]
    model = DFlashDraftModel(DFlashConfig(
        hidden_size=config["hidden_size"], num_hidden_layers=config["num_hidden_layers"],
        num_attention_heads=config["num_attention_heads"],
        num_key_value_heads=config["num_key_value_heads"], head_dim=config["head_dim"],
        intermediate_size=config["intermediate_size"], vocab_size=config["vocab_size"],
        rms_norm_eps=config["rms_norm_eps"], rope_theta=config["rope_theta"],
        max_position_embeddings=config["max_position_embeddings"],
        block_size=config["block_size"], target_layer_ids=tuple(d["target_layer_ids"]),
        num_target_layers=config["num_target_layers"], mask_token_id=d["mask_token_id"],
        layer_types=tuple(config["layer_types"]), sliding_window=config["sliding_window"],
        final_logit_softcapping=d["final_logit_softcapping"]))
    mx.eval(model.parameters())
    model.train()
    return model


def draft_logits(model: DFlashDraftModel, head: dt.TargetHead, hidden: mx.array,
                 tokens: mx.array, anchors: mx.array, block: int) -> mx.array:
    """The drafter's logits [B, A, block−1, V] for the masked rows of the blocks at `anchors`,
    all blocks of a row in one pass: dflash's layer computation, with a mask that keeps the
    blocks apart instead of a cache."""
    c = model.config
    b, length, _ = hidden.shape
    n = anchors.shape[1] * block
    h = head.embed[dt.block_inputs(tokens, anchors, block, c.mask_token_id)] * head.embed_scale
    ctx = model.hidden_norm(model.fc(hidden))
    inv_freq = 1.0 / (c.rope_theta ** (mx.arange(0, c.head_dim, 2, dtype=mx.float32) / c.head_dim))
    q_pos = dt.block_positions(anchors, block)
    k_pos = mx.broadcast_to(mx.arange(length)[None], (b, length))
    mask = dt.block_mask(anchors, length, block, window=c.sliding_window, causal=True)

    def heads(t, count):
        return t.reshape(b, t.shape[1], count, c.head_dim).transpose(0, 2, 1, 3)
    for layer in model.layers:
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        q = dt.rope(attn.q_norm(heads(attn.q_proj(x), c.num_attention_heads)), q_pos, inv_freq)
        kc = dt.rope(attn.k_norm(heads(attn.k_proj(ctx), c.num_key_value_heads)), k_pos, inv_freq)
        kb = dt.rope(attn.k_norm(heads(attn.k_proj(x), c.num_key_value_heads)), q_pos, inv_freq)
        keys = mx.concatenate([kc, kb], axis=2)
        values = mx.concatenate([heads(attn.v_proj(ctx), c.num_key_value_heads),
                                 heads(attn.v_proj(x), c.num_key_value_heads)], axis=2)
        out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=attn.scale, mask=mask)
        h = h + attn.o_proj(out.transpose(0, 2, 1, 3).reshape(b, n, -1))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    h = model.norm(h).reshape(b, anchors.shape[1], block, -1)[:, :, 1:]
    return head.logits(h)


def export(model: DFlashDraftModel, config: dict, out: Path) -> None:
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    weights = {k: v.astype(mx.bfloat16) for k, v in tree_flatten(model.parameters())}
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def main() -> None:
    run = dt.Run("dflash", PRESETS, __doc__)
    args, p = run.args, run.p
    config = draft_config(run.target, p, run.taps)
    model = build(config, args.seed)
    block, weights = p["block"], dt.decay_weights(p["block"] - 1, p["decay"])

    def loss_fn(model, hidden, tokens, anchors):
        logits = draft_logits(model, run.head, hidden, tokens, anchors, block)
        labels = dt.tokens_after(tokens, anchors, 1, block - 1)
        ce = nn.losses.cross_entropy(logits.astype(mx.float32), labels, reduction="none")
        return dt.weighted_mean(ce, weights)

    last = dt.train("dflash", args, p, model, loss_fn, run.data, block, block - 1)
    export(model, config, args.out)
    dt.write_card(args.out, "dflash", "a z-lab DFlash drafter", args, p, last, __doc__)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
