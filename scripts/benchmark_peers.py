"""The same SFT job through this project, transformers' Trainer and TRL's SFTTrainer: one Markdown table.

    python scripts/benchmark_peers.py                    # ours, HF Trainer, TRL; padded and packed; 30 steps x 2 repeats
    python scripts/benchmark_peers.py --peers hf         # without TRL (pip install -e ".[bench]" adds it)
    python scripts/benchmark_peers.py --steps 5 --rows 300 --repeats 1 --modes padded
    python scripts/benchmark_peers.py --ours-extra train.compile=true   # our runs compiled
    python scripts/benchmark_peers.py --method grpo      # GRPO against TRL's GRPOTrainer (--method dpo: its DPOTrainer)

--method grpo and --method dpo: scripts/peers_rl.py says what those races make equal and how they are measured.

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
import functools
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LR, BETAS, EPS, MAX_GRAD_NORM, SEED = 1e-3, (0.9, 0.999), 1e-8, 1.0, 42
NAMES = {"ours": "ours (finetune)", "ours_padded": "ours, data.padding_free=false", "hf": "transformers Trainer",
         "trl": "TRL SFTTrainer"}
RUNS = [("ours", "padded"), ("ours_padded", "padded"), ("hf", "padded"), ("trl", "padded"), ("ours", "packed"), ("trl", "packed")]
"""ours: as a user runs it (padded mode: data.padding_free's default lays each micro-batch's rows end to end, no
compute on padding); ours_padded: the rows padded to the longest, as the peers pad them (the same maths as theirs)."""
STEADY_AFTER = 3  # steps left out of the steady state: warm-up (allocator, first optimizer step)
BUSY = 0.25  # others' load (cores) above which a run is noted as measured on a busy machine
TOKENS_TOL = 0.01  # non-pad tokens per step: every run within 1% of the prepared batches


@dataclass(frozen=True)
class Race:
    """What a race's tables name: its runs' (framework, mode) in table order, the frameworks' names, and the run the
    others are measured against (`base`; in `base_mode`, or each run's own mode where None)."""

    runs: list[tuple[str, str]]
    names: dict[str, str]
    base: str
    versus: str  # the base run's name in the ratio's column
    base_mode: str | None = None


SFT = Race(RUNS, NAMES, "hf", "HF Trainer", "padded")
DEFAULTS = {  # per --method: what a flag left out means (rows None: the rows of the steps)
    "sft": {"peers": "hf,trl", "steps": 30, "rows": 3000, "max_length": 512, "micro_batch": 8, "accum": 4},
    "grpo": {"peers": "trl", "steps": 24, "max_length": 128, "micro_batch": 4, "accum": 1},
    "dpo": {"peers": "trl", "steps": 30, "max_length": 512, "micro_batch": 8, "accum": 4},
}
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
    return [*(["data.padding_free=false"] if framework == "ours_padded" else []), *job_overrides(args, root, "alpaca"),
            f"data.packing={str(mode == 'packed').lower()}"]


def job_overrides(args: argparse.Namespace, root: Path, data_format: str) -> list[str]:
    """What our runs of every race share: the quickstart recipe on one process, the prepared weights, rows (of
    `data_format`) and token cache, the optimizer and schedule, the batch, no evaluation and no progress bar."""
    return [*args.ours_extra, "+recipe=quickstart_sft", "model=pretrained", f"model.path={root / 'weights'}", f"model.attn_implementation={args.attn}",
            "data=jsonl", f"data.train={root / 'rows.jsonl'}", f"data.format={data_format}", f"data.max_length={args.max_length}",
            f"data.cache_dir={root / 'tokens'}",
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
    from datasets import Dataset

    (root / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in make_rows(args.rows, args.max_length)))
    tokenizer = write_weights(args, root)
    expected = {}
    for mode in modes:
        steps = our_steps(ours_overrides(args, root, mode), tokenizer, args.steps)
        expected[mode] = [sum(len(e.input_ids) for e in step) for step in steps]
        rows = [e for step in steps for e in step]
        columns = {"input_ids": [e.input_ids for e in rows], "labels": [e.labels for e in rows]}
        if mode == "packed":
            columns["seq_lengths"] = [seq_lengths(e.position_ids) for e in rows]
        Dataset.from_dict(columns).save_to_disk(str(root / f"peer_{mode}"))
    return expected


def write_weights(args: argparse.Namespace, root: Path) -> Any:
    """The initial weights (our model.init, seed 0) and the tokenizer, saved in ROOT/weights; returns the tokenizer."""
    import torch

    from finetune.launcher.compose import preflight
    from finetune.rank import model

    init = preflight(model_overrides(args))
    tokenizer = model.load_tokenizer(init.model)
    net = model.load_model(init.model, tokenizer, attention="sdpa", peft=init.peft, compute_dtype=torch.float32, zero3=False,
                           run_dir=root, is_main=True, barrier=lambda: None)
    net.save_pretrained(root / "weights")
    tokenizer.save_pretrained(root / "weights")
    return tokenizer


def our_steps(overrides: list[str], tokenizer: Any, steps: int) -> list[list[Any]]:
    """Our token cache for a run of `overrides`, built here (our runs then start from a warm cache), and the examples of
    each of its first `steps` steps in our order (finetune.data.batches.TrainBatches, a function of the seed)."""
    from finetune.data import cache
    from finetune.data.batches import TrainBatches
    from finetune.launcher.compose import preflight

    cfg = preflight(overrides)
    train, *_ = cache.load(cfg.data, tokenizer, cfg.train.seed, cfg.method.name, builder=True, progress=False, say=lambda _: None)
    batches = TrainBatches(train, global_batch=cfg.train.global_batch_size, micro_batch=cfg.train.micro_batch_size, dp_rank=0,
                           dp_size=1, seed=cfg.train.seed, pad_id=tokenizer.pad_token_id)
    return [[train[i] for i in batches.indices(step)] for step in range(steps)]


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
        cmd, steps_file = child(spec), out / "steps.jsonl"
    result = timed(cmd, out, steps_file, env, args.steps, {"framework": framework, "mode": mode, "repeat": repeat})
    if framework.startswith("ours") and "steps" in result:
        result["steps"] = our_lines(result["steps"])
    return result


def our_lines(lines: list[dict]) -> list[dict]:
    """Our metrics' train lines as the peers' step lines (tokens_per_s counts non-pad tokens over the step's train_step)."""
    return [{"step": r["step"], "elapsed_s": r["elapsed_s"], "tokens": round(r["tokens_per_s"] * r["step_s"]), "loss": r["loss"]}
            for r in lines]


def child(spec: dict) -> list[str]:
    """The command of a peer's run: this script with --child SPEC (peers_child.peer)."""
    return [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)]


def timed(cmd: list[str], out: Path, steps_file: Path, env: dict[str, str], steps: int, key: dict) -> dict:
    """Run `cmd` in OUT, a process group of its own, timed from outside: `key` with the train lines of `steps_file`
    (`steps` of them), time to the first, wall time, peak RSS and others' load; or with the error."""
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
    result = {**key, "wall_s": wall, "first_step_s": first, "rss_mib": usage.ru_maxrss / 1024,  # Linux: KiB
              "others": others(busy, mine, usage, wall)}
    lines = train_lines(steps_file)
    if proc.returncode != 0 or len(lines) != steps:
        tail = [line for line in (out / "stderr.log").read_text().splitlines() if line.strip()] or ["?"]
        return {**result, "error": f"exit {proc.returncode}, {len(lines)} of {steps} steps: {tail[-1][:200]}"}
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
# Results -> numbers -> the table (pure)


def steady(steps: list[dict], skip: int = STEADY_AFTER) -> tuple[float, float]:
    """(median non-pad tokens/s, median step ms) over the steps after the first `skip` (all steps if there are no more)."""
    ends = [s["elapsed_s"] for s in steps]
    seconds = [b - a for a, b in zip([0.0, *ends], ends)]
    rates = [s["tokens"] / t for s, t in zip(steps, seconds)]
    keep = slice(skip, None) if len(steps) > skip else slice(None)
    return statistics.median(rates[keep]), 1000 * statistics.median(seconds[keep])


def fairness(runs: list[dict], expected: dict[str, list[int]], race: Race = SFT) -> list[dict]:
    """Per framework and mode: the mean non-pad tokens per step, the largest relative difference of any run's tokens
    at any step from the prepared batches', and the largest |loss difference| at any step from ours (repeat 1)."""
    out, done = [], finished(runs, race)
    for (framework, mode), mine in done.items():
        ref = done[("ours", mode)][0] if ("ours", mode) in done else None
        want = expected[mode]
        tokens = max(abs(s["tokens"] - w) / w for r in mine for s, w in zip(r["steps"], want))
        loss = None if ref is None else max(abs(s["loss"] - t["loss"]) for r in mine for s, t in zip(r["steps"], ref["steps"]))
        out.append({"framework": framework, "mode": mode, "tokens_per_step": statistics.mean(want), "tokens_diff": tokens,
                    "loss_diff": loss})
    return out


def order(runs: list[dict], race: Race = SFT) -> list[tuple[str, str]]:
    """(framework, mode) of the runs, in the race's order."""
    present = {(r["framework"], r["mode"]) for r in runs}
    return [key for key in race.runs if key in present]


def table(runs: list[dict], race: Race = SFT) -> str:
    """One row per framework and mode: tokens/s and others' load of each repeat; then the best of the repeats (a
    busy machine only slows a run down): the highest tokens/s, the shortest step, first step and wall time; the
    largest peak RSS; the final loss; and the best tokens/s over the race's base run's (SFT: the HF Trainer's, padded)."""
    best = {key: max(steady(r["steps"])[0] for r in rows) for key, rows in finished(runs, race).items()}
    lines = ["| framework | mode | tokens/s (each repeat) | others' load | step ms | first step s | wall s | peak RSS MiB "
             f"| final loss | vs {race.versus} |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for framework, mode in order(runs, race):
        ok = finished(runs, race).get((framework, mode))
        if not ok:
            error = next(r["error"] for r in runs if (r["framework"], r["mode"]) == (framework, mode))
            lines.append(f"| {race.names[framework]} | {mode} | failed: {error} ||||||||")
            continue
        rates = " / ".join(f"{steady(r['steps'])[0]:,.0f}" for r in ok)
        load = " / ".join("-" if r["others"] is None else f"{r['others']:.2f}" for r in ok)
        base = best.get((race.base, race.base_mode or mode))
        ratio = f"{best[framework, mode] / base:.2f}x" if base else "-"
        lines.append(f"| {race.names[framework]} | {mode} | {rates} | {load} | "
                     f"{min(steady(r['steps'])[1] for r in ok):,.0f} | {min(r['first_step_s'] for r in ok):.1f} | "
                     f"{min(r['wall_s'] for r in ok):.1f} | {max(r['rss_mib'] for r in ok):,.0f} | {ok[0]['steps'][-1]['loss']:.4f} | "
                     f"{ratio} |")
    return "\n".join(lines) + "\n"


def finished(runs: list[dict], race: Race = SFT) -> dict[tuple[str, str], list[dict]]:
    """The runs that finished, by (framework, mode), in the race's order, each in repeat order."""
    out = {key: [r for r in runs if (r["framework"], r["mode"]) == key and "steps" in r] for key in order(runs, race)}
    return {key: rows for key, rows in out.items() if rows}


def fairness_text(rows: list[dict], loss_tol: float, race: Race = SFT) -> tuple[str, bool]:
    """The fairness table and its verdict lines; and whether every check passed."""
    lines = ["| framework | mode | non-pad tokens per step (mean) | max relative difference | max \\|loss - ours\\| |",
             "|---|---|---:|---:|---:|"]
    for r in rows:
        loss = "-" if r["loss_diff"] is None else f"{r['loss_diff']:.1e}"
        lines.append(f"| {race.names[r['framework']]} | {r['mode']} | {r['tokens_per_step']:,.1f} | {r['tokens_diff']:.3%} | {loss} |")
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
    return text + notes(runs, SFT, "tokens/s"), ok and not failed


def notes(runs: list[dict], race: Race, rate: str) -> str:
    """The report's last lines: a NOTE when another process kept the machine busy during a run, a FAIL per failed run."""
    text = ""
    busiest = max((r["others"] for r in runs if r.get("others") is not None), default=0.0)
    if busiest > BUSY:
        text += (f"\nNOTE: other processes kept up to {busiest:.2f} cores busy during a run (others' load): the machine was not "
                 f"quiet, and {rate} of those runs are lower than it can do\n")
    failed = [r for r in runs if "error" in r]
    if failed:
        text += "".join(f"\nFAIL: {race.names[r['framework']]} {r['mode']} (repeat {r['repeat']}): {r['error']}" for r in failed) + "\n"
    return text


def arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--method", default="sft", choices=list(DEFAULTS), help="the job: sft (default), grpo or dpo "
                        "(scripts/peers_rl.py says how each is made equal)")
    parser.add_argument("--peers", help="comma-separated: hf, trl (ours always runs; default: hf,trl; grpo and dpo: trl)")
    parser.add_argument("--modes", nargs="+", default=["padded", "packed"], choices=["padded", "packed"], help="sft")
    parser.add_argument("--steps", type=int, help="default: 30 (grpo: 24)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--rows", type=int, help="default: sft 3,000; dpo and grpo: the rows of the steps (one epoch)")
    parser.add_argument("--max-length", type=int, help="default: 512 (grpo: 128, its rows' prompt and answer)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--micro-batch", type=int, help="rows (dpo: pairs; grpo: prompts) per micro-batch; default 8 (grpo: 4)")
    parser.add_argument("--accum", type=int, help="micro-batches per step; default 4 (grpo: 1)")
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
    import peers_rl

    peers_rl.add_arguments(parser)
    args = parser.parse_args(argv)
    for key, value in DEFAULTS[args.method].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.rows is None:  # one epoch: every prompt or pair once
        args.rows = args.steps * args.micro_batch * args.accum
    if args.loss_tol is None:
        args.loss_tol = 5e-2 if args.precision == "bf16" else 1e-3
    return args


def main(argv: list[str] | None = None) -> int:
    args = arguments(argv)
    if args.child:
        import peers_child

        return peers_child.peer(json.loads(args.child))
    sft = args.method == "sft"
    known = ("hf", "trl") if sft else ("trl",)
    peers = [p for p in args.peers.split(",") if p]
    unknown = [p for p in peers if p not in known]
    if unknown:
        print(f"error: unknown peer {unknown[0]!r}; known: {', '.join(known)}", file=sys.stderr)
        return 2
    if "trl" in peers and importlib.util.find_spec("trl") is None:
        print(TRL_MISSING if sft else 'error: TRL is not installed: pip install -e ".[bench]" (or race ours alone: --peers "")',
              file=sys.stderr)
        return 2
    if args.keep and args.keep.exists() and any(args.keep.iterdir()):
        print(f"error: --keep {args.keep}: not empty (the runs write their directories there): name a new directory", file=sys.stderr)
        return 2
    if sft:
        race, modes = SFT, args.modes
    else:
        import peers_rl

        race, modes = peers_rl.race(args)
    jobs = [(f, m) for f, m in race.runs if (f == "ours" or f in peers or (f == "ours_padded" and args.ours_padded)) and m in modes]
    signal.signal(signal.SIGTERM, lambda signum, _: sys.exit(128 + signum))  # unwinds through run(): its process group ends
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}  # everything is local: no hub lookups in anyone's timing
    with tempfile.TemporaryDirectory() as tmp:
        root = (args.keep or Path(tmp)).resolve()
        root.mkdir(parents=True, exist_ok=True)
        print(f"preparing {args.rows:,} rows, the initial weights and the token cache in {root} ...", flush=True)
        if sft:
            expected = prepare(args, root, args.modes)
            one = functools.partial(run, args=args, root=root, env=env)
        else:
            expected, one = peers_rl.prepared(args, root, env)
        runs = []
        for repeat in range(1, args.repeats + 1):
            for framework, mode in jobs if repeat % 2 else jobs[::-1]:
                print(f"repeat {repeat}: {race.names[framework]}, {mode} ...", flush=True)
                runs.append(one(framework, mode, repeat))
                if "error" in runs[-1]:
                    print(f"  failed: {runs[-1]['error']}", flush=True)
    text, ok = report(runs, expected, args) if sft else peers_rl.report(runs, expected, args)
    args.out.write_text(text)
    print(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
