"""Writes the held-out prompts `host bench --sweep` measures drafters on: the opening two verses
of 20 held-out chapters spread over the whole Bible, one JSON request per line. No prompt is in
the training text, and each comes from a different chapter.

    python bench_prompts.py [--out ../models/kjv-gemma4/bench-prompts.jsonl]
"""

import argparse
import json
from pathlib import Path

import corpus

HERE = Path(__file__).resolve().parent
PROMPTS, VERSES = 20, 2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path,
                    default=HERE.parent / "models" / "kjv-gemma4" / "bench-prompts.jsonl")
    args = ap.parse_args()
    chapters = corpus.load("heldout")
    picks = [chapters[i * len(chapters) // PROMPTS] for i in range(PROMPTS)]
    with args.out.open("w") as f:
        for c in picks:
            opening = "\n".join(c["text"].split("\n")[:VERSES]) + "\n"
            f.write(json.dumps({"id": c["citation"], "prompt": opening}) + "\n")
    print(f"wrote {len(picks)} prompts to {args.out}")


if __name__ == "__main__":
    main()
