"""The same SFT job through this project, transformers' Trainer and TRL's SFTTrainer: one Markdown table.

    python scripts/benchmark_peers.py                    # ours, HF Trainer, TRL; padded and packed; 30 steps x 2 repeats
    python scripts/benchmark_peers.py --peers hf         # without TRL (pip install -e ".[bench]" adds it)
    python scripts/benchmark_peers.py --steps 5 --rows 300 --repeats 1 --modes padded
    python scripts/benchmark_peers.py --ours-extra train.compile=true   # our runs compiled

The job: the quickstart's tiny Llama widened to --hidden 256 x --layers 4 (random init, fp32, sdpa attention),
--rows 3,000 synthetic alpaca rows (the shipped character-level tokenizer: 34 to 470 tokens a row, 239 on average,
at --max-length 512), micro batch 8 x gradient accumulation 4, constant learning rate 1e-3, AdamW (torch's fused
kernel in every framework), gradient norm clipped to 1, --threads 2 threads.

What every framework gets alike, and how:
- token ids and labels: tokenized once, by our own pipeline (the token cache our launches read, built here before
  any run, so our runs start from a warm cache as any second launch does); prompt tokens are labelled -100;
- the batches: our order is a function of the seed (finetune.data.batches.TrainBatches). The peers get a dataset
  of exactly those rows in that order, read by a SequentialSampler (Trainer._get_train_sampler overridden), so their
  micro-batch i is rows [8i, 8i + 8), padded on the right to the longest row. Ours, as a user runs it, lays those rows
  end to end in one row instead (data.padding_free's default: no compute on padding, each row attending only to
  itself, the same loss); "ours, data.padding_free=false" pads them as the peers do (--no-ours-padded leaves it out);
- packed: our first-fit rows (data.packing=true: each sample attends only to itself, through position ids that
  restart at 0 for every sample, a block-diagonal causal mask under sdpa). TRL trains those rows padding-free, as
  its packing=True trains: its collator flattens a micro-batch into one sequence whose position ids come from each
  row's `seq_lengths`. TRL's own best-fit-decreasing packing is not used: it sorts the samples by length and packs
  other rows, so neither the tokens of a step nor the loss curve could be compared;
- initial weights: one random init (our model.init, seed 0), saved once with save_pretrained, loaded by everyone
  (ours: model=pretrained model.path=DIR);
- optimizer and schedule: AdamW (betas 0.9/0.999, eps 1e-8, no weight decay), the same learning rate, no warmup,
  max grad norm 1; the loss of a step is the mean over its labelled tokens in every framework. TRL's defaults that
  differ are switched off (bf16 autocast, gradient checkpointing);
- threads: OMP_NUM_THREADS for every process (ours: launcher.omp_num_threads), torch.set_num_threads in the peers;
  no DataLoader workers anywhere (ours collates in its loop);
- no evaluation: there is no eval set (ours then skips its before/after evaluation) and exact match is off; every
  framework saves its final weights at the end (ours always exports final/, the peers call save_model).

Measured per run, each in a fresh process (imports included), the order of the runs reversed every other repeat:
- steps: every framework writes a line at the end of each optimizer step (ours: its metrics.jsonl; the peers: a
  TrainerCallback's on_step_end) with the step's non-pad tokens and loss; a step's time runs from the end of the
  one before (or the start of training) to its end, data loading included, alike for all; steady state: the median
  over the steps after the first 3;
- time to the first step: from just before the process is started to when this script sees the first step's line
  (polled every 10 ms); wall: from the same moment to the process's exit;
- peak RSS: ru_maxrss of the process and the processes it waited for (os.wait4): ours is a launcher and the rank it
  starts, and the larger of the two is the rank;
- others' load: the cores other processes kept busy during the run (/proc/stat's busy time, steal included, less
  the run's CPU time and this script's): a shared machine slows a run down, never speeds it up, so the table
  shows tokens/s of every repeat and otherwise the best of them, and notes a run measured on a busy machine;
- ours runs with its default memory report (train.memory_report=peak: the high-water mark the system keeps, no
  hooks), no TensorBoard, no progress bar; the peers with report_to=none and no tqdm.

Fairness, checked in the output: each run's non-pad tokens per step against those of the prepared batches (within
1%, else FAIL and exit 1), and the largest |loss difference| at any step between each run and ours in the same mode
(within --loss-tol, else FAIL and exit 1). Intermediate files go to a temporary directory (--keep DIR keeps them).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LR, BETAS, EPS, MAX_GRAD_NORM, SEED = 1e-3, (0.9, 0.999), 1e-8, 1.0, 42
NAMES = {"ours": "ours (finetune)", "ours_padded": "ours, data.padding_free=false", "hf": "transformers Trainer",
         "trl": "TRL SFTTrainer"}
RUNS = [("ours", "padded"), ("ours_padded", "padded"), ("hf", "padded"), ("trl", "padded"), ("ours", "packed"), ("trl", "packed")]
"""ours: as a user runs it (padded mode: data.padding_free's default lays each micro-batch's rows end to end, no
compute on padding); ours_padded: the rows padded to the longest, as the peers pad them (the same maths as theirs)."""
STEADY_AFTER = 3  # steps left out of the steady state: warm-up (allocator, first optimizer step)
BUSY = 0.25  # others' load (cores) above which a run is noted as measured on a busy machine
TOKENS_TOL = 0.01  # non-pad tokens per step: every run within 1% of the prepared batches
TRL_MISSING = 'error: TRL is not installed: pip install -e ".[bench]" (or leave it out: --peers hf)'


def make_rows(n: int, max_length: int, seed: int = 0) -> list[dict]:
    """n alpaca rows of pseudo-words whose tokens (one per character, template included) stay under max_length."""
    import random

    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 8))) for _ in range(2000)]
    tasks = ["Summarize the text.", "Continue the story.", "Answer the question.", "Rewrite it formally.", "List the key points."]
    budget = max(4, (max_length - 40) // 6)  # ~6 characters a word with its space; ~40 tokens of template and task
    return [{"instruction": rng.choice(tasks), "input": " ".join(rng.choices(words, k=rng.randint(0, budget * 35 // 100))),
             "output": " ".join(rng.choices(words, k=rng.randint(2, max(2, budget * 55 // 100))))} for _ in range(n)]


# ---------------------------------------------------------------------------------------------
# The job, prepared once: weights, data, our overrides, the peers' datasets in our order


def model_overrides(args: argparse.Namespace) -> list[str]:
    return ["+recipe=quickstart_sft", f"model.init.hidden_size={args.hidden}", f"model.init.intermediate_size={3 * args.hidden}",
            f"model.init.num_hidden_layers={args.layers}", f"model.init.max_position_embeddings={args.max_length}",
            *([f"model.init.vocab_size={args.vocab}"] if args.vocab else []),
            *([f"model.init.num_attention_heads={args.heads}", f"model.init.num_key_value_heads={args.heads}"] if args.heads else [])]


def ours_overrides(args: argparse.Namespace, root: Path, mode: str, framework: str = "ours") -> list[str]:
    """Our run's overrides (without hydra.run.dir): the quickstart recipe on one process, the prepared weights and rows."""
    return [*(["data.padding_free=false"] if framework == "ours_padded" else []), *args.ours_extra, "+recipe=quickstart_sft", "model=pretrained", f"model.path={root / 'weights'}", f"model.attn_implementation={args.attn}",
            "data=jsonl", f"data.train={root / 'rows.jsonl'}", "data.format=alpaca", f"data.max_length={args.max_length}",
            f"data.cache_dir={root / 'tokens'}", f"data.packing={str(mode == 'packed').lower()}",
            "parallelism=single", "launcher.nproc_per_node=1", f"launcher.omp_num_threads={args.threads}", f"precision={args.precision}",
            f"train.device={args.device}",
            "optim=adamw", f"optim.lr={LR}", f"optim.betas=[{BETAS[0]},{BETAS[1]}]", f"optim.eps={EPS}", "optim.weight_decay=0",
            "optim.scheduler=constant", "optim.warmup_steps=0", f"optim.max_grad_norm={MAX_GRAD_NORM}", "optim.kernel=fused",
            f"train.max_steps={args.steps}", f"train.micro_batch_size={args.micro_batch}",
            f"train.global_batch_size={args.micro_batch * args.accum}", f"train.seed={SEED}", "train.eval_every=0",
            "train.exact_match_samples=0", "train.progress_bar=false", "train.tensorboard=false"]


def prepare(args: argparse.Namespace, root: Path, modes: list[str]) -> dict[str, list[int]]:
    """Write the rows, the initial weights, our token cache and each mode's peer dataset (our batches' rows in our
    order). Returns the non-pad tokens of each step, per mode."""
    import torch
    from datasets import Dataset

    from finetune.rank import model
    from finetune.launcher.compose import preflight
    from finetune.data import cache
    from finetune.data.batches import TrainBatches

    (root / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in make_rows(args.rows, args.max_length)))
    init = preflight(model_overrides(args))
    tokenizer = model.load_tokenizer(init.model)
    net = model.load_model(init.model, tokenizer, attention="sdpa", peft=init.peft, compute_dtype=torch.float32, zero3=False,
                           run_dir=root, is_main=True, barrier=lambda: None)
    net.save_pretrained(root / "weights")
    tokenizer.save_pretrained(root / "weights")
    expected = {}
    for mode in modes:
        cfg = preflight(ours_overrides(args, root, mode))
        train, *_ = cache.load(cfg.data, tokenizer, cfg.train.seed, cfg.method.name, builder=True, progress=False, say=lambda _: None)
        batches = TrainBatches(train, global_batch=cfg.train.global_batch_size, micro_batch=cfg.train.micro_batch_size, dp_rank=0,
                               dp_size=1, seed=cfg.train.seed, pad_id=tokenizer.pad_token_id)
        steps = [[train[i] for i in batches.indices(step)] for step in range(args.steps)]
        expected[mode] = [sum(len(e.input_ids) for e in step) for step in steps]
        rows = [e for step in steps for e in step]
        columns = {"input_ids": [e.input_ids for e in rows], "labels": [e.labels for e in rows]}
        if mode == "packed":
            columns["seq_lengths"] = [seq_lengths(e.position_ids) for e in rows]
        Dataset.from_dict(columns).save_to_disk(str(root / f"peer_{mode}"))
    return expected


def seq_lengths(position_ids: list[int]) -> list[int]:
    """A packed row's samples' lengths, from its position ids (each sample's restart at 0)."""
    starts = [i for i, p in enumerate(position_ids) if p == 0] + [len(position_ids)]
    return [b - a for a, b in zip(starts, starts[1:])]


# ---------------------------------------------------------------------------------------------
# One run: a fresh process, timed from outside


def run(framework: str, mode: str, repeat: int, args: argparse.Namespace, root: Path, env: dict[str, str]) -> dict:
    """One run in its own process: its step lines, time to the first step, wall time and peak RSS (or its error)."""
    out = root / f"{framework}_{mode}_{repeat}"
    out.mkdir()
    if framework.startswith("ours"):
        cmd = [sys.executable, "-m", "finetune.launch", *ours_overrides(args, root, mode, framework), f"hydra.run.dir={out}"]
        steps_file = out / "metrics.jsonl"
    else:
        spec = {"framework": framework, "mode": mode, "weights": str(root / "weights"), "data": str(root / f"peer_{mode}"),
                "out": str(out), "threads": args.threads, "steps": args.steps, "micro_batch": args.micro_batch,
                "accum": args.accum, "max_length": args.max_length, "device": args.device, "precision": args.precision,
                "attn": args.attn}
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)]
        steps_file = out / "steps.jsonl"
    first = None
    busy, mine = busy_s(), resource.getrusage(resource.RUSAGE_SELF)
    start = time.perf_counter()
    with open(out / "stdout.log", "w") as stdout, open(out / "stderr.log", "w") as stderr:
        proc = subprocess.Popen(cmd, stdout=stdout, stderr=stderr, env=env, cwd=out, start_new_session=True)
    try:
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if first is None and train_lines(steps_file):
                first = time.perf_counter() - start
            if pid:
                break
            time.sleep(0.01)
    except BaseException:  # Ctrl-C or SIGTERM here: the run must not train on, orphaned
        os.killpg(proc.pid, signal.SIGTERM)  # ours: the launcher passes it on to its rank (a session of its own) and waits
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        raise
    wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped by wait4: keep Popen from waiting again
    result = {"framework": framework, "mode": mode, "repeat": repeat, "wall_s": wall, "first_step_s": first,
              "rss_mib": usage.ru_maxrss / 1024,  # Linux: KiB
              "others": others(busy, mine, usage, wall)}
    lines = train_lines(steps_file)
    if proc.returncode != 0 or len(lines) != args.steps:
        tail = [line for line in (out / "stderr.log").read_text().splitlines() if line.strip()] or ["?"]
        return {**result, "error": f"exit {proc.returncode}, {len(lines)} of {args.steps} steps: {tail[-1][:200]}"}
    if framework.startswith("ours"):  # tokens_per_s counts non-pad tokens over the step's train_step
        lines = [{"step": r["step"], "elapsed_s": r["elapsed_s"], "tokens": round(r["tokens_per_s"] * r["step_s"]),
                  "loss": r["loss"]} for r in lines]
    return {**result, "steps": lines}


def busy_s() -> float | None:
    """Seconds this machine's cores have been busy since boot, steal time included (another VM on the host): the
    first line of /proc/stat; None where there is none."""
    try:
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in Path("/proc/stat").read_text().split()[1:9])
    except (OSError, ValueError):
        return None
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def others(busy: float | None, mine: resource.struct_rusage, usage: resource.struct_rusage, wall: float) -> float | None:
    """Cores kept busy by other processes during a run, on average: the machine's busy time less the run's CPU time
    (its processes' and those they waited for) and this script's own (polling). Near 0 on a quiet machine."""
    now = busy_s()
    if busy is None or now is None:
        return None
    me = resource.getrusage(resource.RUSAGE_SELF)
    cpu = usage.ru_utime + usage.ru_stime + me.ru_utime + me.ru_stime - mine.ru_utime - mine.ru_stime
    return max(0.0, (now - busy - cpu) / wall)


def train_lines(path: Path) -> list[dict]:
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    return [r for r in (json.loads(line) for line in text.splitlines() if line.endswith("}")) if r.get("kind") == "train"]


# ---------------------------------------------------------------------------------------------
# A peer, in its own process: `benchmark_peers.py --child SPEC`


def peer(spec: dict) -> int:
    """Train with transformers' Trainer ("hf") or TRL's SFTTrainer ("trl") on the prepared rows, in order, writing
    one line per optimizer step to OUT/steps.jsonl; then save the final weights, as ours does."""
    import torch

    torch.set_num_threads(spec["threads"])
    from datasets import load_from_disk
    from torch.utils.data import SequentialSampler
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    out = Path(spec["out"])
    packed = spec["mode"] == "packed"
    net = AutoModelForCausalLM.from_pretrained(spec["weights"], attn_implementation=spec["attn"], dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(spec["weights"])
    data = load_from_disk(spec["data"])
    common = {"output_dir": str(out), "max_steps": spec["steps"], "per_device_train_batch_size": spec["micro_batch"],
              "gradient_accumulation_steps": spec["accum"], "learning_rate": LR, "lr_scheduler_type": "constant",
              "warmup_steps": 0, "weight_decay": 0.0, "adam_beta1": BETAS[0], "adam_beta2": BETAS[1], "adam_epsilon": EPS,
              "max_grad_norm": MAX_GRAD_NORM, "optim": "adamw_torch_fused", "seed": SEED,
              "bf16": spec["precision"] == "bf16", "fp16": False, "use_cpu": spec["device"] == "cpu", "dataloader_num_workers": 0,
              "logging_steps": 1,
              "save_strategy": "no", "report_to": "none", "disable_tqdm": True}
    if spec["framework"] == "hf":
        from transformers import DataCollatorForSeq2Seq, Trainer, TrainingArguments

        base, kwargs = Trainer, {"args": TrainingArguments(**common), "data_collator": DataCollatorForSeq2Seq(
            tokenizer, padding="longest", label_pad_token_id=-100)}
    else:
        from trl import SFTConfig, SFTTrainer

        # TRL's default is gradient checkpointing (and bf16); padding-free needs max_length=None (the rows are already cut
        # to it); packing=False: the rows come packed
        base, kwargs = SFTTrainer, {"args": SFTConfig(**common, gradient_checkpointing=False, max_length=None if packed else
                                                      spec["max_length"], padding_free=packed, packing=False),
                                    "processing_class": tokenizer}
    step = {"tokens": 0, "loss": 0.0, "start": 0.0}

    class Sequential(base):  # type: ignore[misc, valid-type]
        """Our order: the dataset's, as prepared; counts each step's non-pad tokens and sums its loss."""

        def _get_train_sampler(self, train_dataset=None):
            return SequentialSampler(train_dataset if train_dataset is not None else self.train_dataset)

        def training_step(self, model, inputs, num_items_in_batch=None):
            mask = inputs.get("attention_mask")  # padding-free rows have none, and no padding
            step["tokens"] += int(mask.sum()) if mask is not None else inputs["input_ids"].numel()
            loss = super().training_step(model, inputs, num_items_in_batch)
            step["loss"] += float(loss)  # each micro-batch's share: its loss sum over the step's labelled tokens
            return loss

    class Steps(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            step["start"] = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            line = {"kind": "train", "step": state.global_step, "elapsed_s": time.perf_counter() - step["start"],
                    "tokens": step["tokens"], "loss": step["loss"]}
            with open(out / "steps.jsonl", "a") as f:
                f.write(json.dumps(line) + "\n")
            step.update(tokens=0, loss=0.0)

    trainer = Sequential(model=net, train_dataset=data, callbacks=[Steps()], **kwargs)
    trainer.train()
    trainer.save_model(str(out / "final"))
    return 0


# ---------------------------------------------------------------------------------------------
# Results -> numbers -> the table (pure)


def steady(steps: list[dict], skip: int = STEADY_AFTER) -> tuple[float, float]:
    """(median non-pad tokens/s, median step ms) over the steps after the first `skip` (all steps if there are no more)."""
    ends = [s["elapsed_s"] for s in steps]
    seconds = [b - a for a, b in zip([0.0, *ends], ends)]
    rates = [s["tokens"] / t for s, t in zip(steps, seconds)]
    keep = slice(skip, None) if len(steps) > skip else slice(None)
    return statistics.median(rates[keep]), 1000 * statistics.median(seconds[keep])


def fairness(runs: list[dict], expected: dict[str, list[int]]) -> list[dict]:
    """Per framework and mode: the mean non-pad tokens per step, the largest relative difference of any run's tokens
    at any step from the prepared batches', and the largest |loss difference| at any step from ours (repeat 1)."""
    out, done = [], finished(runs)
    for (framework, mode), mine in done.items():
        ref = done[("ours", mode)][0] if ("ours", mode) in done else None
        want = expected[mode]
        tokens = max(abs(s["tokens"] - w) / w for r in mine for s, w in zip(r["steps"], want))
        loss = None if ref is None else max(abs(s["loss"] - t["loss"]) for r in mine for s, t in zip(r["steps"], ref["steps"]))
        out.append({"framework": framework, "mode": mode, "tokens_per_step": statistics.mean(want), "tokens_diff": tokens,
                    "loss_diff": loss})
    return out


def order(runs: list[dict]) -> list[tuple[str, str]]:
    """(framework, mode) of the runs, in RUNS order."""
    present = {(r["framework"], r["mode"]) for r in runs}
    return [key for key in RUNS if key in present]


def table(runs: list[dict]) -> str:
    """One row per framework and mode: tokens/s and others' load of each repeat; then the best of the repeats (a
    busy machine only slows a run down): the highest tokens/s, the shortest step, first step and wall time; the
    largest peak RSS; the final loss; and the best tokens/s over the HF Trainer's (padded)."""
    best = {key: max(steady(r["steps"])[0] for r in rows) for key, rows in finished(runs).items()}
    hf = best.get(("hf", "padded"))
    lines = ["| framework | mode | tokens/s (each repeat) | others' load | step ms | first step s | wall s | peak RSS MiB "
             "| final loss | vs HF Trainer |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for framework, mode in order(runs):
        ok = finished(runs).get((framework, mode))
        if not ok:
            error = next(r["error"] for r in runs if (r["framework"], r["mode"]) == (framework, mode))
            lines.append(f"| {NAMES[framework]} | {mode} | failed: {error} ||||||||")
            continue
        rates = " / ".join(f"{steady(r['steps'])[0]:,.0f}" for r in ok)
        load = " / ".join("-" if r["others"] is None else f"{r['others']:.2f}" for r in ok)
        ratio = f"{best[framework, mode] / hf:.2f}x" if hf else "-"
        lines.append(f"| {NAMES[framework]} | {mode} | {rates} | {load} | "
                     f"{min(steady(r['steps'])[1] for r in ok):,.0f} | {min(r['first_step_s'] for r in ok):.1f} | "
                     f"{min(r['wall_s'] for r in ok):.1f} | {max(r['rss_mib'] for r in ok):,.0f} | {ok[0]['steps'][-1]['loss']:.4f} | "
                     f"{ratio} |")
    return "\n".join(lines) + "\n"


def finished(runs: list[dict]) -> dict[tuple[str, str], list[dict]]:
    """The runs that finished, by (framework, mode), in RUNS order, each in repeat order."""
    out = {key: [r for r in runs if (r["framework"], r["mode"]) == key and "steps" in r] for key in order(runs)}
    return {key: rows for key, rows in out.items() if rows}


def fairness_text(rows: list[dict], loss_tol: float) -> tuple[str, bool]:
    """The fairness table and its verdict lines; and whether every check passed."""
    lines = ["| framework | mode | non-pad tokens per step (mean) | max relative difference | max \\|loss - ours\\| |",
             "|---|---|---:|---:|---:|"]
    for r in rows:
        loss = "-" if r["loss_diff"] is None else f"{r['loss_diff']:.1e}"
        lines.append(f"| {NAMES[r['framework']]} | {r['mode']} | {r['tokens_per_step']:,.1f} | {r['tokens_diff']:.3%} | {loss} |")
    tokens = max((r["tokens_diff"] for r in rows), default=0.0)
    losses = [r["loss_diff"] for r in rows if r["loss_diff"] is not None]
    loss = max(losses, default=0.0)
    tokens_ok, loss_ok = tokens <= TOKENS_TOL, loss <= loss_tol
    lines += ["", f"{'OK' if tokens_ok else 'FAIL'}: non-pad tokens per step, largest relative difference of any run at any "
                  f"step from the prepared batches: {tokens:.3%} (limit {TOKENS_TOL:.0%})",
              f"{'OK' if loss_ok else 'FAIL'}: loss, largest |difference| at any step from ours in the same mode: {loss:.1e} "
              f"(limit {loss_tol:.0e})"]
    return "\n".join(lines) + "\n", tokens_ok and loss_ok


def report(runs: list[dict], expected: dict[str, list[int]], args: argparse.Namespace) -> tuple[str, bool]:
    """The Markdown the script writes: a caption, the table, the fairness section; and whether it passed."""
    fair, ok = fairness_text(fairness(runs, expected), args.loss_tol)
    failed = [r for r in runs if "error" in r]
    caption = (f"Llama (random init, hidden {args.hidden}, {args.layers} layers, {args.precision}, {args.attn}, on {args.device}), {args.rows:,} synthetic alpaca rows of at "
               f"most {args.max_length} tokens, micro batch {args.micro_batch} x accumulation {args.accum}, {args.steps} steps, "
               f"{args.threads} threads, {os.cpu_count()} CPU cores; {args.repeats} repeat(s), each run a fresh process, the order "
               f"reversed every other repeat. tokens/s: non-pad tokens, median over the steps after step {STEADY_AFTER}; others' "
               "load: cores kept busy by other processes during the run (0 on a quiet machine); the other columns are the best "
               "of the repeats (a busy machine only slows a run): step ms, the same median; first step: process start to the end "
               "of the first optimizer step (imports, model, data, setup); wall: the whole process, final save included; peak "
               "RSS: the largest process (ours: the rank, not its launcher), the largest of the repeats. Ours with "
               "its default memory report (the peak, no hooks); TRL with gradient checkpointing off; packed: our first-fit rows, TRL "
               "padding-free.\n\n")
    text = caption + table(runs) + "\nFairness: the same token ids, labels, batches, initial weights and schedule.\n\n" + fair
    busiest = max((r["others"] for r in runs if r.get("others") is not None), default=0.0)
    if busiest > BUSY:
        text += (f"\nNOTE: other processes kept up to {busiest:.2f} cores busy during a run (others' load): the machine was not "
                 "quiet, and tokens/s of those runs are lower than it can do\n")
    if failed:
        text += "".join(f"\nFAIL: {NAMES[r['framework']]} {r['mode']} (repeat {r['repeat']}): {r['error']}" for r in failed) + "\n"
    return text, ok and not failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", default="hf,trl", help="comma-separated: hf, trl (ours always runs)")
    parser.add_argument("--modes", nargs="+", default=["padded", "packed"], choices=["padded", "packed"])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--rows", type=int, default=3000)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--accum", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--loss-tol", type=float, help="largest |loss - ours| at any step (default 1e-3; bf16: 5e-2)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"], help="bf16: autocast in every framework")
    parser.add_argument("--attn", default="sdpa", choices=["sdpa", "flash_attention_2"], help="every framework's attention")
    parser.add_argument("--vocab", type=int, help="the model's vocabulary (default: the shipped tokenizer's)")
    parser.add_argument("--heads", type=int, help="attention heads (default: the quickstart's)")
    parser.add_argument("--out", type=Path, default=Path("benchmark_peers.md"))
    parser.add_argument("--keep", type=Path, help="keep the prepared data and every run's directory here")
    parser.add_argument("--ours-extra", nargs="*", default=[], metavar="KEY=VALUE",
                        help="more overrides for our runs (e.g. train.compile=true)")
    parser.add_argument("--no-ours-padded", dest="ours_padded", action="store_false",
                        help="leave out our run with data.padding_free=false (padded rows, as the peers pad them)")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # a peer's run, started by this script
    args = parser.parse_args(argv)
    if args.loss_tol is None:
        args.loss_tol = 5e-2 if args.precision == "bf16" else 1e-3
    if args.child:
        return peer(json.loads(args.child))
    peers = [p for p in args.peers.split(",") if p]
    unknown = [p for p in peers if p not in ("hf", "trl")]
    if unknown:
        print(f"error: unknown peer {unknown[0]!r}; known: hf, trl", file=sys.stderr)
        return 2
    if "trl" in peers and importlib.util.find_spec("trl") is None:
        print(TRL_MISSING, file=sys.stderr)
        return 2
    if args.keep and args.keep.exists() and any(args.keep.iterdir()):
        print(f"error: --keep {args.keep}: not empty (the runs write their directories there): name a new directory", file=sys.stderr)
        return 2
    jobs = [(f, m) for f, m in RUNS if (f == "ours" or f in peers or (f == "ours_padded" and args.ours_padded)) and m in args.modes]
    signal.signal(signal.SIGTERM, lambda signum, _: sys.exit(128 + signum))  # unwinds through run(): its process group ends
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}  # everything is local: no hub lookups in anyone's timing
    with tempfile.TemporaryDirectory() as tmp:
        root = (args.keep or Path(tmp)).resolve()
        root.mkdir(parents=True, exist_ok=True)
        print(f"preparing {args.rows:,} rows, the initial weights and the token cache in {root} ...", flush=True)
        expected = prepare(args, root, args.modes)
        runs = []
        for repeat in range(1, args.repeats + 1):
            for framework, mode in jobs if repeat % 2 else jobs[::-1]:
                print(f"repeat {repeat}: {NAMES[framework]}, {mode} ...", flush=True)
                runs.append(run(framework, mode, repeat, args, root, env))
                if "error" in runs[-1]:
                    print(f"  failed: {runs[-1]['error']}", flush=True)
    text, ok = report(runs, expected, args)
    args.out.write_text(text)
    print(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
