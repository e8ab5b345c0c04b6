"""Trains a DeepSeek DSpark drafter (`Gemma4DSparkModel`, the format of
deepseek-ai/dspark_gemma4_12b_block7) for a Gemma 4 target, with dspark-mlx 0.1.0's own model
class, and writes it as DeepSpec saves one: the target's text config with the drafter's fields,
and `model.safetensors` without a prefix.

    python train_deepspec.py --target ../models/kjv-gemma4 --out ../models/kjv-gemma4-deepspec

The objective is DeepSpec's DSpark recipe (deepseek-ai/DeepSpec, `config/dspark/
dspark_gemma4_12b.py`; the DSpark paper, arXiv:2607.05147): the block is [anchor, mask, …] and
row k predicts token p+k+1 (the anchor row drafts too); the Markov head adds W2·W1[x_{k−1}] to
row k, fed the true previous token while training; each row's loss is 0.1 × cross-entropy with
the target's token plus 0.9 × ½‖p_draft − p_target‖₁, weighted by exp(−k/4); the confidence head
learns 1 − ½‖p_draft − p_target‖₁ (the chance the row is accepted) with binary cross-entropy.
p_target comes from the target's last layer, which is one of the taps. The embedding and head
are copies of the target's and stay frozen, as DeepSpec keeps them.
"""

import json
import shutil
from pathlib import Path

import mlx.core as mx
from dspark_mlx.arch.gemma4 import Gemma4DSparkArgs, Gemma4DSparkDrafter
from mlx.utils import tree_flatten

import drafter_train as dt
import tokenizer as tk

PRESETS = {
    # The demo drafter: two layers at the target's width and attention geometry, eight drafts.
    "demo": dict(layers=2, intermediate=512, block=8, markov_rank=64, steps=600, rows=12,
                 anchors=16, lr=1e-3, warmup=60, decay=4.0),
    "tiny": dict(layers=1, intermediate=64, block=4, markov_rank=8, steps=8, rows=4, anchors=4,
                 lr=1e-3, warmup=2, decay=4.0),
}


def draft_config(target: dict, p: dict, taps) -> dict:
    """The target's text config with DeepSpec's drafter fields, as its `build_draft_config`
    writes one: full attention, K = V, own embedding and head (untied)."""
    c = dict(target)
    c.update({
        "architectures": ["Gemma4DSparkModel"],
        "target_model_type": "gemma4",
        "target_text_model_type": target["model_type"],
        "num_hidden_layers": p["layers"],
        "layer_types": ["full_attention"] * p["layers"],
        "intermediate_size": p["intermediate"],
        "attention_k_eq_v": True,
        "hidden_size_per_layer_input": 0,
        "num_kv_shared_layers": 0,
        "enable_moe_block": False,
        "tie_word_embeddings": False,
        "block_size": p["block"],
        "mask_token_id": tk.MASK_ID,
        "target_layer_ids": list(taps),
        "num_target_layers": target["num_hidden_layers"],
        "markov_rank": p["markov_rank"],
        "markov_head_type": "vanilla",
        "enable_confidence_head": True,
        "confidence_head_with_markov": True,
        "dtype": "bfloat16",
    })
    return c


def build(config: dict, head: dt.TargetHead, seed: int) -> Gemma4DSparkDrafter:
    """dspark-mlx's drafter with the target's embedding and head, frozen; the Markov head's
    output starts at zero so that training starts from the backbone alone."""
    mx.random.seed(seed)
    model = Gemma4DSparkDrafter(Gemma4DSparkArgs.from_dict(config))
    # Copies: the trainer's head keeps its own (arrays shared with the model would enter the
    # compiled step both as model state and as constants).
    model.embed_tokens.weight = head.embed + 0
    model.lm_head.weight = head.embed + 0
    model.markov_head.markov_w2.weight = mx.zeros_like(model.markov_head.markov_w2.weight)
    model.embed_tokens.freeze()
    model.lm_head.freeze()
    mx.eval(model.parameters())
    model.train()
    return model


def block_forward(model: Gemma4DSparkDrafter, hidden: mx.array, tokens: mx.array,
                  anchors: mx.array):
    """Base logits [B, A, block, V] and final hidden states [B, A, block, H] of every anchor's
    block in one pass: dspark-mlx's layers, with a mask in place of its per-block context."""
    a = model.args
    b, length, _ = hidden.shape
    block, n = a.block_size, anchors.shape[1] * a.block_size
    ids = dt.block_inputs(tokens, anchors, block, a.mask_token_id)
    h = model._embed(ids)
    ctx = model.backbone.project_context(hidden)
    rotated = int(a.partial_rotary_factor * a.head_dim // 2)
    inv_freq = mx.concatenate([
        1.0 / (a.rope_theta ** (mx.arange(0, 2 * rotated, 2, dtype=mx.float32) / a.head_dim)),
        mx.zeros((a.head_dim // 2 - rotated,))])
    q_pos = dt.block_positions(anchors, block)
    k_pos = mx.broadcast_to(mx.arange(length)[None], (b, length))
    mask = dt.block_mask(anchors, length, block)
    for layer in model.backbone.layers:
        attn = layer.self_attn

        def heads(t, count):
            return t.reshape(b, t.shape[1], count, attn.hd)
        x = layer.input_layernorm(h)
        q = dt.rope(attn.q_norm(heads(attn.q_proj(x), attn.nh)).transpose(0, 2, 1, 3), q_pos,
                    inv_freq)
        kv = [attn.k_proj(ctx), attn.k_proj(x)]
        vv = kv if attn.k_eq_v else [attn.v_proj(ctx), attn.v_proj(x)]
        k = [dt.rope(attn.k_norm(heads(t, attn.nkv)).transpose(0, 2, 1, 3), pos, inv_freq)
             for t, pos in zip(kv, (k_pos, q_pos))]
        v = [attn.v_norm(heads(t, attn.nkv)).transpose(0, 2, 1, 3) for t in vv]
        out = mx.fast.scaled_dot_product_attention(
            q, mx.concatenate(k, axis=2), mx.concatenate(v, axis=2), scale=1.0, mask=mask)
        out = attn.o_proj(out.transpose(0, 2, 1, 3).reshape(b, n, -1))
        h = h + layer.post_attention_layernorm(out)
        h = h + layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(h)))
        h = h * layer.layer_scalar
    h = model.backbone.norm(h)
    logits = model._softcap(model.lm_head(h.astype(mx.float32)))
    shape = (b, anchors.shape[1], block)
    return logits.reshape(*shape, -1), h.reshape(*shape, -1)


def export(model: Gemma4DSparkDrafter, config: dict, out: Path) -> None:
    """DeepSpec's tensor names: the backbone's without its prefix."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    weights = {k.removeprefix("backbone."): v.astype(mx.bfloat16)
               for k, v in tree_flatten(model.parameters())}
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def main() -> None:
    run = dt.Run("deepspec", PRESETS, __doc__)
    args, p = run.args, run.p
    config = draft_config(run.target, p, run.taps)
    model = build(config, run.head, args.seed)
    block, weights = p["block"], dt.decay_weights(p["block"], p["decay"])

    def loss_fn(model, hidden, tokens, anchors):
        logits, h = block_forward(model, hidden, tokens, anchors)
        prev = dt.tokens_after(tokens, anchors, 0, block)                 # x_{p+k}
        labels = dt.tokens_after(tokens, anchors, 1, block)               # x_{p+k+1}
        bias, markov_embed = model.markov_head(prev)
        return dt.dspark_objective(logits + bias, labels, run.p_target(hidden, anchors, block),
                                   model.confidence_head(h, markov_embed), weights)

    last = dt.train("deepspec", args, p, model, loss_fn, run.data, block + 1, block)
    export(model, config, args.out)
    dt.write_card(args.out, "deepspec", "a DeepSeek DSpark drafter (Gemma4DSparkModel)", args, p,
                  last, __doc__)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
