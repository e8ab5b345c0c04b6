#!/usr/bin/env python3
"""mlx-lm's logits and greedy tokens for the shipped demo target (models/kjv-gemma4), written to
tests/fixtures/kjv-demo/ for host/tests/gemma4_parity.rs.

    tests/oracle/.venv/bin/python tests/oracle/demo_oracle.py

The prompt is the opening of a held-out chapter (training never saw it), long enough that the
prompt and the 64 greedy steps together pass the sliding window: the first held-out chapter
and prompt length (PROMPT_TOKENS, tried in turn) whose greedy steps all have a top-1/top-2
margin of at least MIN_MARGIN, so that tokens are compared where they are not near-ties.
Logits are stored in bfloat16, the dtype the model computes them in, so nothing is rounded
away.
"""

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import mlx.core as mx  # noqa: E402
import mlx_lm  # noqa: E402
import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "training"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import corpus  # noqa: E402
from gemma4_oracle import generate_step_oracle, greedy_oracle  # noqa: E402

MODEL = ROOT / "models" / "kjv-gemma4"
OUT = ROOT / "tests" / "fixtures" / "kjv-demo"
N_TOKENS = 64
PROMPT_TOKENS = (112, 96, 120, 104, 88)
MIN_MARGIN = 0.125      # two bfloat16 steps at the logits' magnitude


def main() -> None:
    mx.set_default_device(mx.cpu)
    model, tokenizer = mlx_lm.load(str(MODEL))
    window = json.loads((MODEL / "config.json").read_text())["sliding_window"]
    candidates = ((doc, n) for n in PROMPT_TOKENS for doc in corpus.load("heldout"))
    for doc, n in candidates:
        ids = tokenizer.encode(doc["text"])[:n]
        if len(ids) + N_TOKENS <= window:
            continue
        res = greedy_oracle(model, ids, N_TOKENS)
        if res["token_margins"].min() >= MIN_MARGIN:
            break
    else:
        raise SystemExit(f"no held-out chapter and prompt length give greedy margins of "
                         f"{MIN_MARGIN}")
    gs_tokens, _ = generate_step_oracle(model, ids, N_TOKENS)
    assert np.array_equal(gs_tokens, res["tokens"]), "mlx-lm's generate_step disagrees"
    OUT.mkdir(parents=True, exist_ok=True)
    tensors = {"prompt_ids": mx.array(res["prompt_ids"]), "tokens": mx.array(res["tokens"]),
               "prompt_logits": mx.array(res["prompt_logits"]).astype(mx.bfloat16),
               "token_logits": mx.array(res["token_logits"]).astype(mx.bfloat16),
               "token_margins": mx.array(res["token_margins"])}
    mx.save_safetensors(str(OUT / "oracle.safetensors"), tensors,
                        metadata={"format": "mlx-lm-oracle"})
    meta = {
        "model": "models/kjv-gemma4",
        "mlx_version": mx.__version__,
        "mlx_lm_version": mlx_lm.__version__,
        "prompt_citation": doc["citation"],
        "prompt_len": len(ids),
        "prompt_text": tokenizer.decode(ids[1:]),
        "n_tokens": N_TOKENS,
        "generated_text": tokenizer.decode(res["tokens"].tolist()),
        "min_token_margin": float(res["token_margins"].min()),
    }
    (OUT / "oracle.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(json.dumps(meta, indent=2))


if __name__ == "__main__":
    main()
