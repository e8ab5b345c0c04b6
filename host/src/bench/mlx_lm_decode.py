#!/usr/bin/env python3
"""mlx-lm's own prefill / decode speed for a checkpoint, as one JSON line.

    tests/oracle/.venv/bin/python host/src/bench/mlx_lm_decode.py DIR [--prompt-len 128]
        [--gen-len 128] [--warmup 1]
    tests/oracle/.venv/bin/python host/src/bench/mlx_lm_decode.py --model DIR
        --prompt-ids 2,17,301,... --max-tokens 128        # the form `host bench` uses

`host bench` carries this script inside its binary and runs it with `python -c`.

Prints {"prefill_tokens_per_s": ..., "decode_tokens_per_s": ..., ...} from mlx-lm's
stream_generate with greedy sampling; EOS does not stop generation, so exactly the requested
number of tokens is produced. prefill_tokens_per_s is mlx-lm's own prompt_tps (prompt tokens /
time to the first token). decode_tokens_per_s is (tokens - 1) / (time from the first token to
the last), taken as mlx-lm yields them; mlx-lm's own generation_tps, which counts one token more
over the same span, is printed too. Without --prompt-ids the prompt is a fixed sequence (<bos>
then ids cycling through the vocabulary), so runs are comparable across implementations.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

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
    """The last response and the times at which the first and the last token arrived."""
    last, t_first, t_last = None, None, None
    for resp in stream_generate(model, tokenizer, mx.array(prompt, dtype=mx.int32),
                                max_tokens=gen_len):
        t_last = time.perf_counter()
        if t_first is None:
            t_first = t_last
        last = resp
    return last, t_first, t_last


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint", nargs="?", help="checkpoint directory")
    ap.add_argument("--model", help="checkpoint directory (instead of the positional one)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--prompt-ids", help="comma-separated prompt token ids (overrides --prompt-len)")
    ap.add_argument("--gen-len", "--max-tokens", dest="gen_len", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=1, help="untimed runs first")
    args = ap.parse_args()
    checkpoint = args.model or args.checkpoint
    if not checkpoint:
        ap.error("give the checkpoint directory (positional or --model)")
    if args.gen_len < 2:
        ap.error("--gen-len/--max-tokens must be >= 2")

    model, tokenizer, config = mlx_lm.load(checkpoint, return_config=True)
    tokenizer.eos_token_ids = set()  # never stop early: exactly gen_len tokens
    if args.prompt_ids:
        prompt = [int(t) for t in args.prompt_ids.split(",") if t.strip()]
    else:
        vocab = config.get("vocab_size") or config.get("text_config", {}).get("vocab_size")
        prompt = prompt_ids(args.prompt_len, vocab)
    if not prompt:
        ap.error("empty prompt")
    for _ in range(args.warmup):
        run(model, tokenizer, prompt, min(args.gen_len, 8))
    resp, t_first, t_last = run(model, tokenizer, prompt, args.gen_len)
    n = resp.generation_tokens
    decode = (n - 1) / (t_last - t_first) if t_last > t_first else float("nan")
    print(json.dumps({
        "prefill_tokens_per_s": round(resp.prompt_tps, 3),
        "decode_tokens_per_s": round(decode, 3),
        "mlx_lm_generation_tps": round(resp.generation_tps, 3),
        "prompt_tokens": resp.prompt_tokens,
        "generation_tokens": n,
        "peak_memory_gb": round(resp.peak_memory, 4),
        "checkpoint": os.path.abspath(checkpoint),
        "mlx_version": mx.__version__,
        "mlx_lm_version": mlx_lm.__version__,
        "device": str(mx.default_device()),
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
