#!/usr/bin/env python3
"""The host against llama.cpp, decode and prefill, paired and interleaved: what
`make bench-llamacpp` runs once the models and GGUFs are made.

    bench.py --out target/llamacpp/results [--pairs 3] [--models demo,bench,bench-large]
             [--llama-bench PATH] [--llama-bench-args "--repack 0"]

For each model and format it runs `host bench --manifest M --llama-bench B --gguf G
--prompt-tokens 512 --max-tokens 128 --json`, which alternates the host's plain decoding of the
MLX checkpoint with llama-bench on the GGUF (prefill of 512 tokens, and decode of 128 from an
empty context timed apart, by both; 2 threads), and writes the results as JSON and as a
Markdown table: medians of host / llama.cpp with their ranges, the rates, and each program's
share of the two-thread read bandwidth measured with each pair. The host's x86 route is whatever HOST_SIMD and HOST_AMX leave it (the table says).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LLAMACPP = ROOT / "target" / "llamacpp"
HOST = ROOT / "target" / "release" / "host"

# name: (MLX checkpoint directory per format, GGUF stem), formats as llama.cpp names them.
FORMATS = ["f32", "bf16", "q8_0", "q4_0"]
MODELS = {
    "demo": ("kjv-gemma4", {"f32": "kjv-gemma4-f32", "bf16": "kjv-gemma4", "q8_0": "kjv-gemma4-q8", "q4_0": "kjv-gemma4-q4"}),
    "bench": ("bench-model", {"f32": "bench-model", "bf16": "bench-model-bf16", "q8_0": "bench-model-q8", "q4_0": "bench-model-q4"}),
    "bench-large": ("bench-model-large", {"f32": "bench-model-large", "bf16": "bench-model-large-bf16",
                                          "q8_0": "bench-model-large-q8", "q4_0": "bench-model-large-q4"}),
}
TITLES = {"demo": "demo target (10M)", "bench": "bench model (40M)", "bench-large": "bench model (1.3B)"}


def manifest(out: Path, mlx_dir: Path) -> Path:
    path = out / "manifests" / f"{mlx_dir.name}.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f'[target]\nmodel = "{mlx_dir}"\n\n[generation]\nprompt = "In the beginning"\nmax_tokens = 128\n')
    return path


def run(name: str, fmt: str, pairs: int, out: Path, llama_bench: Path, llama_args: str) -> dict:
    stem, dirs = MODELS[name]
    mlx_dir = (ROOT / "target" / dirs[fmt]).resolve()
    gguf = LLAMACPP / "gguf" / f"{stem}-{fmt}.gguf"
    command = [str(HOST), "bench", "--manifest", str(manifest(out, mlx_dir)),
               "--llama-bench", str(llama_bench), "--gguf", str(gguf),
               "--prompt-tokens", "512", "--max-tokens", "128", "--pairs", str(pairs), "--json"]
    if llama_args:
        command += ["--llama-bench-args", llama_args]
    print(f"bench-llamacpp: {name} {fmt}", file=sys.stderr, flush=True)
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(done.stdout)


def median_range(values: list) -> tuple:
    return statistics.median(values), min(values), max(values)


def cell(r: dict, what: str) -> str:
    if "error" in r:
        # "running the reference (COMMAND): WHAT": what went wrong, without the command.
        said = re.sub(r"\S*/", "", r["error"].split("): ")[-1])
        return "not run: " + said.replace("|", "/")[:100]
    ratio, lo, hi = median_range(r[f"{what}_ratios"])
    key = f"{what}_tokens_per_s"
    host = median_range([t[key] for t in r["host"]])[0]
    other = median_range([t[key] for t in r["reference"]])[0]
    text = f"**{ratio:.2f}×** [{lo:.2f}, {hi:.2f}] ({host:.1f} vs {other:.1f})"
    if what == "decode" and r.get("host_share_of_two_threads") and r.get("reference_share_of_two_threads"):
        text += f"; {100 * r['host_share_of_two_threads']:.0f}% vs {100 * r['reference_share_of_two_threads']:.0f}%"
    return text


def table(results: dict, llama_args: str) -> str:
    routes = sorted({r["host_route"] for m in results.values() for r in m.values() if "host_route" in r})
    bandwidth = [r["memory_gb_per_s_two_threads"] for m in results.values() for r in m.values()
                 if r.get("memory_gb_per_s_two_threads")]
    lines = [
        f"Host ÷ llama.cpp, median [range] over the pairs (host vs llama.cpp tok/s); decode cells add each "
        f"program's share of the two-thread read bandwidth. Host route: {', '.join(routes) or 'unknown'}. "
        f"Two threads read {min(bandwidth, default=0):.1f}–{max(bandwidth, default=0):.1f} GB/s during the runs."
        + (f" llama-bench ran with `{llama_args}`." if llama_args else ""),
        "",
        "| model | " + " | ".join(FORMATS) + " |",
        "|---|" + "---|" * len(FORMATS),
    ]
    for name, by_format in results.items():
        for what in ("decode", "prefill"):
            label = TITLES[name] + (", prefill of 512" if what == "prefill" else ", decode of 128")
            lines.append(f"| {label} | " + " | ".join(cell(by_format[f], what) if f in by_format else "" for f in FORMATS) + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=LLAMACPP / "results")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--models", default="demo,bench,bench-large")
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--llama-bench", type=Path, default=LLAMACPP / "build" / "bin" / "llama-bench",
                    help="the llama-bench binary (another build of the same llama.cpp)")
    ap.add_argument("--llama-bench-args", default="",
                    help='more llama-bench arguments, e.g. "--repack 0" where its AMX path crashes')
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results = {}
    for name in args.models.split(","):
        results[name] = {fmt: run(name, fmt, args.pairs, args.out, args.llama_bench, args.llama_bench_args)
                         for fmt in args.formats.split(",")}
        (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    text = table(results, args.llama_bench_args)
    (args.out / "results.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
