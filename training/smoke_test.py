"""Smoke test of the trainers on their tiny presets (run by `make test`, about two minutes):
the training forms of GeGLU and the softcapped loss give mlx-lm's gradients, the target's loss
falls, a run interrupted halfway and resumed ends exactly where an uninterrupted run ends (its
weights averaged over the same steps), a run directory of another recipe is refused by name,
and two data-parallel processes compute one's gradients; then each drafter trainer, run as its
command (as two processes), learns from that tiny target for a few steps (its loss falls) and
writes a checkpoint (the assistant's with its centroid head), and so does the trainer
`host new-drafter --trainable` writes for a new kind."""

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models import gemma4_text

import corpus
import loop
import tokenizer as tk
import train_lookup
import train_target as tt

HERE = Path(__file__).resolve().parent
DRAFTERS = {"dflash": "config.json", "dspark": "dspark.json", "deepspec": "config.json",
            "assistant": "config.json"}


def run(run_dir: Path, stream, stop_at: int = 0):
    p = tt.PRESETS["tiny"]
    model = tt.build(p["config"], seed=0, dropout=p["dropout"])
    last = loop.train(run_dir, model, tt.lm_loss, tt.batches(stream, p["batch"], p["seq"], 0),
                      steps=p["steps"], log_every=5, desc="smoke", stop_at=stop_at,
                      **tt.recipe(p))
    return model, last


def tiny_corpus():
    docs = corpus.load("train")[:40]
    tok = tk.train([d["text"] for d in docs])
    return docs, tok, tt.token_stream(tok, docs)


def data_parallel(out: Path) -> None:
    """`smoke_test.py --data-parallel FILE`: the tiny target's loss and gradients on its first
    batch, computed by two processes (without dropout, whose masks differ by process)."""
    loop.spawn(2)
    group = loop.world()
    loss, grads = first_gradients(tiny_corpus()[2], group)
    mx.eval(loss, grads)  # every rank, so that each takes part in the sums
    if loop.leader():
        mx.save_safetensors(str(out), {"loss": loss, **dict(tree_flatten(grads))})


def first_gradients(stream, group):
    p = tt.PRESETS["tiny"]
    model = tt.build(p["config"], seed=0, dropout=0.0)
    batch = tt.batches(stream, p["batch"], p["seq"], 0)(0)
    value_and_grad = nn.value_and_grad(model, tt.lm_loss)
    return loop.world_gradients(model, value_and_grad, loop.share(batch, group), group)


def fused_matches_mlx_lm(stream) -> None:
    """The training forms of GeGLU and the softcapped cross-entropy (`fused`) give mlx-lm's
    loss and gradients on the tiny target."""
    p = tt.PRESETS["tiny"]
    model = tt.build(p["config"], seed=0, dropout=0.0)
    plain = gemma4_text.Model(gemma4_text.ModelArgs.from_dict(p["config"]))
    plain.update(model.parameters())

    def mlx_lm_loss(m, inputs, targets):
        return nn.losses.cross_entropy(m(inputs).astype(mx.float32), targets, reduction="mean")

    batch = tt.batches(stream, p["batch"], p["seq"], 0)(0)
    loss, grads = nn.value_and_grad(model, tt.lm_loss)(model, *batch)
    ref_loss, ref = nn.value_and_grad(plain, mlx_lm_loss)(plain, *batch)
    assert abs(loss.item() - ref_loss.item()) <= 1e-5 * ref_loss.item(), (loss, ref_loss)
    ref = dict(tree_flatten(ref))
    scale = max(mx.abs(g).max().item() for g in ref.values())
    worst = max(mx.abs(g - ref[k]).max().item() for k, g in tree_flatten(grads))
    assert worst <= 1e-4 * scale, f"fused gradients differ from mlx-lm's by {worst}"
    print(f"smoke: fused GeGLU and softcapped cross-entropy give mlx-lm's loss and gradients "
          f"(largest difference {worst / scale:.1e} of the largest gradient)")


def main() -> None:
    loop.compile_for_this_cpu()
    docs, tok, stream = tiny_corpus()
    fused_matches_mlx_lm(stream)
    steps = tt.PRESETS["tiny"]["steps"]
    with tempfile.TemporaryDirectory() as tmp:
        whole, last = run(Path(tmp) / "whole", stream)
        log = (Path(tmp) / "whole" / "log.jsonl").read_text().splitlines()
        first = json.loads(log[0])["loss"]
        assert last["loss"] < first - 0.5, f"loss did not fall: {first} -> {last['loss']}"
        averaged = json.loads((Path(tmp) / "whole" / "state.json").read_text())["averaged"]
        assert averaged == tt.PRESETS["tiny"]["average_last"] // tt.PRESETS["tiny"]["average_every"]

        # Stopped inside the averaged steps: the resumed run carries the saved sum on.
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

        # A run directory saved by another recipe is refused by name, not half loaded.
        p = tt.PRESETS["tiny"]
        other = tt.build(dict(p["config"], intermediate_size=64), seed=0)
        try:
            loop.train(Path(tmp) / "whole", other, tt.lm_loss,
                       tt.batches(stream, p["batch"], p["seq"], 0), steps=p["steps"] + 1,
                       **tt.recipe(p))
            raise AssertionError("a run directory of another model was resumed")
        except SystemExit as e:
            assert str(Path(tmp) / "whole" / "state.safetensors") in str(e), e
            print(f"smoke: another model's run directory is refused: {e}")

        # Each of two processes takes half of the batch and their gradients are averaged: the
        # gradients of the whole batch, up to float32 summation order.
        two = Path(tmp) / "two.safetensors"
        subprocess.run([sys.executable, __file__, "--data-parallel", str(two)], check=True)
        two = mx.load(str(two))
        loss, grads = first_gradients(stream, loop.world())
        assert abs(loss.item() - two["loss"].item()) <= 1e-5 * loss.item(), (loss, two["loss"])
        scale = max(mx.abs(g).max().item() for _, g in tree_flatten(grads))
        worst = max(mx.abs(g - two[k]).max().item() for k, g in tree_flatten(grads))
        assert worst <= 1e-4 * scale, f"two processes' gradients differ from one's by {worst}"
        print(f"smoke: two data-parallel processes give one's loss and gradients (largest "
              f"difference {worst / scale:.1e} of the largest gradient)")

        target = Path(tmp) / "target"
        tt.export(whole, tt.PRESETS["tiny"]["config"], tok, target)
        # A re-export (as `make demo-model` on a trained family) keeps the drafters' files.
        (target / "bench-prompts.jsonl").write_text("{}\n")
        tt.export(whole, tt.PRESETS["tiny"]["config"], tok, target)
        assert (target / "bench-prompts.jsonl").exists(), "export removed the model's other files"
        for kind, config in DRAFTERS.items():
            run_dir, out = Path(tmp) / f"run-{kind}", Path(tmp) / f"out-{kind}"
            subprocess.run([sys.executable, str(HERE / f"train_{kind}.py"), "--preset", "tiny",
                            "--target", str(target), "--run", str(run_dir), "--out", str(out),
                            "--data", str(Path(tmp) / "data")], check=True)
            log = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]
            assert log[-1]["loss"] < log[0]["loss"], f"{kind}: loss did not fall: {log}"
            for name in (config, "model.safetensors", "README.md"):
                assert (out / name).exists(), f"{kind}: no {name}"
            if kind == "assistant":
                cfg = json.loads((out / config).read_text())
                assert cfg["use_ordered_embeddings"] and cfg["num_centroids"] > 0, cfg
                assert "## Centroid head" in (out / "README.md").read_text()
            print(f"smoke: {kind} loss {log[0]['loss']:.3f} -> {log[-1]['loss']:.3f}, wrote "
                  f"{config}, model.safetensors and its card")

        # The trainer `host new-drafter --trainable` writes, as it writes it, on the tiny target:
        # it reads the training signal from drafter_data and its table beats the most common
        # token on the held-out continuations.
        template = (HERE.parent / "host/templates/drafter/train.py.in").read_text()
        script = Path(tmp) / "new-kind" / "train.py"
        script.parent.mkdir()
        script.write_text(template.replace("@NAME@", "smoke").replace("@TRAINING@", str(HERE))
                          .replace("@MODEL@", str(target)))
        subprocess.run([sys.executable, str(script), "--preset", "tiny", "--out",
                        str(script.parent / "trained"), "--data", str(Path(tmp) / "data")], check=True)
        report = json.loads((script.parent / "trained" / "config.json").read_text())
        assert report["vocab_size"] == tt.PRESETS["tiny"]["config"]["vocab_size"], report
        # A tiny target whose greedy continuations are one token throughout leaves nothing to
        # beat: the most common token already agrees everywhere, and so must the table.
        assert (report["held_out_agreement"] > report["held_out_agreement_of_the_most_common_token"]
                or report["held_out_agreement"] == 1.0), report
        assert (script.parent / "trained" / "next_tokens.safetensors").exists()
        print(f"smoke: a new kind's trainer agrees with the target on "
              f"{report['held_out_agreement']:.0%} of held-out tokens (the most common token: "
              f"{report['held_out_agreement_of_the_most_common_token']:.0%})")

        # The lookup datastore: the target's greedy continuations of windows of the text, each
        # example after <bos>; a second run reuses the kept batches and writes the same file.
        text, out = Path(tmp) / "text.txt", Path(tmp) / "out-lookup"
        text.write_text("\n\n".join(d["text"] for d in docs[:2]))
        command = [sys.executable, str(HERE / "train_lookup.py"), "--preset", "tiny", "--target", str(target),
                   "--out", str(out), "--text", str(text), "--run", str(Path(tmp) / "run-lookup")]
        written = []
        for _ in range(2):
            subprocess.run(command, check=True)
            written.append((out / "datastore.safetensors").read_bytes())
        assert written[0] == written[1], "lookup: a resumed run wrote another datastore"
        ids = mx.load(str(out / "datastore.safetensors"))["token_ids"].tolist()
        p = train_lookup.PRESETS["tiny"]
        stream = [tk.BOS_ID] + tok.encode(docs[0]["text"], add_special_tokens=False).ids
        assert ids[:1 + p["prefix"]] == [tk.BOS_ID] + stream[:p["prefix"]], ids[:1 + p["prefix"]]
        assert p["examples"] * (1 + p["prefix"]) <= len(ids) <= p["examples"] * (1 + p["prefix"] + p["greedy"])
        assert (out / "README.md").exists(), "lookup: no README.md"
        print(f"smoke: lookup wrote {len(ids)} token ids and its card; a second run wrote the same")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--data-parallel"]:
        data_parallel(Path(sys.argv[2]))
    else:
        main()
