"""The training signal every drafter learns from: the target's own greedy continuations of
training text, its hidden states along them, and its next-token distributions.

A drafter is right when it proposes what the target would emit next, so its labels are the
target's greedy tokens, not the corpus's (self-distillation, as EAGLE and DFlash train on
target-generated responses). Each example is `prefix` tokens of training text followed by
`greedy` tokens the target chose itself; drafters take their anchors in the greedy part, where
every next token is the target's argmax given all the tokens before it.

The examples and the tapped hidden states (the outputs of the decoder layers `taps`, before the
final norm: what the host hands a drafter) are cached in `runs/drafter-data/` under a key made
of the target's weights and the settings, since every drafter kind reads the same ones.

A trainer of a new drafter kind imports this module (with `training/` on `sys.path`, run by
`training/.venv/bin/python`) and reads:

    spec = DataSpec(taps=(1, 3, 5))                     # the last layer among them
    data = build(target_dir, spec)                      # made once, then read from the cache
    data.tokens                                         # [N, prefix + greedy] int32
    data.hidden                                         # [N, prefix + greedy, len(taps) * H] float16
    head = TargetHead(target_dir)
    p = head.distribution(data.tap(hidden, 5))          # [..., V]: the target's next token at
                                                        # each position, from its last layer

`data.batches(...)` draws seeded training batches of examples and anchor positions.
`host new-drafter NAME --trainable` writes a trainer that does this.
"""
import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import mlx.core as mx
import numpy as np
from mlx_lm import load as load_target
from mlx_lm.models.cache import make_prompt_cache
from tqdm import tqdm

import corpus
import tokenizer as tk

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class DataSpec:
    examples: int = 3072       # sequences
    prefix: int = 64           # training-text tokens each sequence starts with
    greedy: int = 96           # target-chosen tokens after them
    taps: Sequence[int] = (1, 3, 5)
    seed: int = 0
    batch: int = 256           # rows generated at once


def load_float32_target(target_dir: Path):
    """The target (mlx-lm's own class) in float32: CPU matmuls are fastest in float32, and the
    hidden states differ from the bfloat16 the host runs in by rounding only."""
    model, _ = load_target(str(target_dir))
    model.set_dtype(mx.float32)
    model.eval()
    mx.eval(model.parameters())
    return model


class TargetHead:
    """The target's frozen embedding, final norm and soft-capped tied head."""

    def __init__(self, target_dir: Path):
        model = load_float32_target(target_dir)
        inner = model.model
        self.embed = mx.stop_gradient(inner.embed_tokens.weight)      # [V, H]
        self.embed_scale = float(inner.embed_scale)
        self.norm_weight = mx.stop_gradient(inner.norm.weight)
        self.eps = inner.norm.eps
        self.softcap = float(model.final_logit_softcapping or 0.0)

    def logits(self, h: mx.array) -> mx.array:
        """The head on hidden states that are already normed."""
        logits = h @ self.embed.T
        return mx.tanh(logits / self.softcap) * self.softcap if self.softcap else logits

    def distribution(self, last_layer: mx.array) -> mx.array:
        """The target's next-token probabilities from its last layer's output (a tap)."""
        h = mx.fast.rms_norm(last_layer, self.norm_weight, self.eps)
        return mx.softmax(self.logits(h).astype(mx.float32), axis=-1)


def forward_with_taps(model, inputs: mx.array, taps: Sequence[int], cache=None):
    """Logits [B, L, V] and the outputs of decoder layers `taps` [B, L, H] each, for token ids
    [B, L] (after what `cache` holds, if given): mlx-lm's Gemma 4 forward, one layer at a time
    so that the layers' outputs can be kept."""
    inner = model.model
    h = inner.embed_tokens(inputs) * inner.embed_scale
    per_layer = None
    if inner.hidden_size_per_layer_input:
        per_layer = inner._project_per_layer_inputs(h, inner._get_per_layer_inputs(inputs))
    cache = (cache or []) + [None] * (len(inner.layers) - len(cache or []))
    masks = inner._make_masks(h, cache)
    shared = [(None, None)] * len(inner.layers)
    kept = {}
    for i, layer in enumerate(inner.layers):
        kvs, offset = shared[inner.previous_kvs[i]]
        h, kvs, offset = layer(h, masks[i], cache[i],
                               per_layer_input=None if per_layer is None else per_layer[:, :, i],
                               shared_kv=kvs, offset=offset)
        shared[i] = (kvs, offset)
        if i in taps:
            kept[i] = h
    logits = inner.embed_tokens.as_linear(inner.norm(h))
    cap = model.final_logit_softcapping
    if cap:
        logits = mx.tanh(logits / cap) * cap
    return logits, [kept[i] for i in taps]


def greedy_continuations(model, prompts: np.ndarray, steps: int, taps: Sequence[int]):
    """The rows of `prompts` [B, P] followed by `steps` greedy tokens each [B, P + steps], and
    the tapped hidden states of every position [B, P + steps, len(taps) * H] (float16); all
    rows decoded together."""
    cache = make_prompt_cache(model)
    inputs, hidden, out = mx.array(prompts), [], [mx.array(prompts)]
    for _ in range(steps):
        logits, h = forward_with_taps(model, inputs, taps, cache)
        inputs = mx.argmax(logits[:, -1:], axis=-1).astype(mx.int32)
        hidden.append(mx.concatenate(h, axis=-1).astype(mx.float16))
        out.append(inputs)
        mx.eval(inputs, hidden[-1])
    # The last token's hidden states come from one more step.
    _, h = forward_with_taps(model, inputs, taps, cache)
    hidden.append(mx.concatenate(h, axis=-1).astype(mx.float16))
    return np.array(mx.concatenate(out, axis=1)), np.array(mx.concatenate(hidden, axis=1))


def training_stream(target_dir: Path) -> np.ndarray:
    """The training split as the target's tokenizer reads it, documents between <bos> and <eos>."""
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(target_dir / "tokenizer.json"))
    ids: List[int] = []
    for doc in corpus.load("train"):
        ids.append(tk.BOS_ID)
        ids.extend(tok.encode(doc["text"], add_special_tokens=False).ids)
        ids.append(tk.EOS_ID)
    return np.array(ids, dtype=np.int32)


def cache_key(target_dir: Path, spec: DataSpec) -> str:
    h = hashlib.sha256()
    for name in ("config.json", "model.safetensors"):
        h.update((target_dir / name).read_bytes())
    h.update(json.dumps(asdict(spec), sort_keys=True).encode())
    return h.hexdigest()[:16]


@dataclass
class DrafterData:
    tokens: np.ndarray   # [N, prefix + greedy] int32
    hidden: np.ndarray   # [N, prefix + greedy, len(taps) * H] float16, taps concatenated
    spec: DataSpec

    def tap(self, hidden, layer: int):
        """Decoder layer `layer`'s output (one of the spec's taps) from hidden states whose last
        axis holds the taps concatenated, as `hidden` and the batches do."""
        if layer not in self.spec.taps:
            raise ValueError(f"layer {layer} is not tapped: the data holds layers {tuple(self.spec.taps)}")
        width = hidden.shape[-1] // len(self.spec.taps)
        at = list(self.spec.taps).index(layer) * width
        return hidden[..., at:at + width]

    def anchors(self, block: int) -> range:
        """Positions p that can anchor a block of `block` rows: the block's labels, tokens
        p+1 .. p+block-1, all lie in the greedy part, and so does the anchor."""
        start = self.spec.prefix
        return range(start, self.tokens.shape[1] - block + 1)

    def draw(self, step: int, rows: int, anchors: int, block: int, seed: int):
        """The examples and anchors of a step, from (seed, step) only: `rows` example indices
        and `anchors` distinct anchor positions per row [rows, anchors]."""
        rng = np.random.default_rng([seed, step])
        idx = rng.choice(len(self.tokens), size=rows, replace=False)
        positions = np.array(self.anchors(block))
        picks = np.stack([np.sort(rng.choice(positions, size=anchors, replace=False))
                          for _ in range(rows)])
        return idx, picks.astype(np.int32)

    def batches(self, rows: int, anchors: int, block: int, seed: int, extra=None):
        """The batch of a step: the drawn examples' tapped hidden states [rows, L, taps·H]
        (float32), tokens [rows, L] and anchors [rows, anchors], then `extra(indices)`."""
        def at(step: int):
            idx, picks = self.draw(step, rows, anchors, block, seed)
            batch = (mx.array(self.hidden[idx]).astype(mx.float32), mx.array(self.tokens[idx]),
                     mx.array(picks))
            return batch + (tuple(extra(idx)) if extra else ())
        return at


def build(target_dir: Path, spec: DataSpec, cache_dir: Optional[Path] = None) -> DrafterData:
    """The examples for `target_dir`, from the cache when they were made before."""
    cache_dir = cache_dir or HERE / "runs" / "drafter-data"
    path = cache_dir / f"{cache_key(target_dir, spec)}.npz"
    if path.exists():
        z = np.load(path)
        return DrafterData(z["tokens"], z["hidden"], spec)
    model = load_float32_target(target_dir)
    stream = training_stream(target_dir)
    rng = np.random.default_rng([spec.seed, 7])
    starts = rng.integers(0, len(stream) - spec.prefix, size=spec.examples)
    prompts = np.stack([stream[s:s + spec.prefix] for s in starts])
    tokens, hidden = [], []
    for i in tqdm(range(0, spec.examples, spec.batch), desc="drafter data", unit="batch"):
        seq, h = greedy_continuations(model, prompts[i:i + spec.batch], spec.greedy, spec.taps)
        tokens.append(seq.astype(np.int32))
        hidden.append(h)
    data = DrafterData(np.concatenate(tokens), np.concatenate(hidden), spec)
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.npz")
    np.savez(tmp, tokens=data.tokens, hidden=data.hidden)
    tmp.replace(path)
    return data


def target_facts(target_dir: Path) -> Dict:
    """The target config keys a drafter's own config repeats."""
    return json.loads((target_dir / "config.json").read_text())
