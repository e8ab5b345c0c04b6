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

import hashlib
import itertools
import json
import math
import os
import platform
import shutil
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


# The flags MLX's CPU JIT lacks: code for this CPU's vector units (MLX builds for generic
# x86-64, where each fma in its exp polynomial is a libm call and no loop is vectorized), that
# polynomial inlined, and its selects branch-free. The compiled kernels of `fused`'s GeGLU and
# softcapped cross-entropy then run as vector code instead of a libm call per multiply-add, which
# otherwise costs a training step a good part of its time.
NATIVE_FLAGS = "-march=native -finline-limit=2000 -fno-trapping-math"

# Stands in for g++ when MLX builds a kernel: MLX first probes `g++ --version` (and silently
# turns its JIT off if that fails), then builds `-o LIB`. The library is written under a short
# temporary name and renamed, so processes building one kernel at once never load half a file;
# a suffix cannot be appended, since MLX's library names are close to the 255-byte limit.
GXX_WRAPPER = """#!/bin/bash
real={real}
out=; args=()
while [ $# -gt 0 ]; do
  if [ "$1" = -o ]; then out=$2; shift 2; else args+=("$1"); shift; fi
done
[ -n "$out" ] || exec "$real" "${{args[@]}}"
tmp="$(dirname "$out")/partial-$$.so"
"$real" "${{args[@]}}" {flags} -o "$tmp" && mv -f "$tmp" "$out"
"""


def compile_for_this_cpu() -> None:
    """Makes `mx.compile` build its CPU kernels for this machine's CPU (NATIVE_FLAGS).

    MLX finds its compiler on PATH and keeps its kernels under TMPDIR: both are pointed at a
    directory of their own, keyed by the compiler, the CPU's features and the flags, so kernels
    built for another CPU are never loaded. Results differ from MLX's generic build by
    rounding only (g++ contracts a*b + c into fma). Does nothing without g++, or when done.
    """
    if "MLX_NATIVE_JIT" in os.environ or not shutil.which("g++"):
        return
    real = shutil.which("g++")
    version = subprocess.run([real, "--version"], capture_output=True, text=True).stdout
    cpu = next((line for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("flags")), "") if Path("/proc/cpuinfo").exists() else ""
    key = hashlib.sha256("\n".join([version, cpu, NATIVE_FLAGS]).encode()).hexdigest()[:16]
    root = Path(tempfile.gettempdir()) / f"mlx-native-{key}"
    (root / "bin").mkdir(parents=True, exist_ok=True)
    wrapper = root / "bin" / "g++"
    if not wrapper.exists():
        tmp = root / "bin" / f"g++.{os.getpid()}"
        tmp.write_text(GXX_WRAPPER.format(real=real, flags=NATIVE_FLAGS))
        tmp.chmod(0o755)
        os.replace(tmp, wrapper)
    os.environ["PATH"] = f"{root / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"
    os.environ["TMPDIR"] = str(root)
    tempfile.tempdir = None  # re-read TMPDIR
    os.environ["MLX_NATIVE_JIT"] = str(root)


# Sets FTZ and DAZ (denormal results and inputs read as zero) in the first thread of a process
# that preloads it, before MLX and OpenBLAS start theirs, which inherit the setting. Late in
# training Adam's second moments and softmax's far tails reach denormal floats, which x86 handles
# in slow microcode. No figure of the model depends on values below 1e-38.
FLUSH_DENORMALS_C = """#include <xmmintrin.h>
__attribute__((constructor)) static void flush_denormals(void) {
  _mm_setcsr(_mm_getcsr() | 0x8040);
}
"""


def flush_denormals_library() -> Optional[str]:
    """The FLUSH_DENORMALS_C library for LD_PRELOAD, built once (None off x86 or without gcc)."""
    root = os.environ.get("MLX_NATIVE_JIT")
    if root is None or platform.machine() not in ("x86_64", "AMD64"):
        return None
    lib = Path(root) / "flush-denormals.so"
    if not lib.exists():
        src = Path(root) / f"flush-denormals-{os.getpid()}.c"
        src.write_text(FLUSH_DENORMALS_C)
        tmp = Path(root) / f"flush-denormals-{os.getpid()}.so"
        subprocess.run([shutil.which("g++"), "-x", "c", "-O2", "-shared", "-fPIC", str(src),
                        "-o", str(tmp)], check=True)
        os.replace(tmp, lib)
        src.unlink()
    return str(lib)


def spawn(processes: int) -> None:
    """Re-runs this script as `processes` ranks on this machine and exits with their status.

    Builds MLX's kernels for this CPU first (`compile_for_this_cpu`), then does nothing more when
    `processes` is 1 or this process is already a rank. Rank 0 keeps the terminal; the others'
    output is dropped but for errors. The CPU cores are split evenly between the ranks' BLAS
    threads, so that they do not fight over cores; the ranks flush denormals to zero.
    """
    compile_for_this_cpu()
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
    preload = flush_denormals_library()
    ranks = []
    for rank in range(processes):
        env = dict(os.environ, MLX_RANK=str(rank), MLX_HOSTFILE=f.name,
                   OPENBLAS_NUM_THREADS=threads, OMP_NUM_THREADS=threads)
        if preload:
            env["LD_PRELOAD"] = " ".join(filter(None, [preload, env.get("LD_PRELOAD")]))
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
    return world_mean(loss, grads, group)


def world_mean(loss: mx.array, grads: Dict, group: mx.distributed.Group):
    """Every process's mean of `loss` and `grads`, summed as one flat array: the ring backend
    pays a round trip per sum, and one sum per tensor cost the demo target an eighth of a step."""
    flat = tree_flatten(grads)
    parts = [loss.reshape(1)] + [g.reshape(-1) for _, g in flat]
    total = mx.distributed.all_sum(mx.concatenate(parts), group=group) / group.size()
    ends = list(itertools.accumulate(p.size for p in parts))
    means = [total[end - p.size:end] for p, end in zip(parts, ends)]
    return means[0].reshape(()), tree_unflatten(
        [(k, m.reshape(g.shape)) for (k, g), m in zip(flat, means[1:])])


def save_state(run: Path, step: int, model: nn.Module, opt: optim.Optimizer,
               average: "Average") -> None:
    arrays = {f"model.{k}": v for k, v in tree_flatten(model.parameters())}
    arrays.update({f"opt.{k}": v for k, v in tree_flatten(opt.state)})
    if average.total is not None:
        arrays.update({f"average.{k}": v for k, v in tree_flatten(average.total)})
    tmp = run / "state.tmp.safetensors"
    mx.save_safetensors(str(tmp), arrays)
    os.replace(tmp, run / "state.safetensors")
    (run / "state.json").write_text(json.dumps({"step": step, "averaged": average.count}) + "\n")


def load_state(run: Path, model: nn.Module, opt: optim.Optimizer, average: "Average") -> int:
    """The step the run directory was saved at (0 when it holds no state)."""
    if not (run / "state.json").exists():
        return 0
    saved = json.loads((run / "state.json").read_text())
    arrays = mx.load(str(run / "state.safetensors"))
    part = lambda prefix: [(k[len(prefix):], v) for k, v in arrays.items()  # noqa: E731
                           if k.startswith(prefix)]
    try:
        model.load_weights(part("model."), strict=True)
        opt.state = tree_unflatten(part("opt."))
    except ValueError as e:
        raise SystemExit(f"{run / 'state.safetensors'} does not fit this model and optimizer "
                         f"({e}): it was saved by another recipe or an older version of this "
                         f"code; remove the run directory to train afresh") from e
    average.count = saved.get("averaged", 0)
    average.total = tree_unflatten(part("average.")) if average.count else None
    mx.eval(model.parameters(), opt.state, average.total)
    return saved["step"]


class Average:
    """The mean of the weights at every `every`-th step of the last `last` steps.

    With a small corpus the weights wander around a minimum late in training; their mean lies
    nearer its centre than any one of them (the demo target's held-out loss: 3.491 nats per
    token at its last step, 3.420 averaged over ten). The running sum is saved with the state,
    so a resumed run averages the same steps as an uninterrupted one.
    """

    def __init__(self, steps: int, last: int, every: int):
        self.first, self.every = steps - last, max(1, every)
        self.count, self.total = 0, None

    def add(self, step: int, model: nn.Module) -> None:
        if step <= self.first or step % self.every:
            return
        params = model.parameters()
        self.total = params if self.total is None else tree_map(mx.add, self.total, params)
        self.count += 1
        mx.eval(self.total)

    def apply(self, model: nn.Module) -> None:
        model.update(tree_map(lambda t: t / self.count, self.total))
        mx.eval(model.parameters())


def matrices_only(path: str, weight: mx.array) -> bool:
    """Weight decay's filter: matrices (projections, embeddings), not norms or scalars, whose
    decay towards zero only fights the scale they exist to set."""
    return weight.ndim >= 2


def train(run: Path, model: nn.Module, loss_fn: Callable, batch_at: Callable[[int], tuple],
          steps: int, lr: float, warmup: int, weight_decay: float = 0.1, clip: float = 1.0,
          save_every: int = 200, log_every: int = 10, desc: str = "train",
          tokens_per_step: int = 0, stop_at: int = 0,
          heldout: Optional[Callable[[nn.Module], float]] = None, heldout_every: int = 0,
          seed: int = 0, average_last: int = 0, average_every: int = 50) -> Dict:
    """Runs `loss_fn(model, *batch_at(step))` for steps [resume point, steps) with AdamW.

    Returns the last logged figures. `tokens_per_step` only feeds the progress bar's rate;
    `stop_at` ends the run early at that step, saved, as an interruption would. `heldout(model)`,
    a loss on text training never sees, is logged every `heldout_every` steps and at the end.
    Random draws inside the model (dropout) depend on (seed, step, rank) only, like the batches.
    Weight decay applies to matrices only. With `average_last`, the model ends as the mean of
    its weights at every `average_every`-th step of the last `average_last` (see `Average`).
    """
    group = world()
    lead = group.rank() == 0
    if lead:
        run.mkdir(parents=True, exist_ok=True)
    schedule = cosine_schedule(lr, steps, warmup)
    opt = optim.MultiOptimizer([optim.AdamW(learning_rate=schedule, weight_decay=weight_decay),
                                optim.AdamW(learning_rate=schedule, weight_decay=0.0)],
                               [matrices_only])
    opt.init(model.trainable_parameters())
    average = Average(steps, average_last, average_every)
    start = load_state(run, model, opt, average)
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
    losses, t_last, last, done = [], time.perf_counter(), {}, start
    for step in range(start, steps):
        # Rank 0 draws what a single process would; the others, their own dropout masks.
        mx.random.seed(seed * 1_000_003 + step + group.rank() * 7_919_993)
        loss = compiled(*share(batch_at(step), group))
        mx.eval(loss, state)
        losses.append(loss.item())
        bar.update(1)
        done = step + 1
        if average_last:
            average.add(done, model)
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
            save_state(run, done, model, opt, average)
        if done == stop_at:
            break
    bar.close()
    if done == steps and average.count:
        average.apply(model)
        if lead and heldout is not None:
            last["heldout_averaged"] = heldout(model)
            with log.open("a") as f:
                f.write(json.dumps({"step": done, "heldout_averaged": last["heldout_averaged"],
                                    "averaged": average.count}) + "\n")
    if not math.isfinite(last.get("loss", 0.0)):
        raise SystemExit(f"{desc}: loss is {last['loss']} at step {last['step']}")
    return last
