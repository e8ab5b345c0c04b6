"""Gathers the GPU check's measurements (scripts/gpu-check.sh) into gpu-check.json and a short
Markdown table, gpu-check.md, in the check's output directory."""

import argparse
import datetime
import json
import statistics
from pathlib import Path


def median(values):
    return statistics.median(values) if values else float("nan")


def plain_row(name, bench):
    host = median([t["decode_tokens_per_s"] for t in bench["host"]])
    reference = median([t["decode_tokens_per_s"] for t in bench["reference"]])
    ratios = bench["decode_ratios"]
    return {
        "target": name,
        "host_tokens_per_s": host,
        "mlx_lm_tokens_per_s": reference,
        "ratio_median": median(ratios),
        "ratio_range": [min(ratios), max(ratios)] if ratios else None,
        "step_ms": bench["step_ms"],
        "window_over_step": bench["window_over_step"],
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--card", required=True)
    parser.add_argument("--seconds", type=int, required=True)
    args = parser.parse_args()

    doctor = json.loads((args.out / "doctor.json").read_text())
    plain = [
        plain_row(name, json.loads((args.out / f"plain-{stem}.json").read_text()))
        for name, stem in [("demo target", "demo-plain"), ("262,144-token bench model", "bench-262k")]
    ]
    sweep = json.loads((args.out / "drafters.json").read_text())
    drafters = [
        {
            "drafter": r["drafter"],
            "mode": r["mode"],
            "draft_tokens": r["draft_tokens"],
            "tau": r["tau"],
            "speedup_median": r["speedup_median"],
            "speedup_range": [r["speedup_min"], r["speedup_max"]],
            "identical": r["identical"],
            "prompts": sweep["prompts"],
            "first_difference": r["first_difference"],
            "draft_ms_per_round": r["draft_ms_per_round"],
            "verify_ms_per_round": r["verify_ms_per_round"],
        }
        for r in sweep["rows"]
    ]
    result = {
        "date": datetime.date.today().isoformat(),
        "card": args.card,
        "libmlx": doctor.get("libmlx_path"),
        "device": doctor.get("device"),
        "seconds": args.seconds,
        "max_tokens": sweep["max_tokens"],
        "temperature": sweep["temperature"],
        "top_p": sweep["top_p"],
        "plain": plain,
        "drafters": drafters,
    }
    (args.out / "gpu-check.json").write_text(json.dumps(result, indent=2) + "\n")

    lines = [
        f"GPU check, {result['date']}, {args.card} ({args.seconds} s)",
        "",
        "| target | host, plain | mlx-lm | ratio (range) |",
        "|---|---|---|---|",
    ]
    for p in plain:
        low, high = p["ratio_range"] or (float("nan"), float("nan"))
        lines.append(
            f"| {p['target']} | {p['host_tokens_per_s']:.0f} tok/s | {p['mlx_lm_tokens_per_s']:.0f} tok/s "
            f"| {p['ratio_median']:.2f}× [{low:.2f}, {high:.2f}] |"
        )
    lines += [
        "",
        f"Drafters on the demo target, γ {drafters[0]['draft_tokens'] if drafters else '-'}, "
        f"{sweep['prompts']} prompts of {sweep['max_tokens']} tokens; sampled: temperature "
        f"{sweep['temperature']}, top-p {sweep['top_p']}",
        "",
        "| drafter | mode | τ | speed-up (range) | equal to plain | first parted at | round: draft + verify, ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for d in drafters:
        low, high = d["speedup_range"]
        parted = sorted(p for p in d["first_difference"] if p is not None)
        lines.append(
            f"| {d['drafter']} | {d['mode']} | {d['tau']:.2f} | {d['speedup_median']:.2f}× [{low:.2f}, {high:.2f}] "
            f"| {d['identical']}/{d['prompts']} | {', '.join(map(str, parted)) or '-'} "
            f"| {d['draft_ms_per_round']:.1f} + {d['verify_ms_per_round']:.1f} |"
        )
    (args.out / "gpu-check.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
