"""A resumable MLX training loop shared by the target and the drafters.

The run directory holds `state.safetensors` (weights and optimizer state), `state.json` (the
step it belongs to) and `log.jsonl` (one line per logged step). A run restarted with the same
arguments continues from its last saved step; batches depend only on (seed, step), so a resumed
run sees exactly the batches an uninterrupted one would have.

Data parallel: a script that calls `spawn(n)` first runs as n processes joined by MLX's ring
backend; each takes its share of every batch and the gradients are averaged. On MLX's CPU
backend this trains much faster on two cores: the transcendental functions (the softcapped
head's tanh and softmax, GELU) run on one thread, and one process leaves the other core idle.
"""

import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, Optional

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten, tree_map, tree_unflatten
from tqdm import tqdm


def cosine_schedule(lr: float, steps: int, warmup: int, final_fraction: float = 0.1):
    warm = optim.linear_schedule(lr * 0.01, lr, max(1, warmup))
    decay = optim.cosine_decay(lr, max(1, steps - warmup), lr * final_fraction)
    return optim.join_schedules([warm, decay], [max(1, warmup)])


def spawn(processes: int) -> None:
    """Re-runs this script as `processes` ranks on this machine and exits with their status.

    Does nothing when `processes` is 1 or this process is already a rank. Rank 0 keeps the
    terminal; the others' output is dropped but for errors. The CPU cores are split evenly
    between the ranks' BLAS threads, so that they do not fight over cores.
    """
    if processes <= 1 or "MLX_RANK" in os.environ:
        return
    ports = []
    for _ in range(processes):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump([[f"127.0.0.1:{p}"] for p in ports], f)
    threads = str(max(1, (os.cpu_count() or processes) // processes))
    ranks = []
    for rank in range(processes):
        env = dict(os.environ, MLX_RANK=str(rank), MLX_HOSTFILE=f.name,
                   OPENBLAS_NUM_THREADS=threads, OMP_NUM_THREADS=threads)
        ranks.append(subprocess.Popen([sys.executable, *sys.argv], env=env,
                                      stdout=None if rank == 0 else subprocess.DEVNULL))
    try:
        # Until every rank is done, or one has failed (the others would wait on it forever).
        while any(r.poll() is None for r in ranks) and not any(r.returncode for r in ranks):
            time.sleep(0.5)
        status = next((r.returncode for r in ranks if r.returncode), 0)
    finally:
        for r in ranks:
            if r.poll() is None:
                r.terminate()
        os.unlink(f.name)
    sys.exit(status)


def world() -> mx.distributed.Group:
    """The processes training together (a group of one unless started by `spawn`)."""
    # strict: a rank that cannot join its group must fail, not go on training alone.
    return mx.distributed.init(strict="MLX_RANK" in os.environ, backend="ring")


def leader() -> bool:
    """Whether this process writes files and reports (rank 0, or the only process)."""
    return world().rank() == 0


def barrier() -> None:
    """Waits until every process of the group gets here."""
    mx.eval(mx.distributed.all_sum(mx.array(1), group=world()))


def leader_first(make: Callable[[], Any]) -> Any:
    """`make()` on the first process, then on the others: for work that caches what it makes,
    so the others read its cache instead of writing the same files."""
    if not leader():
        barrier()
    made = make()
    if leader():
        barrier()
    return made


def share(batch: tuple, group: mx.distributed.Group) -> tuple:
    """This process's rows of a batch: every array split evenly along its first axis."""
    n = group.size()
    if n == 1:
        return batch
    rows = batch[0].shape[0]
    if any(a.shape[0] != rows for a in batch) or rows % n:
        raise SystemExit(f"a batch of {rows} rows does not split evenly over {n} processes")
    k = rows // n
    return tuple(a[group.rank() * k:(group.rank() + 1) * k] for a in batch)


def world_gradients(model: nn.Module, value_and_grad: Callable, batch: tuple,
                    group: mx.distributed.Group):
    """Loss and gradients of the whole batch, from this process's `share` of it: the mean of
    every process's, which equals one process's on the whole batch (the shares are equal)."""
    loss, grads = value_and_grad(model, *batch)
    if group.size() == 1:
        return loss, grads
    mean = lambda a: mx.distributed.all_sum(a, group=group) / group.size()  # noqa: E731
    return mean(loss), tree_map(mean, grads)


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
    Random draws inside the model (dropout) depend on (seed, step, rank) only, like the batches.
    """
    group = world()
    lead = group.rank() == 0
    if lead:
        run.mkdir(parents=True, exist_ok=True)
    opt = optim.AdamW(learning_rate=cosine_schedule(lr, steps, warmup),
                      weight_decay=weight_decay)
    opt.init(model.trainable_parameters())
    start = load_state(run, model, opt)
    log = run / "log.jsonl"
    if lead and log.exists():  # lines past the saved step were logged by an interrupted run
        kept = [line for line in log.read_text().splitlines()
                if json.loads(line)["step"] <= start]
        log.write_text("".join(line + "\n" for line in kept))

    value_and_grad = nn.value_and_grad(model, loss_fn)
    state = [model.state, opt.state, mx.random.state]

    @mx.compile
    def step_fn(*batch):
        loss, grads = world_gradients(model, value_and_grad, batch, group)
        grads, _ = optim.clip_grad_norm(grads, clip)
        opt.update(model, grads)
        return loss

    compiled = mx.compile(step_fn, inputs=state, outputs=state)
    bar = tqdm(total=steps, initial=start, desc=desc, dynamic_ncols=True,
               unit="step", smoothing=0.05, disable=not lead)
    losses, t_last, last = [], time.perf_counter(), {}
    for step in range(start, steps):
        # Rank 0 draws what a single process would; the others, their own dropout masks.
        mx.random.seed(seed * 1_000_003 + step + group.rank() * 7_919_993)
        loss = compiled(*share(batch_at(step), group))
        mx.eval(loss, state)
        losses.append(loss.item())
        bar.update(1)
        done = step + 1
        if lead and (done % log_every == 0 or done == steps):
            now = time.perf_counter()
            rate = tokens_per_step * len(losses) / (now - t_last)
            last = {"step": done, "loss": sum(losses) / len(losses),
                    "lr": float(opt.learning_rate), "tokens_per_s": rate,
                    "processes": group.size(), "time": time.time()}
            with log.open("a") as f:
                f.write(json.dumps(last) + "\n")
            bar.set_postfix(loss=f"{last['loss']:.3f}", tok_s=f"{rate:.0f}")
            losses, t_last = [], now
        if lead and heldout is not None and (done % heldout_every == 0 or done == steps):
            with log.open("a") as f:
                f.write(json.dumps({"step": done, "heldout": heldout(model)}) + "\n")
        if lead and (done % save_every == 0 or done == steps or done == stop_at):
            save_state(run, done, model, opt)
        if done == stop_at:
            break
    bar.close()
    if not math.isfinite(last.get("loss", 0.0)):
        raise SystemExit(f"{desc}: loss is {last['loss']} at step {last['step']}")
    return last
