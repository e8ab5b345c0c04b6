"""Smoke test of the target trainer on the tiny preset (run by `make test`, under a minute):
the loss falls, and a run interrupted halfway and resumed ends exactly where an uninterrupted
run ends."""

import json
import tempfile
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

import corpus
import loop
import tokenizer as tk
import train_target as tt


def run(run_dir: Path, stream, stop_at: int = 0):
    p = tt.PRESETS["tiny"]
    model = tt.build(p["config"], seed=0, dropout=p["dropout"])
    last = loop.train(run_dir, model, tt.lm_loss, tt.batches(stream, p["batch"], p["seq"], 0),
                      steps=p["steps"], lr=p["lr"], warmup=p["warmup"], log_every=5,
                      desc="smoke", stop_at=stop_at, tokens_per_step=p["batch"] * p["seq"])
    return model, last


def main() -> None:
    docs = corpus.load("train")[:40]
    tok = tk.train([d["text"] for d in docs])
    stream = tt.token_stream(tok, docs)
    steps = tt.PRESETS["tiny"]["steps"]
    with tempfile.TemporaryDirectory() as tmp:
        whole, last = run(Path(tmp) / "whole", stream)
        log = (Path(tmp) / "whole" / "log.jsonl").read_text().splitlines()
        first = json.loads(log[0])["loss"]
        assert last["loss"] < first - 0.5, f"loss did not fall: {first} -> {last['loss']}"

        _, half = run(Path(tmp) / "resumed", stream, stop_at=steps // 2)
        assert half["step"] == steps // 2, half
        resumed, last_resumed = run(Path(tmp) / "resumed", stream)
        assert last_resumed["step"] == steps
        a = dict(tree_flatten(whole.parameters()))
        b = dict(tree_flatten(resumed.parameters()))
        worst = max(mx.abs(a[k] - b[k]).max().item() for k in a)
        assert worst <= 1e-5, f"resumed weights differ from the uninterrupted run by {worst}"
        print(f"smoke: loss {first:.3f} -> {last['loss']:.3f}; resumed run matches "
              f"(largest weight difference {worst:.1e})")


if __name__ == "__main__":
    main()
