"""The one training loop, shared by every method and engine. Reads top to bottom:
(resume) -> evaluate -> for each step: count, step, check, log, (evaluate), (save), (stop) -> evaluate."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import select
import signal
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

from finetune import startup
from finetune.rank import checkpoint, compiling
from finetune.config import NonFinite, TrainConfig
from finetune.data.batches import TrainBatches
from finetune.data.tokenize import Example
from finetune.rank.dist import Dist
from finetune.rank.engine.common import StepResult
from finetune.data.host import Twins
from finetune.rank.syncs import HostReads
from finetune.rank.engine.base import Engine
from finetune.rank.heldout import evaluate
from finetune.logs import MetricsLog
from finetune.methods.base import OnlineObjective
from finetune.rank.memory import MemoryProbe, PeakProbe

MEMORY_STEPS = 2  # the second step has optimizer states and gradients: the steady-state peak


class Stopped(Exception):
    """The run stopped early, cleanly (a signal, or a non-finite step); the message says why and what to do."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


STOP: dict[str, Any] = {"signal": 0, "defer": False, "why": ""}
"""signal: set by the SIGTERM/SIGINT handler (finish this step, save, stop). defer: once training
has begun, a signal waits for the step boundary; before it there is nothing to save, so the rank
stops at once (a rank whose peer failed is stopped by torchrun within seconds, not at a timeout).
why: what sent the signal, where this rank knows (" (its launcher, pid N, ended)")."""


SIGNALS = (signal.SIGTERM, signal.SIGINT)
FORK_HOOKS: list[bool] = []  # os.register_at_fork cannot unregister: the hooks are registered once per process


def _fork_child() -> None:
    """In a forked child: our handlers back to the default, then the signals blocked across the fork unblocked."""
    for s in SIGNALS:
        if getattr(signal.getsignal(s), "stops_rank", False):
            signal.signal(s, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)


def handle_signals() -> None:
    """SIGTERM (Slurm, kill, torchrun when another rank failed) and SIGINT (Ctrl-C): before training,
    stop now; during it, note the signal, and the loop saves at the next step boundary.

    A process forked from this one (a tokenizing worker of `datasets.map`) must end on SIGTERM, as it would
    by default: its pool terminates it with one SIGTERM. Two ways our handler broke that, both seen in CI as
    a rank hung in the pool's join: raised in the middle of a task, `Stopped` was caught as the task's
    failure and the worker waited for the next task; and a SIGTERM that reaches a child before the
    interpreter's after-fork reset is dropped by it (a worker still starting when another one's shard
    raised). So the signals are blocked across every fork, and the child resets them to the default before
    unblocking them: one that arrived in between is then delivered, and ends it."""
    def note(signum: int, _frame: Any) -> None:
        STOP["signal"] = STOP["signal"] or signum  # the first one names the cause (torchrun relays Ctrl-C as SIGTERM)
        launcher_ended()  # torchrun or deepspeed, broken by its launcher's end, may signal first: say why all the same
        if not STOP["defer"]:
            raise Stopped(f"stopped by {signal.Signals(signum).name}{STOP['why']} before training began: nothing to save",
                          128 + signum)

    note.stops_rank = True  # type: ignore[attr-defined]
    if not FORK_HOOKS:
        os.register_at_fork(before=lambda: signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS),
                            after_in_parent=lambda: signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS), after_in_child=_fork_child)
        FORK_HOOKS.append(True)
    for s in SIGNALS:
        signal.signal(s, note)


def train(cfg: TrainConfig, *, engine: Engine, objective: Any, batches: TrainBatches, evals: list[Example],
          tokenizer: Any, dist: Dist, log: MetricsLog, save: Callable[[int], Path], resume_from: Path | None,
          probe: MemoryProbe | PeakProbe | None, flops_per_token: float | None = None, peak_flops: float | None = None,
          before_step: Callable[[int], None] | None = None) -> dict[str, dict[str, float]]:
    """Run optimizer steps up to `cfg.max_steps`. Returns the eval metrics before and after training.

    Args:
        save: writes a resumable checkpoint of a step (every `save_every` steps, and on SIGTERM/SIGINT).
        resume_from: a step directory to continue from (same data order: batches are a function of the step).
        probe: measures memory over the first MEMORY_STEPS steps, its peak or by category (None: not measured).
        flops_per_token, peak_flops: for model FLOPs utilisation (GPU; None: not reported).
        before_step: called with the steps done before each step and each evaluation (train.qat_after_steps).
    """
    first = _resume(engine, resume_from, dist)
    if resume_from is not None and isinstance(objective, OnlineObjective):  # the rollout its checkpoint sampled ahead
        objective.restore_ahead(engine, resume_from, dist.rank)
    memory: dict[str, float] = {}
    skipped_nonfinite = 0
    hook = before_step or (lambda done: None)
    bar = progress(cfg, dist, initial=first - 1)

    def run_eval(step: int, final: bool) -> dict[str, float]:
        hook(step)
        return _evaluate(cfg, step, final, engine=engine, objective=objective, evals=evals, tokenizer=tokenizer, dist=dist,
                         log=log, bar=bar)

    startup.mark("eval")
    before = run_eval(first - 1, final=True)
    startup.mark("first step")
    started: dict[str, float] = {}
    start = time.perf_counter()
    ahead = Ahead(batches, last=cfg.max_steps - 1)
    online = isinstance(objective, OnlineObjective)  # it samples the rows it trains on (GRPO)
    rollout_every = objective.rollout_every if online else 1  # a rollout reused: a signal stops after its last update
    for step in range(first, cfg.max_steps + 1):
        hook(step - 1)
        micro_batches, waited = ahead.get(step - 1)
        micro_batches, generated = (_rollout(cfg, step, engine=engine, objective=objective, batches=batches, micro_batches=micro_batches,
                                             tokenizer=tokenizer) if online else (micro_batches, 0.0))  # GRPO: rows from its prompts
        counts = _counts(engine, objective, micro_batches, dist)
        measured = probe is not None and step < first + MEMORY_STEPS
        out, seen, seconds, compiled = _timed_step(engine, objective, micro_batches, counts, cfg=cfg, dist=dist,
                                                   probe=probe if measured else None)
        names = objective.metrics  # its own (DPO rewards...), averaged like the loss; pipeline stages without the loss add 0
        if compiled >= 0.05:
            say(dist, bar, f"compile: {compiled:.1f} s in step {step}" + (" (the first)" if step == first else " (a new shape)"))
        if step == first and (started := startup.first_step_done(compiled) or {}):
            say(dist, bar, startup.line(started))
        if measured and step == first + MEMORY_STEPS - 1:
            memory = probe.report()
            log.write("memory", step, memory)
            say(dist, bar, probe.line(memory))

        metrics = {"loss": out.loss_sum / seen["count"], "lr": out.lr, "grad_norm": out.grad_norm,
                   **_throughput(seen["tokens"], seen["slots"], seconds, waited, flops_per_token, peak_flops, dist.world_size),
                   "epoch": batches.epoch(step), "elapsed_s": time.perf_counter() - start,
                   **({"compile_s": compiled} if cfg.compile else {}),
                   **({"generation_s": generated} if online else {}),  # apart from step_s
                   **{k: v / seen["units"] for k, v in out.metrics.items()}, **_scaled(out),
                   **({"host_reads": seen["host_reads"]} if cfg.count_host_reads else {})}
        skipped_nonfinite += _nonfinite(cfg, step, metrics, out, log=log, dist=dist, bar=bar, skipped=skipped_nonfinite)
        metrics["nonfinite_skipped"] = skipped_nonfinite
        log.write("train", step, metrics)
        _show(cfg, step, metrics, out, names=names, waited=waited, dist=dist, bar=bar)
        if cfg.eval_every and step % cfg.eval_every == 0 and step < cfg.max_steps:
            run_eval(step, final=False)
        if seen["signalled"] and step < cfg.max_steps and step % rollout_every == 0:  # SIGTERM/SIGINT on some rank: save here and stop cleanly
            _stop(step, save)
        if cfg.save_every and step % cfg.save_every == 0:
            save(step)
    ahead.close()
    if online:
        objective.close()
    tic = time.perf_counter()
    after = run_eval(cfg.max_steps, final=True)
    if bar is not None:
        bar.close()
    ended = {"eval": round(time.perf_counter() - tic, 3)}  # the rest of the time after training: finetune.rank.train.run
    return {"before": before, "after": after, "memory": memory, **({"startup": started} if started else {}), "after_training": ended}


def _throughput(tokens: float, slots: float, seconds: float, waited: float, flops_per_token: float | None, peak_flops: float | None,
                world_size: int) -> dict[str, float]:
    """A step's speed metrics: non-pad tokens over all ranks per second (slow while memory is measured by category), their
    share of the rows (packing raises it towards 1), the step's seconds and those its micro-batches were not ready when it
    began; model FLOPs utilisation where the peak is known (achieved FLOPs over the dense peak of all ranks)."""
    speed = {"tokens_per_s": tokens / seconds, "nonpad_fraction": tokens / slots, "step_s": seconds, "data_wait_s": waited}
    if flops_per_token and peak_flops:
        speed["mfu"] = tokens * flops_per_token / seconds / (peak_flops * world_size)
    return speed


def _rollout(cfg: TrainConfig, step: int, *, engine: Engine, objective: Any, batches: Any, micro_batches: list[dict[str, Any]],
             tokenizer: Any) -> tuple[list[dict[str, Any]], float]:
    """An online objective's rows for `step` from its prompts, with where more prompts come from: a refill's (dynamic
    sampling; a stream has none: refused) and the next step's (generation in the background; pure batches only)."""
    refill = getattr(batches, "refill", None)
    ahead = functools.partial(batches.micro_batches, step) if step < cfg.max_steps and getattr(batches, "pure", False) else None
    return objective.rollout(engine, micro_batches, step=step, tokenizer=tokenizer, seed=cfg.seed,
                             refill=functools.partial(refill, step - 1) if refill else None, ahead=ahead)


def _stop(step: int, save: Callable[[int], Path]) -> None:
    """A signal reached some rank: a resumable checkpoint of `step`, then Stopped naming the signal."""
    signum = signal.Signals(STOP["signal"] or signal.SIGTERM)  # this rank's, or the one another rank got
    launcher_ended()  # the other rank's may have been its launcher's end
    where = save(step)
    raise Stopped(f"stopped by {signum.name}{STOP['why']} after step {step}: resumable checkpoint {where}; continue "
                  "with train.resume=auto", code=128 + int(signum))


def _resume(engine: Engine, resume_from: Path | None, dist: Dist) -> int:
    """The first step to run: 1, or the one after the checkpoint `resume_from` (its weights, optimizer and RNG loaded)."""
    if resume_from is None:
        return 1
    startup.mark("resume")
    first = engine.load(resume_from) + 1
    checkpoint.restore_rng(resume_from, dist.rank)  # dropout continues as if never interrupted
    say(dist, None, f"resumed from {resume_from} at step {first - 1}")
    return first


def _evaluate(cfg: TrainConfig, step: int, final: bool, *, engine: Engine, objective: Any, evals: list[Example], tokenizer: Any,
              dist: Dist, log: MetricsLog, bar: Any) -> dict[str, float]:
    """The held-out metrics at `step` (exact match and samples at the first and the last), logged and said."""
    if not evals:
        return {}
    with compiling.eager():  # train.compile: the training step's graphs only
        metrics, samples = evaluate(engine, objective, evals, dist=dist, tokenizer=tokenizer, batch_size=cfg.eval_batch_size,
                                    exact_match_samples=cfg.exact_match_samples if final else 0,
                                    sample_prompts=cfg.sample_prompts, max_new_tokens=cfg.max_new_tokens)
    log.write("eval", step, metrics)
    if samples:  # train.sample_prompts: what the model answers now, beside the reference
        log.samples(step, samples)
    say(dist, bar, f"step {step:>5}  " + "  ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
    return metrics


def _counts(engine: Engine, objective: Any, micro_batches: list[dict[str, Any]], dist: Dist) -> dict[str, Any]:
    """The step's counts: `count`, the loss units of the whole global batch (the normaliser), and `units`, those its
    metrics are averaged over (an objective's `metric_count` where its loss has other units: GRPO's dapo divides by
    tokens, its rewards by completions), summed over the ranks on the device and never read here (the engine scales
    the loss by the tensor; a global batch without a unit, every completion masked, divides by 1); this rank's non-pad
    `tokens` and token `slots`. Counted on the host micro-batches: the data's own tensors, not the device's."""
    owner = int(engine.owner)  # tp/pp: one rank per model replica counts its data
    per = getattr(objective, "metric_count", objective.count)
    local = dist.on_device(owner * sum(objective.count(mb) for mb in micro_batches), owner * sum(per(mb) for mb in micro_batches))
    count, units = dist.sum_tensor(local).clamp(min=1.0).float().unbind()  # exact below 2^24 units
    return {"count": count, "units": units, "tokens": owner * sum(int(mb["real_tokens"].sum()) for mb in micro_batches),
            "slots": owner * sum(mb["input_ids"].numel() for mb in micro_batches)}


def _timed_step(engine: Engine, objective: Any, micro_batches: list[dict[str, Any]], counts: dict[str, Any], *,
                cfg: TrainConfig, dist: Dist, probe: MemoryProbe | PeakProbe | None) -> tuple[Any, dict[str, float], float, float]:
    """(the engine's step result read on the host, the step's counts read, its seconds, the seconds this rank compiled in
    it: apart from the step's time); the memory probe tracks it where given. The step's one host read (`_read`) ends it:
    its seconds are the device's, not the time to queue it. train.count_host_reads: the reads counted (syncs.HostReads)."""
    tic, compiled = time.perf_counter(), compiling.seconds() if cfg.compile else 0.0
    Twins.clear()  # the last step's micro-batches' host copies
    with probe.track() if probe is not None else contextlib.nullcontext(), \
            HostReads() if cfg.count_host_reads else contextlib.nullcontext() as reads:
        out = engine.train_step(micro_batches, objective, counts["count"])
    out, seen = _read(out, counts, objective.metrics, dist)
    seconds = time.perf_counter() - tic
    compiled = compiling.seconds() - compiled if cfg.compile else 0.0
    return out, {**seen, "host_reads": reads.count if reads else 0}, seconds - compiled, compiled


def _read(out: StepResult, counts: dict[str, Any], names: tuple[str, ...], dist: Dist) -> tuple[StepResult, dict[str, float]]:
    """The step's numbers on the host, in one collective and one read (Dist.read): the sums over the ranks (loss,
    tokens, a signal, the objective's metrics) and this rank's own (counts already summed, the gradient norm, whether
    the step was applied, fp16's scale and skipped steps)."""
    summed = [out.loss_sum, counts["tokens"], counts["slots"], STOP["signal"], *(out.metrics.get(k, 0.0) for k in names)]
    local = [counts["count"], counts["units"], out.grad_norm, out.applied, out.skipped,
             0.0 if out.loss_scale is None else out.loss_scale]
    (loss_sum, tokens, slots, signalled, *sums), (count, units, norm, applied, skipped, scale) = dist.read(summed, local)
    host = dataclasses.replace(out, loss_sum=loss_sum, grad_norm=norm, applied=bool(applied), skipped=int(skipped),
                               loss_scale=None if out.loss_scale is None else scale, metrics=dict(zip(names, sums)))
    return host, {"count": count, "units": units, "tokens": tokens, "slots": slots, "signalled": signalled}


def _scaled(out: Any) -> dict[str, float]:
    """fp16: the dynamic loss scale and how many steps overflowed; else nothing."""
    return {"loss_scale": out.loss_scale, "skipped_steps": out.skipped} if out.loss_scale is not None else {}


def _nonfinite(cfg: TrainConfig, step: int, metrics: dict[str, float], out: Any, *, log: MetricsLog, dist: Dist, bar: Any,
               skipped: int) -> int:
    """1 where the step's loss or gradient norm is not finite and train.on_nonfinite=skip, else 0; with stop, Stopped.
    Never train on NaNs: fp16's scaler already skipped overflowing gradients, the rest is ours."""
    if math.isfinite(metrics["loss"]) and (out.loss_scale is not None or math.isfinite(out.grad_norm)):
        return 0
    what = f"step {step}: the loss is {metrics['loss']:.4g} and the gradient norm {out.grad_norm:.4g}"
    if cfg.on_nonfinite == NonFinite.stop:
        log.write("train", step, metrics)
        kept = f"the weights are those after step {step - 1}" if not out.applied else \
            "the engine had already applied it: resume from the last checkpoint"
        raise Stopped(f"{what}: stopped before training on them ({kept}); lower optim.lr, use precision=bf16 rather "
                      "than fp16, check the data, or set train.on_nonfinite=skip", code=3)
    say(dist, bar, f"{what}: step skipped (train.on_nonfinite=skip; {skipped + 1} so far)")
    return 1


def _show(cfg: TrainConfig, step: int, metrics: dict[str, float], out: Any, *, names: tuple[str, ...], waited: float, dist: Dist,
          bar: Any) -> None:
    """The progress bar's postfix, or every train.log_every steps a line."""
    if bar is not None:
        bar.update()
        bar.set_postfix(loss=f"{metrics['loss']:.4f}", lr=f"{out.lr:.2e}", refresh=False)
    elif step % cfg.log_every == 0:
        say(dist, None, f"step {step:>5}  loss {metrics['loss']:.4f}  lr {out.lr:.2e}  "
                        f"grad_norm {out.grad_norm:.3f}  tokens/s {metrics['tokens_per_s']:.0f}  data_wait {1000 * waited:.0f} ms"
                        + "".join(f"  {k} {metrics[k]:.3f}" for k in names))


class Ahead:
    """Step -> this rank's micro-batches, and the seconds the loop waited for them. Where they are a pure
    function of the step (TrainBatches: `pure`), the next step's are made in a thread while this one computes
    (collating and padding hold the GIL in short stretches; the model's ops release it). A stream's come
    from its own DataLoader worker, in order, and are asked for as they are: a checkpoint records where the
    next step starts, which a step read ahead would move."""

    def __init__(self, batches: Any, last: int) -> None:
        self.batches, self.last = batches, last
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="next-batches") if getattr(batches, "pure", False) else None
        self.next: tuple[int, Future] | None = None

    def get(self, step: int) -> tuple[list[dict[str, Any]], float]:
        tic = time.perf_counter()
        if self.next is not None and self.next[0] == step:
            micro_batches = self.next[1].result()  # its exception, if it raised, is raised here
        else:
            micro_batches = self.batches.micro_batches(step)
        waited = time.perf_counter() - tic
        self.next = None
        if self.pool is not None and step < self.last:
            self.next = (step + 1, self.pool.submit(self._pinned, step + 1))
        return micro_batches, waited

    def _pinned(self, step: int) -> list[dict[str, Any]]:
        """The step's micro-batches, in page-locked memory where a GPU trains (here, in the thread: the engine's copy
        to the device then neither blocks nor copies them again, finetune.data.host.to_device)."""
        micro_batches = self.batches.micro_batches(step)
        if not pinnable():
            return micro_batches
        return [{k: v.pin_memory() if hasattr(v, "pin_memory") else v for k, v in mb.items()} for mb in micro_batches]

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)


def pinnable() -> bool:
    import torch

    return torch.cuda.is_available()


def progress(cfg: TrainConfig, dist: Dist, initial: int) -> Any:
    if not (cfg.progress_bar and dist.is_main):
        return None
    from tqdm import tqdm

    return tqdm(total=cfg.max_steps, initial=initial, desc="train", unit="step", mininterval=1.0, dynamic_ncols=True)


def say(dist: Dist, bar: Any, line: str) -> None:
    if dist.is_main:
        (bar.write if bar is not None else print)(line)


LAUNCHER: dict[str, Any] = {"pid": "", "fd": None}
"""The launcher this rank watches (`watch_launcher`): its pid, and a pidfd that is readable once it ended."""


def watch_launcher(token: str | None) -> None:
    """Stop this rank, as SIGTERM does (saving at the next step boundary), when the launcher process
    named by `token` (pid@host, FINETUNE_LAUNCHER) ends first: killed with SIGKILL, it could pass nothing
    on, and torchrun or deepspeed, orphaned, would run the job on (or, their stderr broken with it, stop
    the ranks with a SIGTERM of their own: `note` then finds the launcher gone too). A launcher on
    another host is not watched."""
    import socket
    import threading

    pid, _, host = (token or "").partition("@")
    if not pid.isdigit() or host != socket.gethostname():
        return
    try:
        fd = os.pidfd_open(int(pid))
    except ProcessLookupError:
        LAUNCHER["pid"] = pid
        _gone()
        os.kill(os.getpid(), signal.SIGTERM)
        return
    except (AttributeError, OSError):  # no pidfd (not Linux 5.3+): not watched
        return
    LAUNCHER.update(pid=pid, fd=fd)

    def wait() -> None:
        select.select([fd], [], [])  # readable when the process ends
        launcher_ended()
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=wait, name="watch-launcher", daemon=True).start()


def launcher_ended() -> bool:
    """Whether the watched launcher has ended; the first time it is found so, this rank's stop line
    names it, and what the rank writes to stderr (the dead launcher's pipe) goes to stdout from then on."""
    if STOP["why"]:
        return True
    fd = LAUNCHER["fd"]
    if fd is None or not select.select([fd], [], [], 0)[0]:
        return False
    _gone()
    return True


def _gone() -> None:
    if not STOP["why"]:
        os.dup2(1, 2)  # first: once `why` is set, the main thread may print
        STOP["why"] = f" (its launcher, pid {LAUNCHER['pid']}, ended)"
