"""A resumable MLX training loop shared by the target and the drafters.

The run directory holds `state.safetensors` (weights and optimizer state), `state.json` (the
step it belongs to) and `log.jsonl` (one line per logged step). A run restarted with the same
arguments continues from its last saved step; batches depend only on (seed, step), so a resumed
run sees exactly the batches an uninterrupted one would have.
"""

import json
import math
import os
import time
from pathlib import Path
from typing import Callable, Dict, Optional

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten, tree_unflatten
from tqdm import tqdm


def cosine_schedule(lr: float, steps: int, warmup: int, final_fraction: float = 0.1):
    warm = optim.linear_schedule(lr * 0.01, lr, max(1, warmup))
    decay = optim.cosine_decay(lr, max(1, steps - warmup), lr * final_fraction)
    return optim.join_schedules([warm, decay], [max(1, warmup)])


def save_state(run: Path, step: int, model: nn.Module, opt: optim.Optimizer) -> None:
    arrays = {f"model.{k}": v for k, v in tree_flatten(model.parameters())}
    arrays.update({f"opt.{k}": v for k, v in tree_flatten(opt.state)})
    tmp = run / "state.tmp.safetensors"
    mx.save_safetensors(str(tmp), arrays)
    os.replace(tmp, run / "state.safetensors")
    (run / "state.json").write_text(json.dumps({"step": step}) + "\n")


def load_state(run: Path, model: nn.Module, opt: optim.Optimizer) -> int:
    """The step the run directory was saved at (0 when it holds no state)."""
    if not (run / "state.json").exists():
        return 0
    step = json.loads((run / "state.json").read_text())["step"]
    arrays = mx.load(str(run / "state.safetensors"))
    model.load_weights([(k[len("model."):], v) for k, v in arrays.items()
                        if k.startswith("model.")], strict=True)
    opt.state = tree_unflatten([(k[len("opt."):], v) for k, v in arrays.items()
                                if k.startswith("opt.")])
    mx.eval(model.parameters(), opt.state)
    return step


def train(run: Path, model: nn.Module, loss_fn: Callable, batch_at: Callable[[int], tuple],
          steps: int, lr: float, warmup: int, weight_decay: float = 0.1, clip: float = 1.0,
          save_every: int = 200, log_every: int = 10, desc: str = "train",
          tokens_per_step: int = 0, stop_at: int = 0,
          heldout: Optional[Callable[[nn.Module], float]] = None, heldout_every: int = 0,
          seed: int = 0) -> Dict:
    """Runs `loss_fn(model, *batch_at(step))` for steps [resume point, steps) with AdamW.

    Returns the last logged figures. `tokens_per_step` only feeds the progress bar's rate;
    `stop_at` ends the run early at that step, saved, as an interruption would. `heldout(model)`,
    a loss on text training never sees, is logged every `heldout_every` steps and at the end.
    Random draws inside the model (dropout) depend on (seed, step) only, like the batches.
    """
    run.mkdir(parents=True, exist_ok=True)
    opt = optim.AdamW(learning_rate=cosine_schedule(lr, steps, warmup),
                      weight_decay=weight_decay)
    opt.init(model.trainable_parameters())
    start = load_state(run, model, opt)
    log = run / "log.jsonl"
    if start == 0 and log.exists():
        log.unlink()

    value_and_grad = nn.value_and_grad(model, loss_fn)
    state = [model.state, opt.state, mx.random.state]

    @mx.compile
    def step_fn(*batch):
        loss, grads = value_and_grad(model, *batch)
        grads, _ = optim.clip_grad_norm(grads, clip)
        opt.update(model, grads)
        return loss

    compiled = mx.compile(step_fn, inputs=state, outputs=state)
    bar = tqdm(total=steps, initial=start, desc=desc, dynamic_ncols=True,
               unit="step", smoothing=0.05)
    losses, t_last, last = [], time.perf_counter(), {}
    for step in range(start, steps):
        mx.random.seed(seed * 1_000_003 + step)
        loss = compiled(*batch_at(step))
        mx.eval(loss, state)
        losses.append(loss.item())
        bar.update(1)
        done = step + 1
        if done % log_every == 0 or done == steps:
            now = time.perf_counter()
            rate = tokens_per_step * len(losses) / (now - t_last)
            last = {"step": done, "loss": sum(losses) / len(losses),
                    "lr": float(opt.learning_rate), "tokens_per_s": rate,
                    "time": time.time()}
            with log.open("a") as f:
                f.write(json.dumps(last) + "\n")
            bar.set_postfix(loss=f"{last['loss']:.3f}", tok_s=f"{rate:.0f}")
            losses, t_last = [], now
        if heldout is not None and (done % heldout_every == 0 or done == steps):
            with log.open("a") as f:
                f.write(json.dumps({"step": done, "heldout": heldout(model)}) + "\n")
        if done % save_every == 0 or done == steps or done == stop_at:
            save_state(run, done, model, opt)
        if done == stop_at:
            break
    bar.close()
    if not math.isfinite(last.get("loss", 0.0)):
        raise SystemExit(f"{desc}: loss is {last['loss']} at step {last['step']}")
    return last
