"""Trains a Gemma 4 `-assistant` drafter (`gemma4_assistant`, the format of
google/gemma-4-*-it-assistant) for a Gemma 4 target and writes it as Hugging Face lays one out:
`config.json` (a `text_config` plus `backbone_hidden_size`) and `model.safetensors`.

    python train_assistant.py --target ../models/kjv-gemma4 --out ../models/kjv-gemma4-assistant

The assistant drafts one token per step. A step reads the target's scaled embedding of its
input token and a hidden state in the target's space (the target's own final hidden for the
first step, then the assistant's `post_projection` of its last one), projects them in, and runs
Gemma 4 layers whose attention is query-only over the target's K/V (the last sliding and the
last full layer that own a cache), every step querying at the pending token's position; the
head is its own tied embedding, served through a centroid head fitted after training
(fit_centroids.py) that scores only the likeliest groups of tokens. This is the network the
assistant plugin serves.

The objective is per-step prediction unrolled over a round, as Gemma 4's multi-token drafters
are trained (each step fed the true previous token and its own previous hidden, so the
recurrence is learned as it is used): per step, 0.1 × cross-entropy with the target's token
plus 0.9 × ½‖p_draft − p_target‖₁, weighted by exp(−k/4) over the steps, as for DSpark.
"""

import json
import shutil
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache
from tqdm import tqdm

import drafter_data
import drafter_train as dt
import loop

PRESETS = {
    "demo": dict(hidden=256, layers=2, heads=4, intermediate=512, steps_per_round=6,
                 steps=600, rows=12, anchors=16, lr=1e-3, warmup=60, decay=4.0),
    "tiny": dict(hidden=32, layers=2, heads=2, intermediate=64, steps_per_round=3, steps=8,
                 rows=4, anchors=4, lr=1e-3, warmup=2, decay=4.0),
}
SW, FA = "sliding_attention", "full_attention"


def draft_config(target: dict, p: dict) -> dict:
    """The assistant's config: a Gemma 4 text config whose attention geometry is the target's
    (it reads the target's K/V), one sliding and one full layer per pair."""
    text = dict(target)
    layer_types = [SW if i % 2 == 0 else FA for i in range(p["layers"])]
    text.update({
        "hidden_size": p["hidden"], "num_hidden_layers": p["layers"], "layer_types": layer_types,
        "num_attention_heads": p["heads"], "intermediate_size": p["intermediate"],
        "num_kv_shared_layers": p["layers"], "hidden_size_per_layer_input": 0,
        "vocab_size_per_layer_input": 0, "tie_word_embeddings": True, "dtype": "bfloat16",
    })
    text.pop("architectures", None)
    return {
        "architectures": ["Gemma4AssistantForCausalLM"],
        "backbone_hidden_size": target["hidden_size"],
        "dtype": "bfloat16",
        "model_type": "gemma4_assistant",
        "text_config": text,
        "tie_word_embeddings": True,
        "use_ordered_embeddings": False,
    }


class Attention(nn.Module):
    def __init__(self, d: int, heads: int, head_dim: int, eps: float):
        super().__init__()
        self.q_proj = nn.Linear(d, heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, d, bias=False)
        self.q_norm = nn.RMSNorm(head_dim, eps=eps)


class MLP(nn.Module):
    def __init__(self, d: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(d, intermediate, bias=False)
        self.up_proj = nn.Linear(d, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, d, bias=False)

    def __call__(self, x):
        return self.down_proj(nn.gelu_approx(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, d: int, heads: int, head_dim: int, intermediate: int, eps: float):
        super().__init__()
        self.self_attn = Attention(d, heads, head_dim, eps)
        self.mlp = MLP(d, intermediate)
        self.input_layernorm = nn.RMSNorm(d, eps=eps)
        self.post_attention_layernorm = nn.RMSNorm(d, eps=eps)
        self.pre_feedforward_layernorm = nn.RMSNorm(d, eps=eps)
        self.post_feedforward_layernorm = nn.RMSNorm(d, eps=eps)
        self.layer_scalar = mx.ones((1,))


class Inner(nn.Module):
    def __init__(self, text: dict):
        super().__init__()
        d, eps = text["hidden_size"], text["rms_norm_eps"]
        self.embed_tokens = nn.Embedding(text["vocab_size"], d)
        self.layers = [Layer(d, text["num_attention_heads"],
                             text["head_dim"] if t == SW else text["global_head_dim"],
                             text["intermediate_size"], eps) for t in text["layer_types"]]
        self.norm = nn.RMSNorm(d, eps=eps)


class Assistant(nn.Module):
    """Attribute names are the checkpoint's tensor names."""

    def __init__(self, config: dict):
        super().__init__()
        text, t = config["text_config"], config["backbone_hidden_size"]
        d = text["hidden_size"]
        self.pre_projection = nn.Linear(2 * t, d, bias=False)
        self.post_projection = nn.Linear(d, t, bias=False)
        self.model = Inner(text)


def inverse_frequencies(text: dict, layer_type: str) -> mx.array:
    """The target's RoPE for a layer type: full rotation on sliding layers, proportional
    (the first partial_rotary_factor of each head, frequencies over the whole head) on full."""
    rope = text["rope_parameters"][layer_type]
    hd = text["head_dim"] if layer_type == SW else text["global_head_dim"]
    rotated = int(rope.get("partial_rotary_factor", 1.0) * hd // 2)
    inv = 1.0 / (rope["rope_theta"] ** (mx.arange(0, 2 * rotated, 2, dtype=mx.float32) / hd))
    return mx.concatenate([inv, mx.zeros((hd // 2 - rotated,))])


def donor_layers(target_model) -> dict:
    """The target layers whose K/V the assistant reads: the last sliding and the last full
    layer among those that own a cache."""
    inner = target_model.model
    owned = len(inner.layers) - target_model.args.num_kv_shared_layers
    return {t: max(i for i in range(owned) if inner.layers[i].layer_type == t) for t in (SW, FA)}


def build_donors(target_dir: Path, data: drafter_data.DrafterData, store: Path,
                 batch: int = 128):
    """The target's cached K/V of the donor layers for every example, float16:
    {layer type: (keys, values)}, each [N, kv heads, L, head dim]; kept in `store`."""
    if store.exists():
        z = np.load(store)
        return {t: (z[f"{t}.keys"], z[f"{t}.values"]) for t in (SW, FA)}
    model = drafter_data.load_float32_target(target_dir)
    layers = donor_layers(model)
    owned = len(model.model.layers) - model.args.num_kv_shared_layers
    out = {t: ([], []) for t in layers}
    for i in tqdm(range(0, len(data.tokens), batch), desc="donor K/V", unit="batch"):
        cache = [KVCache() for _ in range(owned)]
        drafter_data.forward_with_taps(model, mx.array(data.tokens[i:i + batch]), (), cache)
        for t, layer in layers.items():
            c = cache[layer]
            keys, values = c.keys[..., :c.offset, :], c.values[..., :c.offset, :]
            mx.eval(keys, values)
            out[t][0].append(np.array(keys.astype(mx.float16)))
            out[t][1].append(np.array(values.astype(mx.float16)))
    donors = {t: (np.concatenate(k), np.concatenate(v)) for t, (k, v) in out.items()}
    tmp = store.with_suffix(".tmp.npz")
    np.savez(tmp, **{f"{t}.{n}": a for t, kv in donors.items() for n, a in zip(("keys", "values"), kv)})
    tmp.replace(store)
    return donors


def round_logits(model: Assistant, config: dict, head: dt.TargetHead, final_hidden: mx.array,
                 tokens: mx.array, anchors: mx.array, donors: dict, steps: int):
    """The assistant's logits [B, A, steps, V] for a round at every anchor p: step k reads
    token p+k and predicts token p+k+1; the first step's hidden is the target's at p−1."""
    out = []
    for h in round_hidden(model, config, head, final_hidden, tokens, anchors, donors, steps):
        logits = h @ model.model.embed_tokens.weight.T
        out.append(mx.tanh(logits / head.softcap) * head.softcap if head.softcap else logits)
    return mx.stack(out, axis=2)


def round_hidden(model: Assistant, config: dict, head: dt.TargetHead, final_hidden: mx.array,
                 tokens: mx.array, anchors: mx.array, donors: dict, steps: int):
    """What the head reads at each step of those rounds: the normed hidden [B, A, D] per step."""
    text = config["text_config"]
    b, a = anchors.shape
    length = tokens.shape[1]
    key = mx.arange(length)
    masks, freqs = {}, {}
    for t in (SW, FA):
        visible = key < anchors[:, :, None]                                 # [B, A, L]
        if t == SW:
            visible = visible & (anchors[:, :, None] - key <= text["sliding_window"] + 1)
        masks[t] = visible[:, None]                                         # [B, 1, A, L]
        freqs[t] = inverse_frequencies(text, t)
    hidden = dt.rows_after(final_hidden, anchors, -1, 1)[:, :, 0]           # [B, A, T]
    inputs = dt.tokens_after(tokens, anchors, 0, steps)                     # [B, A, steps]
    out = []
    for k in range(steps):
        embedded = head.embed[inputs[:, :, k]] * head.embed_scale
        h = model.pre_projection(mx.concatenate([embedded, hidden], axis=-1))
        for layer, t in zip(model.model.layers, text["layer_types"]):
            attn = layer.self_attn
            keys, values = donors[t]
            hd = keys.shape[-1]
            q = attn.q_proj(layer.input_layernorm(h)).reshape(b, a, -1, hd)
            q = dt.rope(attn.q_norm(q).transpose(0, 2, 1, 3), anchors, freqs[t])
            o = mx.fast.scaled_dot_product_attention(q, keys, values, scale=1.0, mask=masks[t])
            o = attn.o_proj(o.transpose(0, 2, 1, 3).reshape(b, a, -1))
            h = h + layer.post_attention_layernorm(o)
            h = h + layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(h)))
            h = h * layer.layer_scalar
        h = model.model.norm(h)
        out.append(h)
        hidden = model.post_projection(h)
    return out


def export(model: Assistant, config: dict, out: Path) -> None:
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    weights = {k: v.astype(mx.bfloat16) for k, v in tree_flatten(model.parameters())}
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def main() -> None:
    run = dt.Run("assistant", PRESETS, __doc__)
    args, p, head = run.args, run.p, run.head
    cache_dir = args.data or drafter_data.HERE / "runs" / "drafter-data"
    key = drafter_data.cache_key(args.target, run.data.spec)
    donors = loop.leader_first(
        lambda: build_donors(args.target, run.data, cache_dir / f"{key}-donors.npz"))
    config = draft_config(run.target, p)
    mx.random.seed(args.seed)
    model = Assistant(config)
    if p["hidden"] == run.target["hidden_size"]:
        # The same width: start the head from the target's embedding.
        model.model.embed_tokens.weight = head.embed + 0
    mx.eval(model.parameters())
    steps, weights = p["steps_per_round"], dt.decay_weights(p["steps_per_round"], p["decay"])

    def donors_of(idx):
        return [mx.array(donors[t][j][idx]).astype(mx.float32) for t in (SW, FA) for j in (0, 1)]

    def loss_fn(model, hidden, tokens, anchors, ks, vs, kf, vf):
        final = mx.fast.rms_norm(run.last_layer(hidden), head.norm_weight, head.eps)
        logits = round_logits(model, config, head, final, tokens, anchors,
                              {SW: (ks, vs), FA: (kf, vf)}, steps)
        return dt.dspark_objective(logits, dt.tokens_after(tokens, anchors, 1, steps),
                                   run.p_target(hidden, anchors, steps), None, weights)

    last = dt.train("assistant", args, p, model, loss_fn, run.data, steps + 1, steps,
                    extra=donors_of)
    export(model, config, args.out)
    import fit_centroids  # it builds on this module
    centroid = fit_centroids.PRESETS[args.preset]
    figures = fit_centroids.add_centroid_head(run, model, config, donors, args.out, centroid,
                                              centroid["steps"], args.seed)
    dt.write_card(args.out, "assistant", "a Gemma 4 assistant drafter", args, p, last, __doc__)
    fit_centroids.add_card_section(args.out, fit_centroids.card_section(figures, args.preset))
    dt.refresh_target_card(args.target)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
