#!/usr/bin/env python3
"""Tiny random Gemma 4 checkpoints in the real Hugging Face layout, with mlx-lm reference outputs.

Run from the repository root (after `bash tests/oracle/setup-venv.sh`):

    tests/oracle/.venv/bin/python tests/oracle/gemma4_oracle.py            # all fixtures
    tests/oracle/.venv/bin/python tests/oracle/gemma4_oracle.py --only dense moe
    tests/oracle/.venv/bin/python tests/oracle/gemma4_oracle.py --bench /tmp/gemma4-bench

Every fixture directory under tests/fixtures/gemma4/<name>/ holds a checkpoint as Hugging Face
(or, for `quant4`, mlx-lm's convert) writes it -- config.json, safetensors, tokenizer.json,
tokenizer_config.json -- plus oracle.safetensors and oracle.json with what mlx-lm computes for it.
The oracle is always computed from the directory as mlx-lm loads it (`mlx_lm.load`), and checked
against the same weights built in memory, so the on-disk format is proven to be what mlx-lm reads.
Everything is deterministic: fixed seeds, a fixed search order over seeds, a fixed corpus.
See tests/oracle/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional

# Nothing may come from the Hub: every path given to mlx-lm / transformers is a local directory.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import numpy as np  # noqa: E402
import mlx.core as mx  # noqa: E402
import mlx_lm  # noqa: E402
from mlx_lm import utils as mlu  # noqa: E402
from mlx_lm.generate import generate_step  # noqa: E402
from mlx_lm.models import gemma4_text  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "gemma4"

# --------------------------------------------------------------------------------------------
# Tokenizer: a small Gemma-style BPE (SentencePiece conventions: "▁" for spaces, byte fallback,
# <bos> prepended), trained with `tokenizers` on public-domain text embedded below.
# --------------------------------------------------------------------------------------------

PAD_ID, EOS_ID, BOS_ID, UNK_ID = 0, 1, 2, 3
SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
END_OF_TURN_ID = 5

# Public domain: Lewis Carroll, "Alice's Adventures in Wonderland" (1865), chapter I (opening);
# Jane Austen, "Pride and Prejudice" (1813), chapter 1 (opening); Abraham Lincoln, the
# Gettysburg Address (1863).
CORPUS = """\
Alice was beginning to get very tired of sitting by her sister on the bank, and of having
nothing to do: once or twice she had peeped into the book her sister was reading, but it had
no pictures or conversations in it, "and what is the use of a book," thought Alice "without
pictures or conversations?"
So she was considering in her own mind (as well as she could, for the hot day made her feel
very sleepy and stupid), whether the pleasure of making a daisy-chain would be worth the
trouble of getting up and picking the daisies, when suddenly a White Rabbit with pink eyes ran
close by her.
There was nothing so very remarkable in that; nor did Alice think it so very much out of the
way to hear the Rabbit say to itself, "Oh dear! Oh dear! I shall be late!" (when she thought it
over afterwards, it occurred to her that she ought to have wondered at this, but at the time it
all seemed quite natural); but when the Rabbit actually took a watch out of its
waistcoat-pocket, and looked at it, and then hurried on, Alice started to her feet, for it
flashed across her mind that she had never before seen a rabbit with either a
waistcoat-pocket, or a watch to take out of it, and burning with curiosity, she ran across the
field after it, and fortunately was just in time to see it pop down a large rabbit-hole under
the hedge.
In another moment down went Alice after it, never once considering how in the world she was to
get out again.
The rabbit-hole went straight on like a tunnel for some way, and then dipped suddenly down, so
suddenly that Alice had not a moment to think about stopping herself before she found herself
falling down a very deep well.
Either the well was very deep, or she fell very slowly, for she had plenty of time as she went
down to look about her and to wonder what was going to happen next. First, she tried to look
down and make out what she was coming to, but it was too dark to see anything; then she looked
at the sides of the well, and noticed that they were filled with cupboards and book-shelves;
here and there she saw maps and pictures hung upon pegs.
It is a truth universally acknowledged, that a single man in possession of a good fortune, must
be in want of a wife.
However little known the feelings or views of such a man may be on his first entering a
neighbourhood, this truth is so well fixed in the minds of the surrounding families, that he is
considered the rightful property of some one or other of their daughters.
"My dear Mr. Bennet," said his lady to him one day, "have you heard that Netherfield Park is
let at last?"
Mr. Bennet replied that he had not.
"But it is," returned she; "for Mrs. Long has just been here, and she told me all about it."
Mr. Bennet made no answer.
"Do you not want to know who has taken it?" cried his wife impatiently.
"You want to tell me, and I have no objection to hearing it."
This was invitation enough.
Four score and seven years ago our fathers brought forth on this continent, a new nation,
conceived in Liberty, and dedicated to the proposition that all men are created equal.
Now we are engaged in a great civil war, testing whether that nation, or any nation so
conceived and so dedicated, can long endure. We are met on a great battle-field of that war. We
have come to dedicate a portion of that field, as a final resting place for those who here gave
their lives that that nation might live. It is altogether fitting and proper that we should do
this.
But, in a larger sense, we can not dedicate -- we can not consecrate -- we can not hallow --
this ground. The brave men, living and dead, who struggled here, have consecrated it, far above
our poor power to add or detract. The world will little note, nor long remember what we say
here, but it can never forget what they did here. It is for us the living, rather, to be
dedicated here to the unfinished work which they who fought here have thus far so nobly
advanced. It is rather for us to be here dedicated to the great task remaining before us --
that from these honored dead we take increased devotion to that cause for which they gave the
last full measure of devotion -- that we here highly resolve that these dead shall not have
died in vain -- that this nation, under God, shall have a new birth of freedom -- and that
government of the people, by the people, for the people, shall not perish from the earth.
"""


def build_tokenizer(vocab_size: int):
    """A BPE tokenizer with exactly `vocab_size` ids: specials, 256 byte-fallback pieces, BPE."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from tokenizers import processors, trainers

    n_fixed = len(SPECIAL_TOKENS) + 256
    if vocab_size <= n_fixed + 64:
        raise ValueError(f"vocab_size {vocab_size} too small for a byte-fallback BPE")

    normalizer = normalizers.Replace(" ", "▁")
    pre_tokenizer = pre_tokenizers.Split(Regex("▁"), behavior="merged_with_next")

    # 1. Train the merges (with the same normalizer/pre-tokenizer) for the non-fixed part.
    trainee = Tokenizer(models.BPE(unk_token="<unk>"))
    trainee.normalizer = normalizer
    trainee.pre_tokenizer = pre_tokenizer
    lines = [ln.strip() for ln in CORPUS.splitlines() if ln.strip()]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - n_fixed, special_tokens=[],
                                  show_progress=False, min_frequency=2)
    trainee.train_from_iterator(lines, trainer=trainer)
    trained = json.loads(trainee.to_str())["model"]
    trained_vocab = sorted(trained["vocab"].items(), key=lambda kv: kv[1])
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in trained["merges"]]

    # 2. Lay out the final vocabulary as Gemma does: specials first, then <0xNN> byte pieces.
    vocab: Dict[str, int] = {}
    for tok in SPECIAL_TOKENS:
        vocab[tok] = len(vocab)
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for tok, _ in trained_vocab:
        if tok not in vocab:
            vocab[tok] = len(vocab)
    n_unused = 0
    while len(vocab) < vocab_size:  # only if the corpus ran out of merges
        vocab[f"<unused{n_unused}>"] = len(vocab)
        n_unused += 1
    assert len(vocab) == vocab_size, (len(vocab), vocab_size)

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True,
                               fuse_unk=True))
    tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse()])
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A <bos> $B", special_tokens=[("<bos>", BOS_ID)])
    from tokenizers import AddedToken
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    for t, i in zip(SPECIAL_TOKENS, range(len(SPECIAL_TOKENS))):
        assert tok.token_to_id(t) == i
    assert tok.get_vocab_size() == vocab_size
    return tok


def tokenizer_config_json(max_len: int = 131072) -> Dict[str, Any]:
    added = {
        str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                 "single_word": False, "special": True}
        for i, t in enumerate(SPECIAL_TOKENS)
    }
    return {
        "add_bos_token": True,
        "add_eos_token": False,
        "added_tokens_decoder": added,
        "bos_token": "<bos>",
        "clean_up_tokenization_spaces": False,
        "eos_token": "<eos>",
        "model_max_length": max_len,
        "pad_token": "<pad>",
        "padding_side": "left",
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": "<unk>",
    }


def write_tokenizer(tok, out: Path) -> None:
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config_json(), indent=2) + "\n")


# --------------------------------------------------------------------------------------------
# Configs, as the released Gemma 4 checkpoints write them (text keys of Gemma4TextConfig, with
# `global_head_dim` / `num_global_key_value_heads` spelled out as mlx-lm reads them).
# --------------------------------------------------------------------------------------------


def text_config(*, vocab: int, hidden: int, layer_types: List[str], heads: int, kv_heads: int,
                head_dim: int, global_head_dim: int, intermediate: int, window: int,
                dtype: str, ple: int = 0, kv_shared: int = 0, double_wide: bool = False,
                k_eq_v: bool = False, global_kv_heads: Optional[int] = None,
                moe: Optional[Dict[str, int]] = None, tie: bool = True, softcap: float = 30.0,
                full_rope_factor: float = 0.25, eos=EOS_ID) -> Dict[str, Any]:
    assert layer_types[-1] == "full_attention", "Gemma 4 ends on a full-attention layer"
    return {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attention_k_eq_v": k_eq_v,
        "bos_token_id": BOS_ID,
        "dtype": dtype,
        "enable_moe_block": moe is not None,
        "eos_token_id": eos,
        "final_logit_softcapping": softcap,
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
        "moe_intermediate_size": moe["moe_intermediate_size"] if moe else None,
        "num_attention_heads": heads,
        "num_experts": moe["num_experts"] if moe else None,
        "num_global_key_value_heads": global_kv_heads,
        "num_hidden_layers": len(layer_types),
        "num_key_value_heads": kv_heads,
        "num_kv_shared_layers": kv_shared,
        "pad_token_id": PAD_ID,
        "rms_norm_eps": 1e-06,
        "rope_parameters": {
            "full_attention": {"partial_rotary_factor": full_rope_factor,
                               "rope_theta": 1000000.0, "rope_type": "proportional"},
            "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
        },
        "sliding_window": window,
        "tie_word_embeddings": tie,
        "top_k_experts": moe["top_k_experts"] if moe else None,
        "use_bidirectional_attention": None,
        "use_cache": True,
        "use_double_wide_mlp": double_wide,
        "vocab_size": vocab,
        "vocab_size_per_layer_input": vocab,
    }


def full_config(tc: Dict[str, Any], nested: bool) -> Dict[str, Any]:
    if not nested:
        cfg = dict(tc)
        cfg["architectures"] = ["Gemma4ForCausalLM"]
        return dict(sorted(cfg.items()))
    # Gemma4ForConditionalGeneration without vision/audio towers. mlx-lm's gemma4.ModelArgs
    # copies the top-level `vocab_size` (default 262144) over text_config.vocab_size, so the
    # top level must carry it.
    return {
        "architectures": ["Gemma4ForConditionalGeneration"],
        "audio_config": None,
        "dtype": tc["dtype"],
        "eos_token_id": tc["eos_token_id"],
        "initializer_range": 0.02,
        "model_type": "gemma4",
        "pad_token_id": PAD_ID,
        "text_config": tc,
        "tie_word_embeddings": tc["tie_word_embeddings"],
        "vision_config": None,
        "vocab_size": tc["vocab_size"],
    }


GENERATION_CONFIG = {
    "bos_token_id": BOS_ID,
    "cache_implementation": "hybrid",
    "do_sample": True,
    "eos_token_id": [EOS_ID, END_OF_TURN_ID],
    "pad_token_id": PAD_ID,
    "temperature": 1.0,
    "top_k": 64,
    "top_p": 0.95,
}

# --------------------------------------------------------------------------------------------
# Random weights with the Hugging Face tensor names.
# --------------------------------------------------------------------------------------------


def hf_weights(tc: Dict[str, Any], prefix: str, seed: int, embed_std: float,
               lm_head_std: float, final_norm_scale: float,
               router_std: float = 8.0) -> Dict[str, np.ndarray]:
    """float32 numpy tensors named as transformers saves Gemma 4 (prefix 'model.' for
    Gemma4ForCausalLM, 'model.language_model.' for Gemma4ForConditionalGeneration)."""
    rng = np.random.default_rng(seed)
    H = tc["hidden_size"]
    L = tc["num_hidden_layers"]
    V = tc["vocab_size"]
    Hp = tc["hidden_size_per_layer_input"]
    first_shared = L - tc["num_kv_shared_layers"]
    w: Dict[str, np.ndarray] = {}

    def normal(shape, std):
        return (rng.standard_normal(shape) * std).astype(np.float32)

    def mat(out_dim, in_dim):  # fan-in scaled so activations stay O(1)
        return normal((out_dim, in_dim), in_dim ** -0.5)

    def norm(dim, spread=0.15):
        return (1.0 + rng.standard_normal(dim) * spread).astype(np.float32)

    w[prefix + "embed_tokens.weight"] = normal((V, H), embed_std)
    if Hp:
        w[prefix + "embed_tokens_per_layer.weight"] = normal(
            (tc["vocab_size_per_layer_input"], L * Hp), Hp ** -0.5)
        w[prefix + "per_layer_model_projection.weight"] = mat(L * Hp, H)
        w[prefix + "per_layer_projection_norm.weight"] = norm(Hp)
    for i, lt in enumerate(tc["layer_types"]):
        p = f"{prefix}layers.{i}."
        full = lt == "full_attention"
        hd = tc["global_head_dim"] if full and tc["global_head_dim"] else tc["head_dim"]
        k_eq_v = tc["attention_k_eq_v"] and full
        nkv = tc["num_key_value_heads"]
        if k_eq_v and tc["num_global_key_value_heads"] is not None:
            nkv = tc["num_global_key_value_heads"]
        nh = tc["num_attention_heads"]
        for n in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                  "post_feedforward_layernorm"):
            w[p + n + ".weight"] = norm(H)
        w[p + "self_attn.q_proj.weight"] = mat(nh * hd, H)
        w[p + "self_attn.q_norm.weight"] = norm(hd)
        if i < first_shared:  # transformers creates no K/V weights on KV-shared layers
            w[p + "self_attn.k_proj.weight"] = mat(nkv * hd, H)
            w[p + "self_attn.k_norm.weight"] = norm(hd)
            if not k_eq_v:
                w[p + "self_attn.v_proj.weight"] = mat(nkv * hd, H)
        w[p + "self_attn.o_proj.weight"] = mat(H, nh * hd)
        inter = tc["intermediate_size"]
        if tc["use_double_wide_mlp"] and i >= first_shared > 0:
            inter *= 2
        w[p + "mlp.gate_proj.weight"] = mat(inter, H)
        w[p + "mlp.up_proj.weight"] = mat(inter, H)
        w[p + "mlp.down_proj.weight"] = mat(H, inter)
        if tc["enable_moe_block"]:
            E, Im = tc["num_experts"], tc["moe_intermediate_size"]
            # A decisive router: expert scores O(1), their gaps well beyond float noise.
            w[p + "router.proj.weight"] = normal((E, H), router_std * H ** -0.5)
            w[p + "router.scale"] = norm(H, 0.2)
            w[p + "router.per_expert_scale"] = rng.uniform(0.5, 1.5, E).astype(np.float32)
            w[p + "experts.gate_up_proj"] = normal((E, 2 * Im, H), H ** -0.5)
            w[p + "experts.down_proj"] = normal((E, H, Im), Im ** -0.5)
            for n in ("pre_feedforward_layernorm_2", "post_feedforward_layernorm_1",
                      "post_feedforward_layernorm_2"):
                w[p + n + ".weight"] = norm(H)
        if Hp:
            w[p + "per_layer_input_gate.weight"] = mat(Hp, H)
            w[p + "per_layer_projection.weight"] = mat(H, Hp)
            w[p + "post_per_layer_input_norm.weight"] = norm(H)
        w[p + "layer_scalar"] = rng.uniform(0.6, 1.4, (1,)).astype(np.float32)
    # The final norm sets the logit scale (argmax-invariant): real-sized logits, clear margins.
    w[prefix + "norm.weight"] = norm(H) * final_norm_scale
    if not tc["tie_word_embeddings"]:
        w["lm_head.weight"] = normal((V, H), lm_head_std)
    return w


def to_mx(weights: Dict[str, np.ndarray], dtype: str) -> Dict[str, mx.array]:
    dt = getattr(mx, dtype)
    return {k: mx.array(v).astype(dt) for k, v in weights.items()}


def write_safetensors(out: Path, weights: Dict[str, mx.array], shards: int) -> None:
    names = list(weights)
    if shards == 1:
        mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "pt"})
        return
    # Split by cumulative bytes, keeping key order (embeddings first, then layers, ...).
    total = sum(weights[n].nbytes for n in names)
    weight_map, groups, acc = {}, [[] for _ in range(shards)], 0
    for n in names:
        groups[min(shards - 1, acc * shards // total)].append(n)
        acc += weights[n].nbytes
    for s, group in enumerate(groups):
        assert group, "empty shard"
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        mx.save_safetensors(str(out / fname), {n: weights[n] for n in group},
                            metadata={"format": "pt"})
        for n in group:
            weight_map[n] = fname
    index = {"metadata": {"total_size": total},
             "weight_map": {k: weight_map[k] for k in sorted(weight_map)}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


# --------------------------------------------------------------------------------------------
# mlx-lm side.
# --------------------------------------------------------------------------------------------


def build_in_memory(config: Dict[str, Any], weights: Dict[str, mx.array],
                    quantize: Optional[Dict[str, int]] = None):
    """The model mlx-lm's loader would build, from in-memory HF-named weights."""
    config = copy.deepcopy(config)
    model_cls, args_cls = mlu._get_classes(config)
    model = model_cls(args_cls.from_dict(config))
    sanitized = model.sanitize(dict(weights))
    model.eval()
    model.load_weights(list(sanitized.items()), strict=True)
    if quantize:
        with contextlib.redirect_stdout(io.StringIO()):  # its "[INFO] Quantized ..." line
            model, _ = mlu.quantize_model(model, config, quantize["group_size"],
                                          quantize["bits"], mode="affine")
    mx.eval(model.parameters())
    return model


@contextlib.contextmanager
def quantized_products_in_float32():
    """MLX's quantized products with the activations, scales and biases widened to float32 and
    the result rounded back once: how MLX's Metal and CUDA kernels sum them (float accumulators)
    and how the host sums them on the CPU. MLX's CPU kernel instead rounds to the activation
    dtype after every multiply and add, one weight at a time."""
    original = mx.quantized_matmul

    def in_float32(x, w, scales, biases=None, **kwargs):
        f32 = lambda a: None if a is None else a.astype(mx.float32)  # noqa: E731
        return original(f32(x), w, f32(scales), f32(biases), **kwargs).astype(x.dtype)

    mx.quantized_matmul = in_float32
    try:
        yield
    finally:
        mx.quantized_matmul = original


ROUTER_GAPS: List[float] = []
_RECORD_ROUTER = [False]
_router_call = gemma4_text.Router.__call__


def _router_call_recording(self, x):
    out = _router_call(self, x)
    if _RECORD_ROUTER[0]:
        k = self.config.top_k_experts
        xs = mx.fast.rms_norm(x, self.scale * self._root_size, self.eps)
        s = mx.sort(self.proj(xs).astype(mx.float32), axis=-1)
        ROUTER_GAPS.append(float(mx.min(s[..., -k] - s[..., -k - 1]).item()))
    return out


gemma4_text.Router.__call__ = _router_call_recording


class Rejected(Exception):
    """A candidate seed failed an acceptance check part-way through its greedy run."""


def greedy_oracle(model, prompt_ids: List[int], n_tokens: int,
                  min_margin: Optional[float] = None) -> Dict[str, np.ndarray]:
    """Prompt forward from an empty cache, then n_tokens greedy steps (EOS does not stop).

    With min_margin, raises Rejected as soon as a selecting row's top-1/top-2 gap is smaller
    (the seed search uses this to skip candidates early)."""
    cache = make_prompt_cache(model)
    logits = model(mx.array(prompt_ids, dtype=mx.int32)[None], cache=cache)
    prompt_logits = logits[0].astype(mx.float32)
    mx.eval(prompt_logits)
    rows = [np.array(prompt_logits[-1])]
    tokens: List[int] = []
    for i in range(n_tokens):
        if min_margin is not None and top2_margins(rows[-1][None])[0] < min_margin:
            raise Rejected(f"margin at step {i}")
        tok = int(np.argmax(rows[-1]))
        tokens.append(tok)
        if i == n_tokens - 1:
            break
        out = model(mx.array([[tok]], dtype=mx.int32), cache=cache)
        row = out[0, -1].astype(mx.float32)
        mx.eval(row)
        rows.append(np.array(row))
    token_logits = np.stack(rows)
    return {
        "prompt_ids": np.array(prompt_ids, dtype=np.int32),
        "prompt_logits": np.array(prompt_logits),
        "tokens": np.array(tokens, dtype=np.int32),
        "token_logits": token_logits,
        "token_margins": top2_margins(token_logits).astype(np.float32),
    }


def incremental_prompt_logits(model, prompt_ids: List[int]) -> np.ndarray:
    """The prompt fed one token at a time (decode path) -- for the tolerance report."""
    cache = make_prompt_cache(model)
    rows = []
    for t in prompt_ids:
        out = model(mx.array([[t]], dtype=mx.int32), cache=cache)[0, -1].astype(mx.float32)
        mx.eval(out)
        rows.append(np.array(out))
    return np.stack(rows)


def chunked_decode_logits(model, prompt_ids: List[int], tokens: np.ndarray,
                          chunk: int) -> np.ndarray:
    """Prompt forward, then the oracle's tokens fed `chunk` at a time (the shape of a
    speculative-decoding verify pass); returns the rows matching token_logits[1:]."""
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array(prompt_ids, dtype=mx.int32)[None], cache=cache))
    rows = []
    feed = tokens[:-1].tolist()
    for i in range(0, len(feed), chunk):
        out = model(mx.array([feed[i:i + chunk]], dtype=mx.int32), cache=cache)[0]
        out = out.astype(mx.float32)
        mx.eval(out)
        rows.append(np.array(out))
    return np.concatenate(rows)


def generate_step_oracle(model, prompt_ids: List[int], n_tokens: int):
    """mlx-lm's own generation loop (greedy sampler), with the raw logits captured."""
    captured: List[np.ndarray] = []

    def capture(_tokens, logits):
        captured.append(np.array(logits.astype(mx.float32))[0])
        return logits

    toks = []
    for tok, _ in generate_step(mx.array(prompt_ids, dtype=mx.int32), model,
                                max_tokens=n_tokens, logits_processors=[capture]):
        toks.append(int(tok.item() if hasattr(tok, "item") else tok))
    # generate_step computes one step ahead, so it captures n_tokens + 1 rows.
    return np.array(toks, dtype=np.int32), np.stack(captured)[:n_tokens]


def top2_margins(logits: np.ndarray) -> np.ndarray:
    part = np.sort(logits, axis=-1)
    return part[:, -1] - part[:, -2]


# --------------------------------------------------------------------------------------------
# Fixtures.
# --------------------------------------------------------------------------------------------


@dataclass
class Fixture:
    name: str
    description: str
    tc: Dict[str, Any]
    prompt: str
    nested: bool = False
    shards: int = 1
    quantize: Optional[Dict[str, int]] = None
    generation_config: bool = False
    n_tokens: int = 64
    seed: int = 0
    # Embeddings small next to what each layer adds (else the model copies its input token);
    # the logit scale then comes from the final norm.
    embed_std: float = 0.1
    lm_head_std: float = 0.1
    final_norm_scale: float = 4.0
    # acceptance thresholds for the seed search
    min_token_margin: float = 0.02      # float32 logits: ~1e3x the expected f32 discrepancy
    min_prompt_margin: float = 0.005
    min_router_gap: float = 1e-3

    @property
    def dtype(self) -> str:
        return self.tc["dtype"]

    @property
    def prefix(self) -> str:
        return "model.language_model." if self.nested else "model."


VOCAB = 512
SW, FA = "sliding_attention", "full_attention"


def fixtures() -> List[Fixture]:
    return [
        Fixture(
            name="dense",
            description=("flat gemma4_text (Gemma4ForCausalLM), 6 layers S,S,F,S,S,F, GQA 4q/2kv, "
                         "head_dim 16 / global_head_dim 32 with proportional RoPE (0.25) on full "
                         "layers, window 8 < prompt length, tied embeddings, float32, one "
                         "model.safetensors"),
            tc=text_config(vocab=VOCAB, hidden=64, layer_types=[SW, SW, FA, SW, SW, FA], heads=4,
                           kv_heads=2, head_dim=16, global_head_dim=32, intermediate=96,
                           window=8, dtype="float32"),
            prompt="Alice was beginning to get very tired",
            generation_config=True,
            seed=1000,
        ),
        Fixture(
            name="ple-kvshare",
            description=("flat gemma4_text, 8 layers S,S,S,F,S,S,S,F; per-layer inputs "
                         "(hidden_size_per_layer_input 16); the last 4 layers share KV (sliding "
                         "ones read layer 2, the full one layer 3) and use the double-wide MLP; "
                         "hidden 48 (sqrt not exact), MQA 4q/1kv, window 16 < prompt length, "
                         "float32, two shards + model.safetensors.index.json"),
            tc=text_config(vocab=VOCAB, hidden=48, layer_types=[SW, SW, SW, FA, SW, SW, SW, FA],
                           heads=4, kv_heads=1, head_dim=16, global_head_dim=32,
                           intermediate=64, window=16, ple=16, kv_shared=4, double_wide=True,
                           dtype="float32", eos=[EOS_ID, END_OF_TURN_ID]),
            prompt="Oh dear! Oh dear! I shall be late!",
            shards=2,
            generation_config=True,
            seed=2000,
        ),
        Fixture(
            name="kv-eq",
            description=("nested gemma4 (Gemma4ForConditionalGeneration, text_config "
                         "gemma4_text), weights under model.language_model.; full layers use "
                         "attention_k_eq_v (no v_proj, V = k_proj output) with global_head_dim 32 "
                         "and num_global_key_value_heads 1; sliding layers head_dim 16 with 2 kv "
                         "heads; window 8; float32"),
            tc=text_config(vocab=VOCAB, hidden=64, layer_types=[SW, SW, FA, SW, SW, FA],
                           heads=4, kv_heads=2, head_dim=16, global_head_dim=32,
                           intermediate=96, window=8, k_eq_v=True, global_kv_heads=1,
                           dtype="float32"),
            nested=True,
            prompt="Four score and seven years ago",
            seed=3000,
        ),
        Fixture(
            name="moe",
            description=("flat gemma4_text with enable_moe_block: every layer runs the dense "
                         "MLP plus 4 experts (top-2, moe_intermediate_size 32) in parallel; "
                         "untied lm_head.weight; 5 layers S,S,F,S,F; window 16; float32"),
            tc=text_config(vocab=VOCAB, hidden=64, layer_types=[SW, SW, FA, SW, FA], heads=4,
                           kv_heads=2, head_dim=16, global_head_dim=32, intermediate=64,
                           window=16, moe={"num_experts": 4, "top_k_experts": 2,
                                           "moe_intermediate_size": 32},
                           tie=False, dtype="float32"),
            prompt="The rabbit-hole went straight on",
            seed=4000,
        ),
        Fixture(
            name="quant4",
            description=("nested gemma4 bfloat16 checkpoint quantized by mlx-lm's convert "
                         "(4-bit affine, group size 32): mlx-lm's own layout, weights under "
                         "language_model.model. with .scales/.biases (bf16), config carries "
                         "quantization/quantization_config; 4 layers S,S,S,F, window 8"),
            tc=text_config(vocab=VOCAB, hidden=64, layer_types=[SW, SW, SW, FA], heads=4,
                           kv_heads=2, head_dim=16, global_head_dim=32, intermediate=128,
                           window=8, dtype="bfloat16"),
            nested=True,
            quantize={"group_size": 32, "bits": 4},
            prompt="So she was considering in her own mind",
            seed=5000,
            min_token_margin=0.06,  # bf16: >= 1 ulp of a top logit in [8, 16), 2 in [4, 8)
            min_prompt_margin=0.0,
        ),
        Fixture(
            name="bf16",
            description=("flat gemma4_text stored in bfloat16 (computed in bf16 by mlx-lm; "
                         "oracle logits cast to float32); hidden 48 so the embedding scale "
                         "sqrt(48) rounds in bf16; 4 layers S,S,S,F; window 16 < prompt length"),
            tc=text_config(vocab=VOCAB, hidden=48, layer_types=[SW, SW, SW, FA], heads=4,
                           kv_heads=2, head_dim=16, global_head_dim=32, intermediate=96,
                           window=16, dtype="bfloat16"),
            prompt="Either the well was very deep, or she fell very slowly",
            seed=6000,
            min_token_margin=0.06,  # bf16: >= 1 ulp of a top logit in [8, 16), 2 in [4, 8)
            min_prompt_margin=0.0,
        ),
    ]


def max_run(tokens: np.ndarray) -> int:
    best = run = 1
    for a, b in zip(tokens[:-1], tokens[1:]):
        run = run + 1 if a == b else 1
        best = max(best, run)
    return best


def evaluate(model, fx: Fixture, prompt_ids: List[int], search: bool = False):
    """The oracle run plus its statistics; with search=True, raises Rejected early when the
    run cannot meet the fixture's thresholds."""
    ROUTER_GAPS.clear()
    _RECORD_ROUTER[0] = fx.tc["enable_moe_block"]
    try:
        res = greedy_oracle(model, prompt_ids, fx.n_tokens,
                            min_margin=fx.min_token_margin if search else None)
    finally:
        _RECORD_ROUTER[0] = False
    stats = {
        "min_token_margin": float(res["token_margins"].min()),
        "median_token_margin": float(np.median(res["token_margins"])),
        "min_prompt_margin": float(top2_margins(res["prompt_logits"]).min()),
        "distinct_tokens": int(len(set(res["tokens"].tolist()))),
        "longest_repeat": max_run(res["tokens"]),
        "logit_std": float(res["token_logits"].std()),
        "max_abs_logit": float(np.abs(res["token_logits"]).max()),
    }
    if fx.tc["enable_moe_block"]:
        stats["min_router_gap"] = float(min(ROUTER_GAPS))
    if search and not acceptable(fx, stats):
        raise Rejected("thresholds")
    return res, stats


def acceptable(fx: Fixture, stats: Dict[str, Any]) -> bool:
    ok = (stats["min_token_margin"] >= fx.min_token_margin
          and stats["min_prompt_margin"] >= fx.min_prompt_margin
          and stats["distinct_tokens"] >= 16
          and stats["longest_repeat"] <= 8)
    if "min_router_gap" in stats:
        ok = ok and stats["min_router_gap"] >= fx.min_router_gap
    return ok


def max_abs(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64))))


def make_fixture(fx: Fixture, tok, out_root: Path, max_tries: int = 1000) -> Dict[str, Any]:
    t0 = time.time()
    config = full_config(fx.tc, fx.nested)
    prompt_ids = tok.encode(fx.prompt).ids
    P = len(prompt_ids)

    # 1. Seed search, in memory: the first seed whose greedy run has clear argmax margins.
    chosen = None
    for attempt in range(max_tries):
        seed = fx.seed + attempt
        weights = to_mx(hf_weights(fx.tc, fx.prefix, seed, fx.embed_std, fx.lm_head_std,
                                   fx.final_norm_scale), fx.dtype)
        model = build_in_memory(config, weights, fx.quantize)
        try:
            res_mem, stats = evaluate(model, fx, prompt_ids, search=True)
        except Rejected:
            continue
        chosen = (seed, weights, res_mem, stats, attempt + 1)
        break
    if chosen is None:
        raise RuntimeError(f"{fx.name}: no seed in {max_tries} tries met the margin thresholds")
    seed, weights, res_mem, stats, tries = chosen

    # 2. Write the checkpoint.
    out = out_root / fx.name
    if out.exists():
        shutil.rmtree(out)
    if fx.quantize:
        # The unquantized HF checkpoint, then mlx-lm's convert -- the exact mlx-lm format.
        from mlx_lm.convert import convert
        with tempfile.TemporaryDirectory() as tmp:
            src = Path(tmp) / "src"
            src.mkdir()
            (src / "config.json").write_text(json.dumps(config, indent=2) + "\n")
            write_safetensors(src, weights, 1)
            write_tokenizer(tok, src)
            if fx.generation_config:
                (src / "generation_config.json").write_text(
                    json.dumps(GENERATION_CONFIG, indent=2) + "\n")
            with contextlib.redirect_stdout(io.StringIO()):
                convert(str(src), mlx_path=str(out), quantize=True,
                        q_group_size=fx.quantize["group_size"], q_bits=fx.quantize["bits"],
                        q_mode="affine")
        (out / "README.md").unlink(missing_ok=True)  # the generic model card mlx-lm writes
    else:
        out.mkdir(parents=True)
        (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        write_safetensors(out, weights, fx.shards)
        write_tokenizer(tok, out)
        if fx.generation_config:
            (out / "generation_config.json").write_text(
                json.dumps(GENERATION_CONFIG, indent=2) + "\n")

    # 3. The oracle, from the directory as mlx-lm loads it.
    model, tokenizer = mlx_lm.load(str(out))
    ids_via_mlx_lm = tokenizer.encode(fx.prompt)
    assert list(ids_via_mlx_lm) == prompt_ids, (ids_via_mlx_lm, prompt_ids)
    res, stats_disk = evaluate(model, fx, prompt_ids)
    assert np.array_equal(res["tokens"], res_mem["tokens"]), f"{fx.name}: reload changed tokens"
    roundtrip = max(max_abs(res["prompt_logits"], res_mem["prompt_logits"]),
                    max_abs(res["token_logits"], res_mem["token_logits"]))
    assert roundtrip <= 1e-5, f"{fx.name}: reloaded logits differ by {roundtrip}"

    # Repeat runs, mlx-lm's own loop, and the incremental (one token at a time) prompt path.
    res2, _ = evaluate(model, fx, prompt_ids)
    repeat = max(max_abs(res["prompt_logits"], res2["prompt_logits"]),
                 max_abs(res["token_logits"], res2["token_logits"]))
    gs_tokens, gs_logits = generate_step_oracle(model, prompt_ids, fx.n_tokens)
    assert np.array_equal(gs_tokens, res["tokens"]), f"{fx.name}: generate_step disagrees"
    gs_diff = max_abs(gs_logits, res["token_logits"])
    inc = incremental_prompt_logits(model, prompt_ids)
    inc_diff = max_abs(inc, res["prompt_logits"])
    # The first generated token when the prompt is fed one token at a time must agree too.
    assert int(np.argmax(inc[-1])) == int(res["tokens"][0])
    chunk_diffs = {}
    for chunk in (3, 7):
        rows = chunked_decode_logits(model, prompt_ids, res["tokens"], chunk)
        assert np.array_equal(rows.argmax(-1), res["tokens"][1:]), f"{fx.name}: chunk {chunk}"
        chunk_diffs[chunk] = max_abs(rows, res["token_logits"][1:])

    mx.save_safetensors(str(out / "oracle.safetensors"),
                        {k: mx.array(v) for k, v in res.items()},
                        metadata={"format": "mlx-lm-oracle"})
    tc = fx.tc
    meta = {
        "fixture": fx.name,
        "description": fx.description,
        "mlx_version": mx.__version__,
        "mlx_lm_version": mlx_lm.__version__,
        "model_type": config["model_type"],
        "tensor_prefix": ("language_model.model." if fx.quantize else fx.prefix),
        "dtype": fx.dtype,
        "quantization": fx.quantize,
        "vocab_size": tc["vocab_size"],
        "hidden_size": tc["hidden_size"],
        "num_hidden_layers": tc["num_hidden_layers"],
        "layer_types": tc["layer_types"],
        "sliding_window": tc["sliding_window"],
        "prompt_text": fx.prompt,
        "prompt_len": P,
        "n_tokens": fx.n_tokens,
        "eos_in_tokens": bool(EOS_ID in res["tokens"].tolist()),
        "weights_seed": seed,
        "seed_tries": tries,
        "oracle_tensors": {
            "prompt_ids": f"int32 [{P}]",
            "prompt_logits": f"float32 [{P}, {tc['vocab_size']}] (prompt forward, empty cache)",
            "tokens": f"int32 [{fx.n_tokens}] (greedy, EOS does not stop)",
            "token_logits": (f"float32 [{fx.n_tokens}, {tc['vocab_size']}] (row i selected "
                             "tokens[i]; row 0 = last prompt position)"),
        },
        "generated_text": tokenizer.decode(res["tokens"].tolist()),
        "stats": {
            **{k: round(v, 6) if isinstance(v, float) else v for k, v in stats_disk.items()},
            "max_abs_diff_reload_vs_in_memory": roundtrip,
            "max_abs_diff_repeat_run": repeat,
            "max_abs_diff_generate_step_vs_oracle": gs_diff,
            "max_abs_diff_incremental_prompt_vs_prompt_forward": inc_diff,
            "max_abs_diff_chunked_decode_3_vs_oracle": chunk_diffs[3],
            "max_abs_diff_chunked_decode_7_vs_oracle": chunk_diffs[7],
        },
    }
    (out / "oracle.json").write_text(json.dumps(meta, indent=2) + "\n")
    meta["seconds"] = round(time.time() - t0, 2)  # not in the file, which stays reproducible
    return meta


# --------------------------------------------------------------------------------------------
# Bench checkpoint (not committed).
# --------------------------------------------------------------------------------------------


def make_bench(out: Path, vocab: int = 16384, large: bool = False) -> None:
    if large:
        # Past the last-level cache of large server CPUs even at 4 bits (1.3B parameters, 0.7 GB
        # in MLX 4-bit), so that decoding is bound by memory as on a real checkpoint.
        tc = text_config(vocab=vocab, hidden=2048, layer_types=([SW] * 4 + [FA]) * 4,
                         heads=8, kv_heads=2, head_dim=256, global_head_dim=512, intermediate=8192,
                         window=512, dtype="float32")
    else:
        tc = text_config(vocab=vocab, hidden=512, layer_types=[SW, SW, SW, FA, SW, SW, SW, FA],
                         heads=8, kv_heads=2, head_dim=64, global_head_dim=128, intermediate=2048,
                         window=128, dtype="float32")
    config = full_config(tc, nested=False)
    weights = to_mx(hf_weights(tc, "model.", 7, 0.1, 0.1, 4.0), "float32")
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    write_safetensors(out, weights, 1)
    write_tokenizer(build_bench_tokenizer(vocab), out)
    n = sum(int(np.prod(v.shape)) for v in weights.values())
    model, _ = mlx_lm.load(str(out))
    logits = model(mx.array([[BOS_ID, 10, 11, 12]], dtype=mx.int32))
    mx.eval(logits)
    print(json.dumps({"bench_checkpoint": str(out), "parameters": n,
                      "logits_shape": list(logits.shape)}))


def build_bench_tokenizer(vocab_size: int):
    """The corpus cannot fill 16k merges; the small tokenizer padded with <unusedN> pieces."""
    small = build_tokenizer(VOCAB)
    spec = json.loads(small.to_str())
    v = spec["model"]["vocab"]
    i = 0
    while len(v) < vocab_size:
        v[f"<unused{i}>"] = len(v)
        i += 1
    from tokenizers import Tokenizer
    tok = Tokenizer.from_str(json.dumps(spec))
    assert tok.get_vocab_size() == vocab_size
    return tok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=FIXTURES, help="fixtures root")
    ap.add_argument("--only", nargs="*", help="fixture names to (re)generate")
    ap.add_argument("--bench", type=Path, help="write a >=20M-parameter bench checkpoint here")
    ap.add_argument("--bench-vocab", type=int, default=16384,
                    help="its vocabulary (262144: Gemma 4's, so that the head costs what it does)")
    ap.add_argument("--bench-large", action="store_true",
                    help="a 1.3B-parameter bench checkpoint instead, larger than the CPU's caches")
    args = ap.parse_args()
    mx.set_default_device(mx.cpu)
    if args.bench:
        make_bench(args.bench, args.bench_vocab, args.bench_large)
        return 0
    t0 = time.time()
    tok = build_tokenizer(VOCAB)
    args.out.mkdir(parents=True, exist_ok=True)
    selected = [f for f in fixtures() if not args.only or f.name in args.only]
    if args.only and len(selected) != len(args.only):
        known = [f.name for f in fixtures()]
        print(f"unknown fixture in {args.only}; known: {known}", file=sys.stderr)
        return 2
    for fx in selected:
        with quantized_products_in_float32() if fx.quantize else contextlib.nullcontext():
            meta = make_fixture(fx, tok, args.out)
        s = meta["stats"]
        print(f"{fx.name:12s} P={meta['prompt_len']:3d} N={meta['n_tokens']} "
              f"seed={meta['weights_seed']} (tries {meta['seed_tries']}) "
              f"margin(tok)={s['min_token_margin']:.4f} distinct={s['distinct_tokens']} "
              f"reload={s['max_abs_diff_reload_vs_in_memory']:.2e} "
              f"gen_step={s['max_abs_diff_generate_step_vs_oracle']:.2e} "
              f"incr={s['max_abs_diff_incremental_prompt_vs_prompt_forward']:.2e} "
              f"chunk3/7={s['max_abs_diff_chunked_decode_3_vs_oracle']:.2e}/"
              f"{s['max_abs_diff_chunked_decode_7_vs_oracle']:.2e} "
              f"{meta['seconds']}s", flush=True)
    print(f"done in {time.time() - t0:.1f}s -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
