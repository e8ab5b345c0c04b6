#!/usr/bin/env python3
"""mlx-lm's own prefill / decode speed for a checkpoint, as one JSON line.

    tests/oracle/.venv/bin/python tests/oracle/mlx_lm_decode.py DIR [--prompt-len 128]
        [--gen-len 128] [--warmup 1]

Prints {"prefill_tokens_per_s": ..., "decode_tokens_per_s": ..., ...}. The numbers are
mlx-lm's stream_generate's own (prompt_tps, generation_tps) with greedy sampling; EOS does not
stop generation, so exactly --gen-len tokens are produced. The prompt is a fixed token sequence
(<bos> then ids cycling through the vocabulary), so runs are comparable across implementations.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import mlx.core as mx  # noqa: E402
import mlx_lm  # noqa: E402
from mlx_lm.generate import stream_generate  # noqa: E402


def prompt_ids(length: int, vocab: int, bos: int = 2, first: int = 10) -> list:
    span = max(1, vocab - first)
    return [bos] + [first + (i * 7919) % span for i in range(length - 1)]


def run(model, tokenizer, prompt, gen_len):
    last = None
    for resp in stream_generate(model, tokenizer, mx.array(prompt, dtype=mx.int32),
                                max_tokens=gen_len):
        last = resp
    return last


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen-len", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=1, help="untimed runs first")
    args = ap.parse_args()
    if args.prompt_len < 1 or args.gen_len < 2:
        ap.error("--prompt-len >= 1 and --gen-len >= 2")

    model, tokenizer, config = mlx_lm.load(args.checkpoint, return_config=True)
    tokenizer.eos_token_ids = set()  # never stop early: exactly gen_len tokens
    vocab = config.get("vocab_size") or config.get("text_config", {}).get("vocab_size")
    prompt = prompt_ids(args.prompt_len, vocab)
    for _ in range(args.warmup):
        run(model, tokenizer, prompt, min(args.gen_len, 8))
    resp = run(model, tokenizer, prompt, args.gen_len)
    print(json.dumps({
        "prefill_tokens_per_s": round(resp.prompt_tps, 3),
        "decode_tokens_per_s": round(resp.generation_tps, 3),
        "prompt_tokens": resp.prompt_tokens,
        "generation_tokens": resp.generation_tokens,
        "peak_memory_gb": round(resp.peak_memory, 4),
        "checkpoint": os.path.abspath(args.checkpoint),
        "mlx_version": mx.__version__,
        "mlx_lm_version": mlx_lm.__version__,
        "device": str(mx.default_device()),
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
