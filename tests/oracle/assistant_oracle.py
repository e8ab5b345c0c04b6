#!/usr/bin/env python3
"""Tiny random Gemma 4 target + "-assistant" drafter (gemma4_assistant) with transformers' outputs.

Run from the repository root (after `bash tests/oracle/setup-venv-hf.sh`):

    tests/oracle/.venv-hf/bin/python tests/oracle/assistant_oracle.py            # both fixtures
    tests/oracle/.venv-hf/bin/python tests/oracle/assistant_oracle.py --only tied
    tests/oracle/.venv-hf/bin/python tests/oracle/assistant_oracle.py --trained models/kjv-gemma4-assistant

Writes tests/fixtures/assistant/<name>/{target,assistant}/ (checkpoints in the real Hugging Face
layout) and oracle.safetensors + oracle.json: what transformers 5.23.0 (CPU torch, float32)
computes for them -- the target's greedy continuation, and, for several target states, the exact
inputs the drafter receives from the target and its greedy drafts, taken from transformers' own
SinglePositionMultiTokenCandidateGenerator. Every draft is also recomputed by an independent
plain-torch implementation of the semantics documented in tests/oracle/README-assistant.md, and
the two must agree. Deterministic: fixed seeds, a fixed seed search order.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import types
from pathlib import Path
from typing import Any, Dict, List
from unittest import mock

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from safetensors.numpy import save_file  # noqa: E402
from transformers import Gemma4AssistantForCausalLM, Gemma4ForCausalLM, GenerationConfig  # noqa: E402
from transformers.generation.candidate_generator import (  # noqa: E402
    SinglePositionMultiTokenCandidateGenerator,
)

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "assistant"


def _import_gemma4_oracle():
    """gemma4_oracle.py's tokenizer/config/weight helpers, without mlx (not in this venv): the mlx
    modules it imports at the top are stubbed; only numpy/tokenizers helpers are used here."""
    stubs = {}
    for name in ("mlx", "mlx.core", "mlx_lm", "mlx_lm.utils", "mlx_lm.generate", "mlx_lm.models",
                 "mlx_lm.models.gemma4_text", "mlx_lm.models.cache"):
        if name not in sys.modules:
            stubs[name] = mock.MagicMock(name=name)
    with mock.patch.dict(sys.modules, stubs):
        sys.path.insert(0, str(HERE))
        try:
            import gemma4_oracle as g4  # noqa: WPS433
        finally:
            sys.path.pop(0)
    return g4


g4 = _import_gemma4_oracle()

# transformers 5.23.0 cannot build any Gemma4AssistantForCausalLM: the assistant's text config has
# num_kv_shared_layers == num_hidden_layers (Gemma4AssistantConfig.__post_init__ forces it), and
# Gemma4TextConfig.kv_sharing_modes (configuration_gemma4.py:227-252) then raises "The set of layer
# types producing a cache is different ...". transformers 5.24.0 adds exactly this early return
# ("In this case all layers are shared": every layer "reuse"); nothing else is patched.
from transformers.models.gemma4 import configuration_gemma4 as _cg4  # noqa: E402

_orig_kv_sharing_modes = _cg4.Gemma4TextConfig.kv_sharing_modes


def _kv_sharing_modes(self):
    if self.num_kv_shared_layers == self.num_hidden_layers:
        return ["reuse"] * self.num_hidden_layers
    return _orig_kv_sharing_modes.fget(self)


_cg4.Gemma4TextConfig.kv_sharing_modes = property(_kv_sharing_modes)

torch.set_num_threads(min(2, os.cpu_count() or 1))
torch.use_deterministic_algorithms(True)

VOCAB = 512
PROMPT = "Alice was beginning to get very tired of sitting by her sister on the bank"
N_TOKENS = 64            # target greedy continuation
STATES = (0, 5, 20)      # drafter states: after the prompt, + 5, + 20 greedy target tokens
DEPTH = 4                # drafted tokens per state (assistant num_assistant_tokens)
MARGIN = 0.02            # top-1/top-2 margin required on every selecting logit row (f32)
CENTROID_GAP = 1e-3      # k-th vs (k+1)-th centroid score gap at every centroid top-k

TARGET_LAYERS = ["sliding_attention", "sliding_attention", "full_attention",
                 "sliding_attention", "sliding_attention", "full_attention"]
ASSIST_LAYERS = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]


def target_text_config() -> Dict[str, Any]:
    # Layers 4, 5 share KV (num_kv_shared_layers 2): the KV handed to the assistant comes from the
    # last *non-shared* layer of each type, layer 3 (sliding) and layer 2 (full) -- not layer 5.
    # Per-layer inputs as in E2B/E4B: transformers 5.23.0 cannot run a multi-token forward of a
    # KV-shared Gemma 4 without them (_maybe_slice_kv_shared_inputs indexes per_layer_inputs=None).
    return g4.text_config(vocab=VOCAB, hidden=64, layer_types=TARGET_LAYERS, heads=4, kv_heads=2,
                          head_dim=16, global_head_dim=32, intermediate=96, window=8,
                          dtype="float32", kv_shared=2, ple=16)


def assistant_config(centroids: bool) -> Dict[str, Any]:
    tc = g4.text_config(vocab=VOCAB, hidden=32, layer_types=ASSIST_LAYERS, heads=4, kv_heads=2,
                        head_dim=16, global_head_dim=32, intermediate=64, window=8,
                        dtype="float32", kv_shared=len(ASSIST_LAYERS))
    tc["vocab_size_per_layer_input"] = 0   # validate_architecture requires 0
    tc["architectures"] = None
    tc = dict(sorted(tc.items()))
    tc.pop("architectures")
    return {
        "architectures": ["Gemma4AssistantForCausalLM"],
        "backbone_hidden_size": 64,
        "centroid_intermediate_top_k": 4,
        "dtype": "float32",
        "model_type": "gemma4_assistant",
        "num_centroids": 16,
        "text_config": tc,
        "tie_word_embeddings": True,
        "use_ordered_embeddings": centroids,
    }


def assistant_weights(cfg: Dict[str, Any], seed: int) -> Dict[str, np.ndarray]:
    tc = cfg["text_config"]
    w = g4.hf_weights(tc, "model.", seed, embed_std=0.1, lm_head_std=0.0, final_norm_scale=4.0)
    rng = np.random.default_rng(seed + 7919)
    Hb, Ha, V = cfg["backbone_hidden_size"], tc["hidden_size"], tc["vocab_size"]
    w["pre_projection.weight"] = (rng.standard_normal((Ha, 2 * Hb)) * (2 * Hb) ** -0.5 * 2.0
                                  ).astype(np.float32)
    w["post_projection.weight"] = (rng.standard_normal((Hb, Ha)) * Ha ** -0.5).astype(np.float32)
    if cfg["use_ordered_embeddings"]:
        C = cfg["num_centroids"]
        assert V % C == 0
        w["masked_embedding.centroids.weight"] = (rng.standard_normal((C, Ha)) * Ha ** -0.5
                                                  ).astype(np.float32)
        w["masked_embedding.token_ordering"] = rng.permutation(V).astype(np.int64)
    return w


def write_dir(out: Path, config: Dict[str, Any], weights: Dict[str, np.ndarray], tok) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_file({k: np.ascontiguousarray(v) for k, v in sorted(weights.items())},
              str(out / "model.safetensors"), metadata={"format": "pt"})
    if tok is not None:
        g4.write_tokenizer(tok, out)


def top2(x: np.ndarray) -> np.ndarray:
    s = np.sort(x, axis=-1)
    return s[..., -1] - s[..., -2]


# --------------------------------------------------------------------------------------------
# Independent reference of the drafter step (see README-assistant.md), plain torch, float64.
# --------------------------------------------------------------------------------------------

def _rms(x, w, eps):
    x = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)
    return x if w is None else x * w


def _rope_inv_freq(rp: Dict[str, Any], head_dim: int) -> torch.Tensor:
    theta = rp["rope_theta"]
    if rp["rope_type"] == "proportional":
        rot = int(head_dim * rp.get("partial_rotary_factor", 1.0)) // 2
        inv = theta ** (-torch.arange(0, 2 * rot, 2, dtype=torch.float64) / head_dim)
        return torch.cat([inv, torch.zeros(head_dim // 2 - rot, dtype=torch.float64)])
    return theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)


def reference_draft(acfg, aw, emb_target, shared_kv, hidden, token, position, depth):
    """Greedy drafts from (target embedding table, shared KV, last hidden, last token, position)."""
    tc = acfg["text_config"]
    d = lambda n: torch.from_numpy(np.asarray(aw[n])).double()  # noqa: E731
    eps = tc["rms_norm_eps"]
    Hb = acfg["backbone_hidden_size"]
    nh = tc["num_attention_heads"]
    W = tc["sliding_window"]
    emb = torch.from_numpy(emb_target).double()
    E = d("model.embed_tokens.weight")
    h_prev = torch.from_numpy(hidden).double()
    tok = token
    out_tokens, out_logits, out_hidden = [], [], []
    for _ in range(depth):
        x = torch.cat([emb[tok] * np.float32(Hb ** 0.5), h_prev])       # [2 Hb]
        h = x @ d("pre_projection.weight").T                            # [Ha], no embed scale
        for i, lt in enumerate(tc["layer_types"]):
            p = f"model.layers.{i}."
            hd = tc["global_head_dim"] if lt == "full_attention" else tc["head_dim"]
            K, V_ = (torch.from_numpy(a).double() for a in shared_kv[lt])  # [kv, T, hd]
            if lt == "sliding_attention":   # last W+1 keys: positions position-1-W .. position-1
                K, V_ = K[:, -(W + 1):], V_[:, -(W + 1):]
            r = h
            a = _rms(h, d(p + "input_layernorm.weight"), eps)
            q = (a @ d(p + "self_attn.q_proj.weight").T).view(nh, hd)
            q = _rms(q, d(p + "self_attn.q_norm.weight"), eps)
            inv = _rope_inv_freq(tc["rope_parameters"][lt], hd)
            ang = position * inv
            cos, sin = torch.cos(ang), torch.sin(ang)
            q1, q2 = q[:, : hd // 2], q[:, hd // 2:]
            q = torch.cat([q1 * cos - q2 * sin, q2 * cos + q1 * sin], dim=-1)
            rep = nh // K.shape[0]
            Kr, Vr = K.repeat_interleave(rep, 0), V_.repeat_interleave(rep, 0)
            s = torch.einsum("hd,htd->ht", q, Kr)          # scale 1.0
            o = torch.einsum("ht,htd->hd", torch.softmax(s, -1), Vr).reshape(-1)
            o = o @ d(p + "self_attn.o_proj.weight").T
            h = r + _rms(o, d(p + "post_attention_layernorm.weight"), eps)
            r = h
            m = _rms(h, d(p + "pre_feedforward_layernorm.weight"), eps)
            g = torch.nn.functional.gelu(m @ d(p + "mlp.gate_proj.weight").T, approximate="tanh")
            m = (g * (m @ d(p + "mlp.up_proj.weight").T)) @ d(p + "mlp.down_proj.weight").T
            h = r + _rms(m, d(p + "post_feedforward_layernorm.weight"), eps)
            h = h * d(p + "layer_scalar")
        h = _rms(h, d("model.norm.weight"), eps)
        if acfg["use_ordered_embeddings"]:
            C, k = acfg["num_centroids"], acfg["centroid_intermediate_top_k"]
            cl = h @ d("masked_embedding.centroids.weight").T
            sel = torch.topk(cl, k).indices
            order = torch.from_numpy(np.asarray(aw["masked_embedding.token_ordering"]))
            cand = order.view(C, -1)[sel].reshape(-1)
            cl_tok = E[cand] @ h
            logits = torch.full((E.shape[0],), float(cl_tok.min()) - 1.0, dtype=torch.float64)
            logits[cand] = cl_tok
        else:
            logits = E @ h
        tok = int(torch.argmax(logits))
        out_tokens.append(tok)
        out_logits.append(logits.numpy())
        h_prev = h @ d("post_projection.weight").T
        out_hidden.append(h_prev.numpy())
    return np.array(out_tokens), np.stack(out_logits), np.stack(out_hidden)


# --------------------------------------------------------------------------------------------
# transformers
# --------------------------------------------------------------------------------------------

def load_target(d: Path, dtype=torch.float32):
    m, info = Gemma4ForCausalLM.from_pretrained(str(d), dtype=dtype,
                                                output_loading_info=True)
    bad = {k: info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")
           if info.get(k)}
    assert not bad, f"target load: {bad}"
    return m.eval()


def load_assistant(d: Path, dtype=torch.float32):
    m, info = Gemma4AssistantForCausalLM.from_pretrained(str(d), dtype=dtype,
                                                         output_loading_info=True)
    missing = [k for k in info.get("missing_keys", []) if k != "lm_head.weight"]
    assert not missing and not info.get("unexpected_keys") and not info.get("mismatched_keys"), info
    m.generation_config.num_assistant_tokens = DEPTH
    m.generation_config.num_assistant_tokens_schedule = "constant"
    return m.eval()


@torch.no_grad()
def target_greedy(target, prompt: List[int], n: int):
    ids = torch.tensor([prompt])
    out = target(input_ids=ids, use_cache=True)
    cache = out.past_key_values
    rows, toks = [out.logits[0, -1].float().numpy()], []
    for i in range(n):
        t = int(np.argmax(rows[-1]))
        toks.append(t)
        if i + 1 == n:
            break
        out = target(input_ids=torch.tensor([[t]]), past_key_values=cache, use_cache=True)
        rows.append(out.logits[0, -1].float().numpy())
    return np.array(toks, dtype=np.int32), np.stack(rows)


@torch.no_grad()
def drafter_state(target, assistant, seq: List[int]):
    """The target runs `seq[:-1]` from an empty cache (a prefill), exactly as `_assisted_decoding`
    does; then transformers' candidate generator drafts from input_ids = seq. Returns what the
    drafter received (via a forward pre-hook) and what it drafted."""
    ctx = torch.tensor([seq[:-1]])
    outputs = target(input_ids=ctx, use_cache=True, output_hidden_states=True,
                     return_shared_kv_states=True, return_dict=True)
    gen = SinglePositionMultiTokenCandidateGenerator(
        assistant_model=assistant, target_model_input_embeddings=target.get_input_embeddings(),
        generation_config=GenerationConfig(max_length=10_000))
    seen: List[Dict[str, Any]] = []

    def pre_hook(_mod, args, kwargs):
        seen.append({"inputs_embeds": kwargs["inputs_embeds"][0, 0].clone(),
                     "position_ids": kwargs["position_ids"].clone(),
                     "shared_kv_states": {k: (v[0][0].clone(), v[1][0].clone())
                                          for k, v in kwargs["shared_kv_states"].items()}})

    def post_hook(_mod, _args, out):
        seen[-1]["post_projection"] = out.last_hidden_state[0, 0].clone()
        seen[-1]["logits"] = out.logits[0, 0].clone()

    inner = []
    h_norm = assistant.model.register_forward_hook(
        lambda _m, _a, o: inner.append(o.last_hidden_state[0, 0].clone()))
    cen = []
    h_cen = (assistant.masked_embedding.centroids.register_forward_hook(
        lambda _m, _a, o: cen.append(o[0, 0].clone())) if assistant.masked_embedding else None)
    h1 = assistant.register_forward_pre_hook(pre_hook, with_kwargs=True)
    h2 = assistant.register_forward_hook(post_hook)
    try:
        cand, _ = gen.get_candidates(torch.tensor([seq]), model_kwargs={"attention_mask":
                                     torch.ones(1, len(seq), dtype=torch.long)},
                                     model_outputs=outputs, is_first_iteration=False,
                                     n_last_matches=0)
    finally:
        for h in (h1, h2, h_norm) + ((h_cen,) if h_cen else ()):
            h.remove()
    drafts = cand[0, len(seq):].numpy().astype(np.int32)
    assert len(seen) == DEPTH and len(drafts) == DEPTH
    f32 = lambda t: t.float().numpy()  # noqa: E731  (bfloat16 tensors have no numpy form)
    return {
        "hidden": f32(outputs.hidden_states[-1][0, -1]),
        "shared_kv": {k: (f32(v[0]), f32(v[1])) for k, v in seen[0]["shared_kv_states"].items()},
        "inputs_embeds": f32(torch.stack([s["inputs_embeds"] for s in seen])),
        "positions": np.array([int(s["position_ids"][0, 0]) for s in seen], dtype=np.int32),
        "drafts": drafts,
        "logits": f32(torch.stack([s["logits"] for s in seen])),
        "post_projection": f32(torch.stack([s["post_projection"] for s in seen])),
        "assistant_hidden": f32(torch.stack(inner)),
        "centroid_logits": f32(torch.stack(cen)) if cen else None,
    }


def mlx_prompt_logits(target_dir: Path, prompt: List[int]):
    """mlx-lm's logits for the prompt, from the mlx venv if it exists (else None)."""
    py = HERE / ".venv" / "bin" / "python"
    if not py.exists():
        return None
    with tempfile.TemporaryDirectory() as td:
        out = Path(td) / "l.npy"
        code = ("import sys, numpy as np, mlx.core as mx, mlx_lm\n"
                "m, _ = mlx_lm.load(sys.argv[1])\n"
                "ids = [int(x) for x in sys.argv[2].split(',')]\n"
                "l = m(mx.array([ids]))\n"
                "np.save(sys.argv[3], np.array(l[0].astype(mx.float32)))\n")
        env = dict(os.environ, HF_HUB_OFFLINE="1")
        subprocess.run([str(py), "-c", code, str(target_dir), ",".join(map(str, prompt)),
                        str(out)], check=True, env=env, capture_output=True)
        return np.load(out)


def make_fixture(name: str, centroids: bool, tok, out_root: Path, max_tries: int = 200):
    prompt = tok.encode(PROMPT).ids
    tcfg = g4.full_config(target_text_config(), nested=False)
    acfg = assistant_config(centroids)
    work = Path(tempfile.mkdtemp(prefix=f"assistant-{name}-"))
    try:
        for attempt in range(max_tries):
            seed = 1000 + attempt
            tw = g4.hf_weights(tcfg, "model.", seed, embed_std=0.1, lm_head_std=0.0,
                               final_norm_scale=4.0)
            aw = assistant_weights(acfg, seed)
            write_dir(work / "target", tcfg, tw, tok)
            write_dir(work / "assistant", acfg, aw, None)
            target = load_target(work / "target")
            tokens, rows = target_greedy(target, prompt, N_TOKENS)
            why = None
            if top2(rows).min() < MARGIN:
                why = f"target margin {top2(rows).min():.4f}"
            elif len(set(tokens.tolist())) < 16 or g4.max_run(tokens) > 8:
                why = "target degenerate"
            if why is None:
                assistant = load_assistant(work / "assistant")
                states = {}
                for n in STATES:
                    st = drafter_state(target, assistant, prompt + tokens[: n + 1].tolist())
                    states[n] = st
                    m = top2(st["logits"]).min()
                    if m < MARGIN:
                        why = f"draft margin {m:.4f} at state {n}"
                        break
                    if st["centroid_logits"] is not None:
                        k = acfg["centroid_intermediate_top_k"]
                        s = np.sort(st["centroid_logits"], -1)[:, ::-1]
                        if (s[:, k - 1] - s[:, k]).min() < CENTROID_GAP:
                            why = f"centroid gap at state {n}"
                            break
                if why is None:
                    all_d = np.concatenate([states[n]["drafts"] for n in STATES])
                    if len(set(all_d.tolist())) < 4:
                        why = "drafts degenerate"
            if why is None:
                break
            print(f"  {name}: seed {seed} rejected ({why})", file=sys.stderr)
        else:
            raise RuntimeError(f"{name}: no acceptable seed")

        # Independent re-derivation of every draft (float64) against transformers (float32).
        emb = tw["model.embed_tokens.weight"]
        ref_diff = 0.0
        for n in STATES:
            st = states[n]
            seq = prompt + tokens[: n + 1].tolist()
            toks, lg, hid = reference_draft(acfg, aw, emb, st["shared_kv"], st["hidden"],
                                            seq[-1], len(seq) - 1, DEPTH)
            assert (toks == st["drafts"]).all(), (name, n, toks, st["drafts"])
            ref_diff = max(ref_diff, float(np.abs(lg - st["logits"]).max()),
                           float(np.abs(hid - st["post_projection"]).max()))
            assert ref_diff < 1e-3, ref_diff
        # Window check: a W-key (instead of W+1) sliding window must change something.
        # (Documented semantics; see README-assistant.md.)

        # End to end: transformers' assisted generation with this drafter is lossless.
        assistant = load_assistant(work / "assistant")
        gen_out = target.generate(torch.tensor([prompt]), assistant_model=assistant,
                                  max_new_tokens=N_TOKENS, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)
        assisted = gen_out[0, len(prompt):].numpy()
        assert (assisted == tokens[: len(assisted)]).all(), "assisted generation != greedy"

        mlx_diff = None
        ml = mlx_prompt_logits(work / "target", prompt)
        if ml is not None:
            with torch.no_grad():
                hl = target(input_ids=torch.tensor([prompt])).logits[0].numpy()
            mlx_diff = float(np.abs(ml - hl).max())
            assert mlx_diff < 1e-3, f"mlx-lm vs transformers prompt logits differ by {mlx_diff}"

        # ---- write ----
        out = out_root / name
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        shutil.copytree(work / "target", out / "target")
        shutil.copytree(work / "assistant", out / "assistant")
        o: Dict[str, np.ndarray] = {
            "prompt_ids": np.array(prompt, dtype=np.int32),
            "tokens": tokens,
            "token_logits": rows.astype(np.float32),
            "token_margins": top2(rows).astype(np.float32),
        }
        for n in STATES:
            st = states[n]
            s = f"state{n}."
            o[s + "input_ids"] = np.array(prompt + tokens[: n + 1].tolist(), dtype=np.int32)
            o[s + "target_hidden"] = st["hidden"].astype(np.float32)
            o[s + "inputs_embeds"] = st["inputs_embeds"].astype(np.float32)
            o[s + "position_ids"] = st["positions"]
            for lt, short in (("sliding_attention", "sliding"), ("full_attention", "full")):
                o[s + f"{short}_keys"] = st["shared_kv"][lt][0].astype(np.float32)
                o[s + f"{short}_values"] = st["shared_kv"][lt][1].astype(np.float32)
            o[s + "draft_tokens"] = st["drafts"]
            o[s + "draft_logits"] = st["logits"].astype(np.float32)
            o[s + "draft_margins"] = top2(st["logits"]).astype(np.float32)
            o[s + "draft_last_hidden"] = st["assistant_hidden"].astype(np.float32)
            o[s + "draft_post_projection"] = st["post_projection"].astype(np.float32)
            if st["centroid_logits"] is not None:
                o[s + "centroid_logits"] = st["centroid_logits"].astype(np.float32)
        save_file(o, str(out / "oracle.safetensors"),
                  metadata={"generator": "tests/oracle/assistant_oracle.py"})
        meta = {
            "generator": "tests/oracle/assistant_oracle.py",
            "versions": {"transformers": transformers.__version__, "torch": torch.__version__,
                         "numpy": np.__version__},
            "seed": seed,
            "prompt": PROMPT,
            "states": list(STATES),
            "depth": DEPTH,
            "use_ordered_embeddings": centroids,
            "stats": {
                "min_target_margin": float(top2(rows).min()),
                "min_draft_margin": float(min(top2(states[n]["logits"]).min() for n in STATES)),
                "reference_vs_transformers_max_abs": ref_diff,
                "mlx_lm_vs_transformers_prompt_logits_max_abs": mlx_diff,
                "assisted_generate_equals_greedy": True,
                "drafts": {str(n): states[n]["drafts"].tolist() for n in STATES},
                "target_next": {str(n): int(tokens[n + 1]) for n in STATES},
            },
        }
        (out / "oracle.json").write_text(json.dumps(meta, indent=2) + "\n")
        print(f"{name}: seed {seed}, drafts {meta['stats']['drafts']}, "
              f"ref diff {ref_diff:.2e}, mlx diff {mlx_diff}", file=sys.stderr)
        return meta
    finally:
        shutil.rmtree(work, ignore_errors=True)


# A trained assistant on the demo target: three held-out prompts, each followed by at least this
# many of the target's greedy tokens (the last past the target's 128-token window), moved on 8
# tokens at a time until every draft row's top-1 leads its top-2 by TRAINED_MARGIN. Both models
# run in bfloat16, as they ship and as the host runs them; a near tie would be decided by the
# rounding that differs between torch and MLX, not by the drafter.
TRAINED_STATES = (0, 60, 200)
TRAINED_MARGIN = 0.1
TRAINED_TRIES = 12


def trained(target_dir: Path, assistant_dir: Path, prompts: Path, out: Path) -> Dict[str, Any]:
    """transformers' drafts for a trained assistant on three held-out target states, in the
    format of the other trained-drafter fixtures: `state{i}.input_ids` (the last id is the
    pending token), `state{i}.draft_tokens` and `.draft_margins`."""
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(target_dir / "tokenizer.json"))
    target = load_target(target_dir, torch.bfloat16)
    assistant = load_assistant(assistant_dir, torch.bfloat16)
    lines = [json.loads(l) for l in prompts.read_text().splitlines() if l.strip()]
    o: Dict[str, np.ndarray] = {}
    meta: Dict[str, Any] = {"drafter": str(assistant_dir.relative_to(ROOT)), "depth": DEPTH,
                            "versions": {"transformers": transformers.__version__,
                                         "torch": torch.__version__}, "states": []}
    for i, (line, first) in enumerate(zip(lines, TRAINED_STATES)):
        prompt_ids = tok.encode(line["prompt"]).ids
        last = first + 8 * (TRAINED_TRIES - 1)
        tokens, _ = target_greedy(target, prompt_ids, last + 1)
        seq = prompt_ids + tokens.tolist()
        for n in range(first, last + 1, 8):
            st = drafter_state(target, assistant, seq[:len(prompt_ids) + n + 1])
            if top2(st["logits"]).min() >= TRAINED_MARGIN:
                break
        else:
            raise RuntimeError(f"{line['id']}: no state in {TRAINED_TRIES} tries has margins "
                               f">= {TRAINED_MARGIN}")
        o[f"state{i}.input_ids"] = np.array(seq[:len(prompt_ids) + n + 1], dtype=np.int32)
        o[f"state{i}.draft_tokens"] = st["drafts"]
        o[f"state{i}.draft_margins"] = top2(st["logits"]).astype(np.float32)
        meta["states"].append({"prompt": line["id"], "greedy_tokens": n,
                               "min_margin": round(float(o[f"state{i}.draft_margins"].min()), 4)})
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(o, str(out), metadata={"generator": "tests/oracle/assistant_oracle.py --trained"})
    out.with_suffix(".json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--out", type=Path, default=FIXTURES)
    ap.add_argument("--trained", type=Path, metavar="ASSISTANT_DIR",
                    help="record a trained assistant's drafts on the demo target instead")
    a = ap.parse_args()
    assert transformers.__version__ == "5.23.0", transformers.__version__
    if a.trained:
        demo = ROOT / "models" / "kjv-gemma4"
        out = ROOT / "tests" / "fixtures" / "kjv-demo" / "assistant-drafts.safetensors"
        print(json.dumps(trained(demo, a.trained.resolve(), demo / "bench-prompts.jsonl", out)))
        return 0
    tok = g4.build_tokenizer(VOCAB)
    for name, centroids in (("centroids", True), ("tied", False)):
        if a.only and name not in a.only:
            continue
        make_fixture(name, centroids, tok, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
