"""Per-rank worker: `python -m finetune.train RUN_DIR/config.yaml` (started by torchrun).

Reads the resolved config the launcher wrote (ranks never re-run Hydra), builds data, model and
engine, runs the shared loop, exports a Hugging Face checkpoint and reports.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import socket
import sys
import traceback
from pathlib import Path
from typing import Any

import torch

from finetune import config, logs, methods, rundir, startup
from finetune.data import steps
from finetune.families import liger
from finetune.methods import losses
from finetune.methods.base import IMAGE_TEXT, built_as
from finetune.rank import checkpoint, compiling, dist, engine, flops, fp8, heldout, loop, memory, model, qat, reference, teacher, topk, varlen, vision
from finetune.config import Config, ConfigError, Kernels, Logits, MemoryReport, MethodConfig, PeftConfig, PeftMethod, Precision, Strategy, uses_deepspeed
from finetune.data import rows
from finetune.rank import stream
from finetune.data.batches import TrainBatches
from finetune.data.images import pictures_of
from finetune.data.pack import pack
from finetune.data.examples import load_split
from finetune.data.tokenize import IGNORE, Stats, rows_of
from finetune.rank.engine.base import Engine
from finetune.rank.engine.common import autocast_dtype
from finetune.families import router_loss_split, router_loss_under_pp
from finetune.rank.head import PROBE_TOKENS, ChunkedHead
from finetune.layouts.zero import deepspeed_config
from finetune.rundir import ERROR_FILE, LAUNCHER_ENV, RANKS_DIR
from finetune.rank.memory import MemoryProbe, PeakProbe
from finetune.methods import Objective
from finetune.methods.base import OnlineObjective
from finetune.planner import records
from finetune.planner.peak import plan


PHASE = {"name": "start"}
"""What this rank is doing now (tokenizer, data, model, peft, engine, resume, reference, training,
export): the error funnel names it."""


def phase(name: str) -> None:
    PHASE["name"] = name
    startup.mark(name)  # where the start-up goes (finetune.startup)


LOADING: dict[str, float] = {}  # what loading took from this rank's host memory (memory.LoadWatch): in its status
LOCK_HELD: list[int | None] = []  # this rank's share of RUN_DIR/.lock, open until the process ends


KNOWN = (ConfigError, checkpoint.CheckpointError)
"""Exceptions that are user mistakes (or a failed save), their message one line saying what to do."""


def main(argv: list[str] | None = None) -> int:
    """Run this rank under the error funnel: whatever ends it, the user reads one line naming the
    phase (`RUN_DIR/error.txt`, which the launcher repeats last) and never a traceback; an
    unexpected exception's traceback goes to RUN_DIR/ranks/RANK.log."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("config", help="RUN_DIR/config.yaml written by finetune.launch")
    parser.add_argument("--local_rank", type=int, default=None, help="set by the deepspeed launcher (LOCAL_RANK is used)")
    args = parser.parse_args(argv)
    run_dir, rank = Path(args.config).resolve().parent, int(os.environ.get("RANK", 0))
    status = RankStatus(run_dir, rank)
    code, d = 0, None
    try:
        startup.MARKS.clear()
        phase("config")
        cfg = config.load(args.config)
        loop.handle_signals()  # SIGTERM/SIGINT: checkpoint at the next step boundary, then stop
        loop.watch_launcher(os.environ.get(LAUNCHER_ENV))  # and so does the launcher's end (SIGKILL)
        LOCK_HELD.append(rundir.hold_shared(run_dir))  # the run directory stays taken while this rank lives
        phase("start")
        d = dist.init(cfg.train.device, deepspeed=uses_deepspeed(cfg))
        run(cfg, d)
        if cfg.train.eval_tasks and d.is_main:  # after run(): its model is freed; final/ is loaded whole on this rank
            phase("benchmarks")
            benchmark(run_dir, cfg, d)
    except loop.Stopped as e:  # stopped cleanly: its own message and exit code
        code = e.code
        status.report(str(e), show=d is None or d.is_main, prefix="")
    except KNOWN as e:  # a user mistake this rank found, or a failed save (`own`: this rank's part failed)
        code = 2
        status.report(f"{PHASE['name']}: {e}", root=getattr(e, "own", True))
    except BaseException as e:  # noqa: BLE001 - unexpected (DCP's CheckpointException is no Exception): one line, the traceback in the rank's log
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        code = 1
        status.report(f"{PHASE['name']}: rank {rank}: {unexpected(e, status, run_dir)}", root=not lost_peer(e))
    finally:
        if d is not None:
            dist.shutdown()
    if LOADING:
        status.info["loading"] = dict(LOADING)
    status.write("done" if code == 0 else f"exited {code}")
    return code


def benchmark(run_dir: Path, cfg: Config, d: dist.Dist) -> None:
    """train.eval_tasks: lm-eval on final/, as `python -m finetune.evaluate RUN_DIR tasks=...` runs it."""
    from finetune.rank import evaluate
    from finetune.rank.finished import locate

    run = locate(str(run_dir), need_run=True)
    metrics = evaluate.run_benchmarks(run, cfg.train.eval_tasks, batch_size=cfg.train.eval_batch_size, device=str(d.device))
    print(evaluate.said(run_dir, metrics), flush=True)


def unexpected(e: BaseException, status: "RankStatus", run_dir: Path) -> str:
    """An unexpected exception in one line: a full disk says so and where; anything else its type and
    first line, and where its traceback is (RUN_DIR/ranks/RANK.log, or stderr when that cannot be written)."""
    trace = traceback.format_exc()
    log = status.path.with_suffix(".log")
    try:
        log.write_text(trace)
        where = f"traceback in {log}"
    except OSError as err:
        with contextlib.suppress(OSError):
            log.unlink(missing_ok=True)
            print(trace, file=sys.stderr, flush=True)
        where = f"traceback above; {log} could not be written: {err.strerror or err}"
    full = disk_full(e)
    if full is not None:
        target = Path(full.filename) if full.filename else run_dir
        return (f"{full.strerror} writing {target} ({checkpoint.free_mib(target):.1f} MiB free there): free space there, then "
                f"continue with train.resume=auto ({where})")
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {first} ({where})"


def disk_full(e: BaseException) -> OSError | None:
    """The 'no space' or 'quota exceeded' OSError in `e`'s chain, if one is."""
    seen: BaseException | None = e
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def lost_peer(e: BaseException) -> bool:
    """A collective that failed because another rank is gone: a consequence, not a root cause (the
    launcher names the rank that died, or the reason it gave)."""
    text = str(e)
    return isinstance(e, RuntimeError) and any(s in text for s in (
        "Connection reset by peer", "Connection closed by peer", "Broken pipe", "NCCL communicator was aborted",
        "Socket Timeout", "DistNetworkError"))


class RankStatus:
    """RUN_DIR/ranks/<rank>.json: pid, host, CPU cores and how the rank ended. A rank still 'running' after
    the job failed died without a word (SIGKILL, the out-of-memory killer): the launcher names it."""

    SIZE = 4096
    """Bytes the file is padded to when the rank starts: its later statuses overwrite them in place, which
    a full disk still allows (a new file or a longer one it does not), so the rank's end is recorded."""

    def __init__(self, run_dir: Path, rank: int) -> None:
        self.run_dir, self.rank = run_dir, rank
        self.path = run_dir / RANKS_DIR / f"{rank}.json"
        with contextlib.suppress(OSError):
            self.path.parent.mkdir(parents=True, exist_ok=True)
        # the CPU cores it may run on (launcher.devices_per_trial pins a launch to its own): what ran, not what was asked
        self.info = {"rank": rank, "pid": os.getpid(), "host": socket.gethostname(), "cpus": sorted(os.sched_getaffinity(0))}
        self.reason: str | None = None  # the line report() recorded: kept beside the final status
        self.write("running")

    def write(self, status: str) -> None:
        text = json.dumps({**self.info, "status": status, **({"reason": self.reason} if self.reason else {})}) + "\n"
        text += " " * max(0, self.SIZE - len(text) - 1) + "\n"  # whitespace after the JSON: readers skip it
        try:
            with open(self.path, "r+" if self.path.exists() else "w") as f:
                f.write(text)
                f.truncate()
        except OSError:  # a disk too full even for this: the launcher reports a rank that ended without a word
            pass

    def report(self, line: str, *, show: bool = True, prefix: str = "error: ", root: bool = True) -> None:
        """Record why this rank ends. The first rank to report a root cause writes RUN_DIR/error.txt (the
        others usually fail because it left) and prints the line; the others only record it here (with
        its launcher gone, nobody reads error.txt: rank 0 prints its own line)."""
        self.info["root"] = root
        self.write(f"failed: {line}")
        self.reason = line
        if not root:
            return
        try:
            with open(self.run_dir / ERROR_FILE, "x") as f:
                f.write(f"{line}\n")
        except FileExistsError:  # another rank's line: the launcher prints it, unless it is gone (SIGKILL)
            if not (show and loop.launcher_ended()):
                return
        except OSError:  # a full disk: an empty error.txt would hide the ranks' statuses from the launcher
            with contextlib.suppress(OSError):
                (self.run_dir / ERROR_FILE).unlink()
        if show:
            with contextlib.suppress(OSError):  # stderr gone with a killed launcher: the status holds the line
                print(f"{prefix}{line}", file=sys.stderr, flush=True)


def run(cfg: Config, d: dist.Dist) -> None:
    """One rank's whole run: tokenizer, data, model, engine, resume, reference, objective, the loop, the export."""
    run_dir = Path(cfg.run_dir)
    torch.manual_seed(cfg.train.seed)
    phase("tokenizer")
    tokenizer = model.load_tokenizer(cfg.model, cfg.data)
    pictures = pictures_of(tokenizer)
    if pictures is not None and pictures.loads() and d.world_size > 1 and (uses_deepspeed(cfg) or cfg.parallelism.strategy == Strategy.fsdp):
        pictures.everywhere = True  # their ranks gather the vision tower's parameters (or reduce its gradients) together
    phase("data")
    train_examples, eval_examples, stats = load_data(cfg, tokenizer, d)
    phase("model")
    watch = memory.LoadWatch()  # the host memory loading takes, to the engine built (RUN_DIR/ranks/RANK.json)
    zero3 = model.zero3_context(deepspeed_config(cfg) if uses_deepspeed(cfg) else None)
    attention, attention_why = model.resolve_attention(cfg.model, cfg.precision.name, d.device)
    # a causal LM (a vision-language model's image-text class), or a scored model (method=reward)
    model_class = built_as(methods.get(cfg.method.name).model_class, pictures_of(tokenizer) is not None)

    def load(peft: PeftConfig) -> torch.nn.Module:
        loaded = model.load_model(cfg.model, tokenizer, attention=attention, peft=peft,
                                  compute_dtype=autocast_dtype(cfg.precision.name) or torch.float32, zero3=cfg.zero.stage == 3,
                                  run_dir=run_dir, is_main=d.is_main, barrier=d.barrier,
                                  dtype=torch.bfloat16 if cfg.precision.name == Precision.bf16_pure else torch.float32,
                                  fsdp=cfg.parallelism.strategy == Strategy.fsdp, model_class=model_class)
        if cfg.model.kernels == Kernels.liger:  # before PEFT and the layout wrap it (DPO's live reference too)
            liger.apply(loaded, d.device)
        return loaded

    def per_sample(reference: torch.nn.Module) -> torch.nn.Module:
        """A live reference reads the policy's rows: where those hold several samples, it attends to each alone too."""
        if rows.several_per_row(cfg) and attention in varlen.KERNELS:
            varlen.Varlen(reference)
        return reference

    loaded = load(cfg.peft)
    net = prepare_model(cfg, d, loaded, attention, attention_why, model_class)
    watch.mark("read")
    chunked = ChunkedHead(net, cfg.logits.chunk_tokens, cfg.logits.kernel, d.device) if cfg.logits.name == Logits.chunked else None
    if chunked is not None and d.is_main:
        print(f"logits: chunked, {chunked.kernel.value} ({chunked.why})")
    phase("engine")
    eng = engine.build(cfg, net, d)
    LOADING.update(watch.stop())
    if LOADING and d.is_main:
        print(memory.load_line(LOADING, d.device.type))
    if chunked is not None:  # a family that changes its logits in a way we do not repeat per chunk: refused here
        with compiling.eager():
            chunked.check(*eng.inference(chunked.prober(), probe_batch(train_examples)))
    phase("resume")
    resume_from = resume_point(cfg, d, run_dir)
    # the method's reference (DPO's): the live one is the initial model again (a 4-bit base for QLoRA, no adapter).
    phase("reference")
    base_peft = cfg.peft if cfg.peft.name == PeftMethod.qlora else PeftConfig()
    with compiling.eager():  # a precomputed reference is the policy's forward without gradients
        ref = reference.setup(cfg, engine=eng, dist=d, splits={"train": train_examples, "eval": eval_examples}, run_dir=run_dir,
                              resume_from=resume_from, load_model=lambda: per_sample(load(base_peft)), pad_id=tokenizer.pad_token_id,
                              pictures=pictures)
        if (taught := methods.get(cfg.method.name).teacher(cfg.method)) is not None:  # method=distill: what its loss learns from
            ref = (topk.prepare(cfg, engine=eng, dist=d, splits={"train": train_examples, "eval": eval_examples}, tokenizer=tokenizer,
                                attention=attention) if taught.topk else teacher.load(cfg, engine=eng, tokenizer=tokenizer, attention=attention))
    objective = objective_for(cfg, d, loaded.config, ref, chunked)
    batches = make_batches(cfg, train_examples, eng, tokenizer.pad_token_id, resume_from, pictures_of(tokenizer))
    phase("training")
    loop.STOP["defer"] = True  # from here a signal saves a checkpoint at the next step boundary
    train_and_export(cfg, d, eng=eng, net=net, objective=objective, batches=batches, examples=(train_examples, eval_examples),
                     stats=stats, tokenizer=tokenizer, resume_from=resume_from, model_class=model_class)
    del zero3  # alive until here: transformers consults it while loading, generating and saving


def prepare_model(cfg: Config, d: dist.Dist, loaded: torch.nn.Module, attention: str, attention_why: str, model_class: str) -> Any:
    """The loaded model made ready for the engine: per-sample attention in rows of several samples, PEFT's adapters and
    activation checkpointing (model.apply_strategies), its layers compiled (train.compile); its line said."""
    if cfg.model.kernels == Kernels.liger and d.is_main:
        print(liger.describe(loaded))
    if cfg.precision.fp8 is not None:  # the linear layers' matmuls in FP8, before adapters, checkpointing and sharding
        said = fp8.convert(loaded, cfg.precision.fp8.value, d.device, cfg.precision.fp8_on_cpu,
                           fsdp=cfg.parallelism.strategy == Strategy.fsdp, tp=cfg.parallelism.tp)
        if d.is_main:
            print(said)
    if cfg.train.qat is not None:  # the linear layers' forward fake-quantized, before adapters wrap them
        said = qat.prepare(loaded, cfg.train.qat.value, cfg.train.qat_group_size, cfg.train.qat_after_steps)
        if d.is_main:
            print(said)
    if getattr(loaded.config, "output_router_logits", False):  # a hub config the launcher could not read
        if cfg.parallelism.pp > 1:
            raise ConfigError(router_loss_under_pp(cfg.parallelism.pp))
        if cfg.parallelism.cp > 1:
            raise ConfigError(router_loss_split(f"parallelism.cp={cfg.parallelism.cp}"))
    several = rows.several_per_row(cfg)
    if several and vision.parts(loaded).vision is not None:  # a hub id's class, which the launcher could not read
        if (why := rows.unpacked(type(loaded))) is not None:
            raise ConfigError(f"{several} cannot run with {loaded.config.model_type}: {why}: set data.packing=false and "
                              "data.padding_free=false")
        if vision.rope_per_sample(loaded):
            attention_why += "; M-RoPE positions per sample (finetune.rank.vision)"
    per_sample = bool(several) and attention in varlen.KERNELS
    if per_sample:  # rows of several samples, attended one sample at a time
        varlen.Varlen(loaded)
        attention_why += f"; {several}: {attention} per sample (finetune.rank.varlen)"
    elif several:
        attention_why += f"; {several}: its variable-length kernel"
    phase("peft" if cfg.peft.name != PeftMethod.none else "model")
    frozen, kept = vision.freeze(loaded, cfg.model.freeze, adapters=cfg.peft.name != PeftMethod.none)
    net = model.apply_strategies(loaded, checkpointing=cfg.checkpointing, peft=cfg.peft, model_class=model_class,
                                 neftune_alpha=cfg.train.neftune_alpha, kept=kept)
    if d.is_main and frozen:
        print("vision-language model: frozen " + ", ".join(f"{part} ({n:,} parameters)" for part, n in frozen.items())
              + " (model.freeze)")
    if d.is_main:
        trainable, total = model.trainable_parameters(net)
        print(f"model: {total:,} parameters, {trainable:,} trainable ({trainable / total:.2%}), attention {attention} ({attention_why})")
        if getattr(loaded, "read_as", None):  # a pretrained checkpoint: what its weights were read in (model.read_dtype)
            print(f"weights: {loaded.read_as}")
    if cfg.train.compile:
        eager_layers = compiling.checkpointed_eager(cfg.checkpointing, several if per_sample else "")
        layers = compiling.compile_layers(net, d.device)
        if d.is_main:
            print(f"compile: {layers} decoder layers compiled in place at the first training step (each new shape compiles "
                  f"once more: compile_s in the metrics); evaluation and generation run eager{eager_layers}")
    return net


def resume_point(cfg: Config, d: dist.Dist, run_dir: Path) -> Path | None:
    """The checkpoint train.resume means (checked against this config), or None: start from step 0."""
    resume_from = checkpoint.resolve(cfg.train.resume, run_dir, warn=lambda line: d.is_main and print(f"warning: {line}", file=sys.stderr))
    if resume_from is not None:
        checkpoint.check_compatible(resume_from, cfg)
    elif cfg.train.resume == "auto" and d.is_main:
        print(f"train.resume=auto: no checkpoint in {run_dir / 'checkpoints'}, starting from step 0")
    return resume_from


def objective_for(cfg: Config, d: dist.Dist, model_config: Any, ref: Any, chunked: ChunkedHead | None) -> Objective:
    """The method's loss, with a MoE's load-balancing loss read from the model's config (not under pipeline parallel)."""
    router = losses.router_loss(model_config)  # a MoE's load-balancing loss, from its config
    if router and cfg.parallelism.pp > 1:  # stages hand each other hidden states: the routers' logits stay in theirs
        if d.is_main:
            print(f"router aux loss: not reported under parallelism.pp={cfg.parallelism.pp} (each stage keeps its routers' logits)")
        router = None
    objective = build_objective(cfg.method, ref, router, chunked)
    if isinstance(objective, OnlineObjective):  # a rollout engine (method.vllm) is sized for the longest prompt + completion
        objective.prompt_tokens = cfg.data.max_length
        objective.flat = rows.padding_free(cfg)[0]  # the rollout's completions end to end (its prompts' batches stay padded)
    if router and d.is_main and router.metric in objective.metrics:  # a sequence classifier (method=reward) returns none to report
        print(router.describe())
    return objective


def train_and_export(cfg: Config, d: dist.Dist, *, eng: Engine, net: Any, objective: Objective, batches: Any,
                     examples: tuple[list[Any], list[Any]], stats: dict[str, Stats], tokenizer: Any, resume_from: Path | None,
                     model_class: str) -> None:
    """The loop under the run's metrics log, then final/ and (rank 0) the report."""
    run_dir = Path(cfg.run_dir)
    train_examples, eval_examples = examples
    log = logs.MetricsLog(run_dir, enabled=d.is_main, loggers=cfg.train.loggers, config=cfg)
    with log:  # the trackers end their runs after the run's last file (report), or marked failed if this raises
        predicted = None
        if d.is_main:  # the planner's prediction for this config, beside what the probe measures (python -m finetune.plan)
            predicted = planned(cfg, batches, train_examples, tokenizer)
            if isinstance(predicted, str):
                print(f"memory plan: not recorded ({predicted})")
            else:
                log.write("plan", 0, predicted)
        closing: dict[str, float] = {}
        try:
            result = loop.train(cfg.train, engine=eng, objective=objective, batches=batches, evals=eval_examples,
                                tokenizer=tokenizer, dist=d, log=log, save=saver(cfg, eng, d, run_dir / "checkpoints", batches, tokenizer, objective),
                                resume_from=resume_from, probe=probe(cfg, eng, d, run_dir, predicted),
                                before_step=qat.switch(cfg.train, net), **mfu_inputs(cfg, net, d))
        finally:
            with startup.timed(closing, "logs"):  # TensorBoard's last flush
                log.close()
                if cfg.data.streaming:
                    batches.close()
        if cfg.data.streaming:  # the counts of the rows the stream read
            stats["train"] = batches.stats
        phase("export")
        ended, final = result["after_training"], run_dir / "final"  # the final evaluation's, from the loop
        ended |= closing
        with startup.timed(ended, "export"):
            eng.export(final, tokenizer)
        if d.is_main and cfg.parallelism.pp > 1 and cfg.train.exact_match_samples:  # stages cannot generate: rank 0 scores final/
            with startup.timed(ended, "exact match"):
                result["after"]["exact_match"] = heldout.exact_match_of_export(final, eval_examples, cfg.train, d.device)
        if d.is_main:
            report(run_dir, final, result, {k: vars(s) for k, s in stats.items()}, log, model_class)


def load_data(cfg: Config, tokenizer: Any, d: dist.Dist) -> tuple[Any, Any, dict[str, Stats]]:
    """The run's train and eval examples: from the token cache (built by each node's local rank 0 when
    missing; finetune.data.cache), or tokenized in memory by every rank with data.cache=false; with
    data.streaming=true, the train set is a stream (finetune.rank.stream) and the eval set is in memory."""
    if cfg.data.streaming:
        train, evals, stats = stream.load(cfg.data, tokenizer, cfg.train.seed, cfg.method.name)
        if d.is_main:
            print(train.line())
    elif cfg.data.cache:
        from finetune.data import cache

        train, evals, stats, samples, _ = cache.load(cfg.data, tokenizer, cfg.train.seed, cfg.method.name,
                                                     builder=d.local_rank == 0, progress=cfg.train.progress_bar and d.local_rank == 0,
                                                     say=print if d.is_main else lambda line: None)
    else:
        train, evals, stats = load_split(cfg.data, tokenizer, cfg.train.seed, cfg.method.name)
        samples = len(train)
        if cfg.data.packing:
            train = pack(train, cfg.data.max_length, cfg.train.seed)
    method = methods.get(cfg.method.name)  # the whole splits read: what the method adds to them (KTO's mismatched rows)
    train = train if cfg.data.streaming else method.settle(train, cfg.data, "data.train")
    if not cfg.data.streaming:
        steps.check_count(cfg, len(train))  # train.epochs: the examples the launcher counted its steps from
    evals = method.settle(evals, cfg.data, "data.eval") if len(evals) else evals
    if d.is_main:
        if cfg.data.packing and not cfg.data.streaming:
            print(f"packing: {samples} samples -> {len(train)} rows of up to {cfg.data.max_length} tokens")
        for name, s in stats.items():
            print(s.line(name, cfg.data.max_length))
    return train, evals, stats


def probe_batch(examples: Any) -> dict[str, torch.Tensor]:
    """The first training row's first PROBE_TOKENS tokens (ChunkedHead.probe compares logits: no labels)."""
    first = examples.first() if isinstance(examples, stream.Streamed) else examples[0]
    first = rows_of(first)[0]  # a pair: its chosen row
    ids = torch.tensor([first.input_ids[:PROBE_TOKENS]])
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def make_batches(cfg: Config, examples: Any, eng: Engine, pad_id: int, resume_from: Path | None, pictures: Any = None) -> Any:
    """Step -> this rank's micro-batches: TrainBatches over the examples held, or StreamBatches over a stream
    (whose DataLoader worker starts reading now, where the checkpoint says when resuming). `pictures`: a vision-language
    model's processor, which makes its rows' image inputs as each micro-batch is made (off the step: the loop's
    read-ahead)."""
    shape = {"global_batch": cfg.train.global_batch_size, "micro_batch": cfg.train.micro_batch_size, "dp_rank": eng.dp_rank,
             "dp_size": eng.dp_size, "pad_id": pad_id, "pictures": pictures,
             "pad_to": cfg.data.max_length if cfg.parallelism.pp > 1 else None,  # a pipeline needs one shape
             "flat": rows.padding_free(cfg)[0] and methods.get(cfg.method.name).sampling(cfg.method) is None}  # an online
    # method's micro-batches are prompts, sampled from padded (its rollouts are laid flat: Online.flat)
    if cfg.data.streaming:
        return stream.StreamBatches(examples, **shape, resume_from=resume_from)
    return TrainBatches(examples, **shape, seed=cfg.train.seed)


def build_objective(method: MethodConfig, reference: Any = None, router: losses.RouterLoss | None = None,
                    head: ChunkedHead | None = None) -> Objective:
    """The loss of `method.name`, built by its finetune.methods record. `reference`: what finetune.rank.reference.setup
    returned ((policy, batch) -> reference log-probs, or None)."""
    return methods.get(method.name).objective(method, reference, router, head)


def planned(cfg: Config, batches: Any, examples: Any, tokenizer: Any) -> dict[str, float] | str:
    """The plan record: at the widest of the micro-batches the memory probe measures (rank 0's first
    loop.MEMORY_STEPS steps), for the comparison; and the peak planned at the longest batch of the whole run.
    A stream is read once, in order, by the loop: planned at data.max_length (an upper bound)."""
    from finetune.data.lengths import STREAMED, Longest, longest_of, row_image_tokens, row_labelled, row_lengths

    if cfg.data.streaming:
        return records.record(cfg, Longest(None, STREAMED))
    measured = [mb for step in range(loop.MEMORY_STEPS) for mb in batches.micro_batches(step)]
    per_row = cfg.train.micro_batch_size if batches.flat else 1  # a padding-free micro-batch: its tokens per row it holds
    widest = max(-(-mb["input_ids"].shape[1] // per_row) for mb in measured)
    labelled = max(int((mb["labels"][:, 1:] != IGNORE).sum()) for mb in measured)
    pictures = pictures_of(tokenizer)
    shown = (max(int((mb["input_ids"] == pictures.image_token_id).sum()) for mb in measured), pictures.pixels_per_token()) \
        if pictures is not None and pictures.loads() else (None, 0.0)
    predicted = records.record(cfg, Longest(widest, f"the widest micro-batch of the first {loop.MEMORY_STEPS} steps, which "
                                                    "the memory probe measures", labelled, *shown))
    if isinstance(predicted, str):
        return predicted
    run = plan(cfg, longest_of(row_lengths(examples), cfg, row_labelled(examples), pictures,
                               row_image_tokens(examples, pictures.image_token_id) if pictures is not None else None))
    return predicted | {"plan_run_width": run.width, "plan_run_peak_mib": (run.total - run.overhead) / records.MIB}


def saver(cfg: Config, eng: Engine, d: dist.Dist, root: Path, batches: Any, tokenizer: Any, objective: Any = None) -> Any:
    """step -> the complete checkpoint directory written for it (atomically; keep-K applied), with where
    a stream's next step starts, an online method's rollout sampled ahead (each rank's), and with train.save_hf its
    transformers form in hf/ (written as final/ is)."""
    def save(step: int) -> Path:
        with checkpoint.writing(root, step, cfg, d, keep=cfg.train.keep_checkpoints) as directory:
            eng.save(directory, step)
            if cfg.train.save_hf:
                eng.export(directory / checkpoint.HF, tokenizer)
            if cfg.data.streaming and d.is_main:
                batches.save(directory)
            if isinstance(objective, OnlineObjective):
                objective.save_ahead(directory, d.rank)
        return root / checkpoint.tag(step)

    return save


def probe(cfg: Config, eng: Engine, d: dist.Dist, run_dir: Path, planned: dict[str, float] | str | None) -> MemoryProbe | PeakProbe | None:
    """train.memory_report's probe (finetune.rank.memory): peak (no hooks, the default), categories (MemTracker; and any
    memory snapshot), or none; `planned`: the plan record, printed beside what is measured."""
    if cfg.train.memory_snapshot and d.device.type != "cuda":
        raise ConfigError("train.memory_snapshot=true records the CUDA allocator and needs a GPU; on CPU "
                          "train.memory_report=categories measures memory by category")
    planned = planned if isinstance(planned, dict) else None
    if cfg.train.memory_report == MemoryReport.off and not cfg.train.memory_snapshot:
        return None
    if cfg.train.memory_report == MemoryReport.peak and not cfg.train.memory_snapshot:
        return PeakProbe(d.device, planned)
    if cfg.train.compile:  # its dispatch mode would run the layers eager, then and in every later step
        if d.is_main:
            print("memory: not measured by category with train.compile=true (MemTracker's dispatch mode keeps dynamo from "
                  "compiling: the layers would run eager); the peak instead (train.memory_report=peak)")
        return PeakProbe(d.device, planned)
    targets = eng.memory_targets()
    if targets is None:
        if d.is_main:
            print("memory: not measured by category under pipeline parallel (MemTracker cannot hook the schedule's backward); "
                  "the peak instead (train.memory_report=peak)")
        return PeakProbe(d.device, planned)
    return MemoryProbe(*targets, d.device, snapshot=run_dir / "memory_snapshot.pickle" if cfg.train.memory_snapshot else None,
                       planned=planned)


def mfu_inputs(cfg: Config, net: Any, d: dist.Dist) -> dict[str, float | None]:
    """FLOPs per token and the GPU's peak, for MFU (None on CPU or an unlisted GPU)."""
    arch = net.config.get_text_config()  # a multimodal wrapper's language model
    _, total = model.trainable_parameters(net)
    per_token = flops.train_flops_per_token(total, arch.num_hidden_layers, arch.hidden_size, cfg.data.max_length)
    return {"flops_per_token": per_token,
            "peak_flops": flops.peak_flops(d.device, autocast_dtype(cfg.precision.name) or torch.float32)}


def report(run_dir: Path, final: Path, result: dict[str, dict[str, float]], stats: dict, log: logs.MetricsLog,
           model_class: str = model.CAUSAL_LM) -> None:
    """The loss-curve PNG, summary.json (the launcher times the shutdown from it), the trackers' end (they keep both),
    and the lines a user reads first: before/after, where the results are (`model_class`: what loads final/), where the
    seconds after training went."""
    with startup.timed(result["after_training"], "plot"):
        logs.plot_loss(run_dir, run_dir / "loss.png")
    (run_dir / "summary.json").write_text(json.dumps({**result, "checkpoint": str(final), "data": stats}, indent=2) + "\n")
    before, after = result["before"], result["after"]
    print()
    for key, label, fmt in (("eval_loss", "eval_loss", "{:.4f}"), ("eval_rewards/accuracy", "reward_acc", "{:.1%}"),
                            ("exact_match", "exact_match", "{:.1%}")):
        if key in after:  # pipeline parallel: exact match after training only
            was = fmt.format(before[key]) if key in before else "(not measured)"
            print(f"{label:<12} {was} -> {fmt.format(after[key])}")
    if (final / "adapter_config.json").is_file():
        print(f"adapter      {final}  (PEFT format; merged weights and a model card: python -m finetune.export {run_dir})")
    else:
        loads = "AutoProcessor" if model_class == IMAGE_TEXT else "AutoTokenizer"  # a processor: its images' settings too
        print(f"checkpoint   {final}  ({model_class}.from_pretrained / {loads}.from_pretrained)")
    written = [str(run_dir / logs.SINKS[name].output) for name in log.sinks if logs.SINKS[name].output]
    trackers = [name for name in log.sinks if name in logs.TRACKERS]
    print(f"metrics      {', '.join(written)}, loss curve {run_dir / 'loss.png'}" + (f"; {', '.join(trackers)}" if trackers else ""))
    log.end()
    print(startup.after_line(result["after_training"]))


def main_and_exit() -> None:
    """`python -m finetune.train`: `main`, then the process ends at once."""
    exit_code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Everything is written (status, metrics, checkpoints, final/): skip the interpreter's teardown. It takes
    # about a second with torch, transformers and deepspeed loaded, and a library's thread still joinable
    # there can abort the finished rank ("terminate called without an active exception", seen with ZeRO-3).
    os._exit(exit_code)


if __name__ == "__main__":
    main_and_exit()
