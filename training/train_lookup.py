"""Writes a token datastore for the `lookup` drafter: the target's own greedy continuations of
prompts drawn from a text, as `datastore.safetensors` (one tensor, `token_ids`: each example
after the target's `<bos>`, uint16 when the vocabulary fits, else uint32).

    python train_lookup.py --target ../models/kjv-gemma4 --out ../models/kjv-gemma4-lookup

Nothing is trained. Where the datastore holds a longer match of a request's trailing n-gram
than the request's own text, the drafter proposes its most frequent continuation there (REST,
He et al., 2023, "REST: Retrieval-Based Speculative Decoding"). REST looks continuations up in
a corpus; here, as every learned drafter learns from the target itself (self-distillation),
the datastore holds what the target wrote: its greedy continuations of short prompts taken at
evenly spaced places of the text. On the demo target that drafts far better than the corpus
itself (measured on the bench prompts, with n-grams of at most 4 tokens: 3.6 tokens per target
forward at four drafts, against 2.8 from the training text).

The default text is the training split of the demo corpus (no held-out chapter is in it);
`--text FILE` takes any UTF-8 text, documents separated by blank lines. Each batch of
continuations is kept in `--run`, so an interrupted run resumes where it stopped.
"""

import argparse
import hashlib
import json
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache
from tokenizers import Tokenizer
from tqdm import tqdm

import corpus
from drafter_data import load_float32_target
from drafter_train import refresh_target_card, shown

ROOT = Path(__file__).resolve().parent.parent

PRESETS = {
    # The demo datastore: 4096 continuations of 256 tokens. Twice as many barely raise τ on the
    # bench prompts and double the time the plugin takes to sort the datastore when it loads.
    "demo": dict(examples=4096, prefix=32, greedy=256, batch=256),
    # The smoke-test size.
    "tiny": dict(examples=8, prefix=8, greedy=8, batch=4),
}


def documents(text_file):
    if text_file is None:
        return [d["text"] for d in corpus.load("train")]
    text = Path(text_file).read_text(encoding="utf-8")
    return [d for d in text.split("\n\n") if d.strip()]


def text_stream(target: Path, docs) -> np.ndarray:
    """The documents in the target's token ids, each after `<bos>`."""
    tok = Tokenizer.from_file(str(target / "tokenizer.json"))
    bos = json.loads((target / "config.json").read_text())["bos_token_id"]
    ids = []
    for encoding in tok.encode_batch(docs, add_special_tokens=False):
        ids.append(bos)
        ids.extend(encoding.ids)
    return np.array(ids, dtype=np.int32)


def prompts(stream: np.ndarray, examples: int, prefix: int) -> np.ndarray:
    """`examples` windows of `prefix` tokens at evenly spaced places of the stream [examples, prefix]."""
    if len(stream) < prefix:
        raise SystemExit(f"the text is {len(stream)} tokens, shorter than one prompt of {prefix}")
    starts = np.linspace(0, len(stream) - prefix, examples).astype(np.int64)
    return np.stack([stream[s:s + prefix] for s in starts])


def continue_greedily(model, rows: np.ndarray, steps: int) -> np.ndarray:
    """The target's greedy continuations of `rows` [B, P]: [B, steps], all rows decoded together."""
    cache = make_prompt_cache(model)
    x = mx.array(rows)
    out = []
    for _ in range(steps):
        x = mx.argmax(model(x, cache=cache)[:, -1:], axis=-1).astype(mx.int32)
        mx.eval(x)
        out.append(x)
    return np.array(mx.concatenate(out, axis=1))


def kept_continuations(target: Path, rows: np.ndarray, p: dict, run: Path):
    """The target's continuations of `rows`, a batch at a time, each batch kept in a directory
    of `run` that belongs to this target, these prompts and this preset only; and the seconds
    the batches took to make, when they were made."""
    key = hashlib.sha256(rows.tobytes() + json.dumps(p, sort_keys=True).encode())
    for name in ("config.json", "model.safetensors"):
        key.update((target / name).read_bytes())
    run = run / key.hexdigest()[:16]
    run.mkdir(parents=True, exist_ok=True)
    model = load_float32_target(target)
    continuations, seconds = [], 0.0
    for b in tqdm(range(0, len(rows), p["batch"]), desc="continuations", unit="batch"):
        kept = run / f"batch-{b // p['batch']:04d}.npy"
        took = kept.with_suffix(".seconds")
        if not kept.exists():
            started = time.time()
            np.save(kept, continue_greedily(model, rows[b:b + p["batch"]], p["greedy"]))
            took.write_text(f"{time.time() - started:.1f}")
        continuations.append(np.load(kept))
        seconds += float(took.read_text()) if took.exists() else 0.0
    return np.concatenate(continuations), seconds


def datastore(prompt_rows: np.ndarray, continuations: np.ndarray, bos: int, eos) -> np.ndarray:
    """Each example after `<bos>`: its prompt, then its continuation up to its first end token."""
    ids = []
    for p, c in zip(prompt_rows, continuations):
        ends = np.flatnonzero(np.isin(c, eos))
        ids.append(bos)
        ids.extend(p.tolist())
        ids.extend(c[: ends[0] if len(ends) else len(c)].tolist())
    return np.array(ids)


def write_card(out: Path, target: Path, preset: str, p: dict, ids: np.ndarray, text_file, minutes: float) -> None:
    source = f"`{text_file}`" if text_file else "the training split of the demo corpus (`training/corpus.py`)"
    command = f"training/.venv/bin/python training/train_lookup.py --target {shown(target)} --out {shown(out)}"
    command += f" --text {text_file}" if text_file else ""
    recipe = ", ".join(f"{k} {v}" for k, v in p.items())
    (out / "README.md").write_text(f"""# {out.name}: a token datastore for the lookup drafter

The `lookup` plugin's artifact for [{target.name}](../{target.name}): the target's own greedy
continuations ({p['greedy']} tokens, cut at an end token) of {p['examples']} prompts of {p['prefix']} tokens
taken at evenly spaced places of {source},
each example after `<bos>`, in `datastore.safetensors`. No held-out chapter is in it.

Nothing is trained. Where the datastore holds a longer match of a request's trailing n-gram
than the request's own text, the drafter proposes its most frequent continuation there (REST,
He et al., 2023, "REST: Retrieval-Based Speculative Decoding"); the plugin sorts the
datastore's suffixes when it loads it. The continuations are the target's, not the corpus's
(self-distillation, as for the learned drafters): what the drafter must guess is what the
target writes.

- Recipe (preset `{preset}`): {recipe}.
- {len(ids)} token ids ({ids.dtype}), {ids.nbytes / 1e6:.1f} MB.
- Generation time on the 2-core machine that made it: {minutes:.1f} min (float32 target).
- Command (from the repository root): `{command}`

The speed-up it buys is measured by `make drafter-bench` (the demo target's model card and the
repository's docs/performance.md).
""")
    refresh_target_card(target)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", type=Path, default=ROOT / "models" / "kjv-gemma4")
    ap.add_argument("--out", type=Path, help="artifact directory (default: <target>-lookup)")
    ap.add_argument("--text", help="a UTF-8 text, documents separated by blank lines (default: the demo training split)")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="demo")
    ap.add_argument("--run", type=Path, help="where batches are kept (default: training/runs/lookup-<target>)")
    args = ap.parse_args()
    p = PRESETS[args.preset]
    out = args.out or args.target.with_name(args.target.name + "-lookup")
    run = args.run or ROOT / "training" / "runs" / f"lookup-{args.target.name}"
    config = json.loads((args.target / "config.json").read_text())
    eos = config["eos_token_id"] if isinstance(config["eos_token_id"], list) else [config["eos_token_id"]]

    rows = prompts(text_stream(args.target, documents(args.text)), p["examples"], p["prefix"])
    continuations, seconds = kept_continuations(args.target, rows, p, run)
    ids = datastore(rows, continuations, config["bos_token_id"], eos)
    ids = ids.astype(np.uint16 if config["vocab_size"] <= 1 << 16 else np.uint32)

    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "datastore.safetensors"), {"token_ids": mx.array(ids)})
    write_card(out, args.target, args.preset, p, ids, args.text, seconds / 60)
    print(f"{out / 'datastore.safetensors'}: {len(ids)} token ids from {len(rows)} continuations")


if __name__ == "__main__":
    main()
