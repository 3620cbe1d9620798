"""GRPO and DPO through this project and TRL (GRPOTrainer, DPOTrainer): `benchmark_peers.py --method grpo|dpo`.

    python scripts/benchmark_peers.py --method grpo          # 24 steps of 4 prompts x G 8, 48 completion tokens, 2 repeats
    python scripts/benchmark_peers.py --method dpo           # 30 steps of 32 pairs (micro batch 8 x 4), 2 repeats
    python scripts/benchmark_peers.py --method dpo --reference precomputed live
    python scripts/benchmark_peers.py --method grpo --peers "" --steps 3 --repeats 1    # ours alone (no TRL needed)

Both races share the SFT race's model (the quickstart's tiny Llama widened to --hidden x --layers, random init, saved
once with save_pretrained and loaded by everyone), optimizer (AdamW, torch's fused kernel, lr 1e-3 constant, no warmup,
no weight decay, grad norm clipped to 1), seed, threads, precision and timing from outside (benchmark_peers.timed: time
to the first step, wall, peak RSS, others' load; each run a fresh process, the order reversed every other repeat).

GRPO: the shipped quickstart rows (string transforms: `reverse\\nldpbe` -> `ebpdl`), --micro-batch prompts a step
(x --accum), G = --generations completions of at most --completion-tokens tokens each, one update per rollout.
- prompts: tokenized by our pipeline (our token cache), the steps' prompts in our order (TrainBatches); TRL gets a
  dataset of exactly those prompts in that order (`shuffle_dataset=False`: its RepeatSampler repeats each G times),
  as text that its tokenizer turns back into our very ids (checked here, before any run);
- the reward: one function for both, `reward` below (difflib's matched-character ratio of completion and answer, our
  built-in `similarity`: a random-init model never gets an exact match, whose reward would be 0 everywhere and train
  nothing). It logs the prompts it scores to the run's directory: the fairness check compares them, step by step,
  with the prepared ones;
- the loss: TRL 1.16's GRPOConfig defaults, and ours set to them: loss_type dapo (every completion token of the step
  one weight), scale_rewards group (the group's std + 1e-4, n - 1), beta 0 (no reference), epsilon 0.2 (inactive: one
  update per rollout trains at ratio 1), mask_truncated_completions false; sampling at temperature 1, top_p 1, top_k 0;
  TRL's gradient checkpointing (its default) off, as for SFT;
- sampling differs, and cannot be made equal: each framework draws from its own random stream (ours seeded by
  (seed, step, rank, micro-batch), TRL's the global one seeded once), so completions, rewards and losses differ from
  the first step on. The reward curves are compared within noise: the mean reward over the last half of the steps,
  averaged over the repeats, within --reward-tol of ours (else FAIL, exit 1);
- measured per step: its time (as for SFT, from the end of the step before), the rollout's time apart (ours: its
  metrics' generation_s, sampling + scoring; TRL: `_generate_and_score_completions`, timed by a subclass: generate,
  decode, rewards, advantages) and the training time (the rest), its mean reward and completion length; steady
  state: the median over the steps after the first 3; steps/s is one over the median step.

DPO: synthetic pairs (`make_pairs`: the SFT race's alpaca rows, `instruction\\ninput` as the prompt, the row's output
chosen, the next row's rejected), --rows of them (default: one epoch of the steps), beta 0.1, the sigmoid loss.
- token ids: ours, tokenized once (our token cache); TRL gets our prompt, chosen and rejected ids (its dataset's
  preparation, which would tokenize the text again, is skipped: peers_child.dpo_trainer), the pairs in our order (a
  SequentialSampler, as for SFT), max_length None (nothing cut);
- the reference: `--reference precomputed` (our default; TRL's precompute_ref_log_probs=True: one no-grad pass of the
  initial model over the pairs before the first step, in both counted in the time to the first step) or `live` (our
  method.reference=live, a frozen copy; TRL's ref model, loaded from the same weights): the same in both, per row;
- checked as for SFT: each step's non-pad tokens within 1% of the prepared batches' and its loss within --loss-tol of
  ours (same maths, same data: only float noise differs).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any, Callable

import benchmark_peers as bp

SCRIPTS = Path(__file__).resolve().parent
REWARD = "peers_rl:reward"  # our method.rewards entry: this module's function (PYTHONPATH has this directory)
PROMPTS = "prompts.jsonl"  # in each run's directory: what the reward was given, call by call
BETA = 0.1  # DPO's (both frameworks' default)
GRPO = bp.Race([("ours", "grpo"), ("ours_padded", "grpo"), ("trl", "grpo")],
               {"ours": "ours (finetune)", "ours_padded": "ours, data.padding_free=false", "trl": "TRL GRPOTrainer"}, "trl", "TRL")
DPO = bp.Race([(f, m) for m in ("precomputed", "live") for f in ("ours", "ours_padded", "trl")],
              {"ours": "ours (finetune)", "ours_padded": "ours, data.padding_free=false", "trl": "TRL DPOTrainer"}, "trl", "TRL")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of these races (benchmark_peers.arguments adds them)."""
    parser.add_argument("--reference", nargs="+", default=["precomputed"], choices=["precomputed", "live"],
                        help="dpo: how every framework computes the reference log-probs")
    parser.add_argument("--generations", type=int, default=8, help="grpo: completions per prompt (G)")
    parser.add_argument("--completion-tokens", type=int, default=48, help="grpo: the longest completion")
    parser.add_argument("--reward-tol", type=float, default=0.02, help="grpo: largest |mean reward - ours| over the last half")


def reward(*, prompts: list[str], completions: list[str], answers: list[str], **_: Any) -> list[float]:
    """Both frameworks' reward: our `similarity` (difflib's ratio of the stripped texts, 1.0 when equal); each call's
    prompts appended to $PEERS_PROMPTS (the run's PROMPTS) when set."""
    from finetune.methods.rewards import similarity

    if os.environ.get("PEERS_PROMPTS"):
        with open(os.environ["PEERS_PROMPTS"], "a") as f:
            f.write(json.dumps(prompts) + "\n")
    return similarity(completions=completions, answers=answers)


def make_pairs(n: int, max_length: int, seed: int = 0) -> list[dict]:
    """n preference rows: a synthetic alpaca row's instruction and input as the prompt, its output chosen, the next
    row's output rejected (another length, other words: nothing a model can learn to tell apart, so the loss stays
    near log 2, where a difference between frameworks shows; a preference it could learn, capitals say, drove the loss
    to 4e-4 within 5 steps, below any tolerance)."""
    rows = bp.make_rows(n + 1, max_length, seed)
    return [{"prompt": f"{r['instruction']}\n{r['input']}".strip(), "chosen": r["output"], "rejected": nxt["output"]}
            for r, nxt in zip(rows, rows[1:])]


def race(args: argparse.Namespace) -> tuple[bp.Race, list[str]]:
    """The method's race and the modes that run (grpo: one; dpo: its references)."""
    return (GRPO, ["grpo"]) if args.method == "grpo" else (DPO, list(args.reference))


# ---------------------------------------------------------------------------------------------
# The job, prepared once


def grpo_overrides(args: argparse.Namespace, root: Path) -> list[str]:
    """Our GRPO run's overrides: the shared job, the sampling and TRL 1.16's GRPO defaults spelt out."""
    return [*bp.job_overrides(args, root, "alpaca"), "method=grpo", f"method.generations={args.generations}",
            f"method.completion_tokens={args.completion_tokens}", f"method.rewards=[{REWARD}]", "method.loss_type=dapo",
            "method.scale_rewards=group", "method.beta=0", "method.temperature=1.0", "method.top_p=1.0",
            "method.mask_truncated_completions=false"]


def dpo_overrides(args: argparse.Namespace, root: Path, reference: str) -> list[str]:
    return [*bp.job_overrides(args, root, "preference"), "method=dpo", "method.loss=sigmoid", f"method.beta={BETA}",
            f"method.reference={reference}"]


def prepared(args: argparse.Namespace, root: Path, env: dict[str, str]) -> tuple[dict, Callable[[str, str, int], dict]]:
    """The method's rows, weights, token cache and TRL's dataset, written under ROOT; what the fairness checks expect;
    and the function that makes one run (framework, mode, repeat)."""
    env = {**env, "PYTHONPATH": os.pathsep.join(p for p in (str(SCRIPTS), env.get("PYTHONPATH", "")) if p)}
    if args.method == "grpo":
        return prepare_grpo(args, root), lambda framework, mode, repeat: run_grpo(framework, repeat, args, root, env)
    return prepare_dpo(args, root), lambda framework, mode, repeat: run_dpo(framework, mode, repeat, args, root, env)


def prepare_grpo(args: argparse.Namespace, root: Path) -> dict:
    """The quickstart's first --rows rows, the weights, our token cache, and TRL's dataset: each step's prompts in our
    order (as text its tokenizer turns into our ids) with their answers. Returns each step's prompts as our reward sees
    them (decoded without special tokens) and the tokenizer's special tokens."""
    import finetune
    from datasets import Dataset

    shipped = Path(finetune.__file__).parent / "assets" / "data" / "quickstart" / "train.jsonl"
    (root / "rows.jsonl").write_text("".join(shipped.read_text().splitlines(keepends=True)[: args.rows]))
    tokenizer = bp.write_weights(args, root)
    steps = bp.our_steps(grpo_overrides(args, root), tokenizer, args.steps)
    rows = [e for step in steps for e in step]
    cut = [first_label(e) for e in rows]
    texts = [tokenizer.decode(e.input_ids[:c]) for e, c in zip(rows, cut)]
    for text, e, c in zip(texts, rows, cut):
        if tokenizer(text)["input_ids"] != e.input_ids[:c]:
            raise SystemExit(f"error: TRL would tokenize the prompt {text!r} into other ids than ours: no fair race")
    answers = [tokenizer.decode(e.input_ids[c:], skip_special_tokens=True) for e, c in zip(rows, cut)]
    Dataset.from_dict({"prompt": texts, "answers": answers}).save_to_disk(str(root / "peer_grpo"))
    seen = iter(tokenizer.decode(e.input_ids[:c], skip_special_tokens=True) for e, c in zip(rows, cut))
    return {"prompts": [[next(seen) for _ in step] for step in steps], "specials": list(tokenizer.all_special_tokens)}


def prepare_dpo(args: argparse.Namespace, root: Path) -> dict[str, list[int]]:
    """The pairs, the weights, our token cache and TRL's dataset of our prompt, chosen and rejected ids in our order.
    Returns the non-pad tokens of each step (both rows of each pair), per reference."""
    from datasets import Dataset

    (root / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in make_pairs(args.rows, args.max_length)))
    tokenizer = bp.write_weights(args, root)
    expected = {}
    for reference in args.reference:
        steps = bp.our_steps(dpo_overrides(args, root, reference), tokenizer, args.steps)
        expected[reference] = [sum(len(p.chosen.input_ids) + len(p.rejected.input_ids) for p in step) for step in steps]
    columns: dict[str, list[list[int]]] = {"prompt_ids": [], "chosen_ids": [], "rejected_ids": []}
    for pair in (p for step in steps for p in step):
        cut = [first_label(e) for e in pair.rows]
        if cut[0] != cut[1] or any(e.input_ids[c:] != e.labels[c:] for e, c in zip(pair.rows, cut)):
            raise SystemExit("error: a pair's rows do not share their prompt, or leave response tokens unlabelled: TRL's "
                             "prompt_ids + chosen_ids form cannot hold them")
        columns["prompt_ids"].append(pair.chosen.input_ids[: cut[0]])
        columns["chosen_ids"].append(pair.chosen.input_ids[cut[0]:])
        columns["rejected_ids"].append(pair.rejected.input_ids[cut[1]:])
    Dataset.from_dict(columns).save_to_disk(str(root / "peer_dpo"))
    return expected


def first_label(example: Any) -> int:
    """Where a row's prompt ends: its first labelled token."""
    return next(i for i, t in enumerate(example.labels) if t != -100)


# ---------------------------------------------------------------------------------------------
# One run


def spec_of(framework: str, mode: str, args: argparse.Namespace, root: Path, out: Path, **extra: Any) -> dict:
    """A peer run's spec (peers_child.peer reads it)."""
    return {"method": args.method, "framework": framework, "mode": mode, "weights": str(root / "weights"),
            "data": str(root / f"peer_{'grpo' if args.method == 'grpo' else 'dpo'}"), "out": str(out), "threads": args.threads,
            "steps": args.steps, "micro_batch": args.micro_batch, "accum": args.accum, "max_length": args.max_length,
            "device": args.device, "precision": args.precision, "attn": args.attn, **extra}


def run_grpo(framework: str, repeat: int, args: argparse.Namespace, root: Path, env: dict[str, str]) -> dict:
    """One GRPO run: its step lines (elapsed_s, generation_s, reward, completion_tokens) and the prompts it scored."""
    out = root / f"{framework}_grpo_{repeat}"
    out.mkdir()
    env = {**env, "PEERS_PROMPTS": str(out / PROMPTS)}
    if framework in ("ours", "ours_padded"):
        cmd = [sys.executable, "-m", "finetune.launch", *grpo_overrides(args, root), f"hydra.run.dir={out}",
               *(["data.padding_free=false"] if framework == "ours_padded" else [])]
        steps_file = out / "metrics.jsonl"
    else:  # TRL's micro-batch counts completions
        spec = spec_of(framework, "grpo", args, root, out, micro_batch=args.micro_batch * args.generations,
                       generations=args.generations, completion_tokens=args.completion_tokens)
        cmd, steps_file = bp.child(spec), out / "steps.jsonl"
    result = bp.timed(cmd, out, steps_file, env, args.steps, {"framework": framework, "mode": "grpo", "repeat": repeat})
    if "steps" in result:
        keys = ("step", "elapsed_s", "generation_s", "reward", "completion_tokens")
        result["steps"] = [{k: r[k] for k in keys} for r in result["steps"]]
        result["prompts"] = [p for line in (out / PROMPTS).read_text().splitlines() for p in json.loads(line)]
    return result


def run_dpo(framework: str, reference: str, repeat: int, args: argparse.Namespace, root: Path, env: dict[str, str]) -> dict:
    """One DPO run: its step lines (elapsed_s, non-pad tokens, loss)."""
    out = root / f"{framework}_{reference}_{repeat}"
    out.mkdir()
    if framework in ("ours", "ours_padded"):
        cmd = [sys.executable, "-m", "finetune.launch", *dpo_overrides(args, root, reference), f"hydra.run.dir={out}",
               *(["data.padding_free=false"] if framework == "ours_padded" else [])]
        steps_file = out / "metrics.jsonl"
    else:
        cmd, steps_file = bp.child(spec_of(framework, reference, args, root, out, beta=BETA)), out / "steps.jsonl"
    result = bp.timed(cmd, out, steps_file, env, args.steps, {"framework": framework, "mode": reference, "repeat": repeat})
    if framework in ("ours", "ours_padded") and "steps" in result:
        result["steps"] = bp.our_lines(result["steps"])
    return result


# ---------------------------------------------------------------------------------------------
# Results -> numbers -> the tables (pure)


def make_steady(steps: list[dict], skip: int = bp.STEADY_AFTER) -> dict[str, float]:
    """A GRPO run's steady state: medians over the steps after the first `skip` (all where there are no more) of the
    step's seconds, its rollout's and the rest (training); steps/s is one over the median step."""
    ends = [s["elapsed_s"] for s in steps]
    seconds = [b - a for a, b in zip([0.0, *ends], ends)]
    keep = slice(skip, None) if len(steps) > skip else slice(None)
    step, rollout = statistics.median(seconds[keep]), statistics.median(s["generation_s"] for s in steps[keep])
    training = statistics.median(t - s["generation_s"] for s, t in zip(steps[keep], seconds[keep]))
    return {"steps_per_s": 1 / step, "step_s": step, "rollout_s": rollout, "training_s": training}


def last_half(steps: list[dict]) -> float:
    """The mean reward over the last half of a run's steps (the middle one left out of an odd count)."""
    return statistics.mean(s["reward"] for s in steps[(len(steps) + 1) // 2:] or steps)


def standard_error(steps: list[dict]) -> float:
    """The standard error of `last_half`: its steps' rewards' sample std over the square root of their count."""
    half = [s["reward"] for s in steps[(len(steps) + 1) // 2:]]
    return statistics.stdev(half) / len(half) ** 0.5 if len(half) > 1 else 0.0


def grpo_table(runs: list[dict]) -> str:
    """One row per framework: steps/s and others' load of each repeat; then the best of the repeats (steps/s, the
    step's, rollout's and training's medians, first step, wall), the largest peak RSS, the mean completion length,
    and the best steps/s over TRL's."""
    done = bp.finished(runs, GRPO)
    best = {key: max(make_steady(r["steps"])["steps_per_s"] for r in rows) for key, rows in done.items()}
    lines = ["| framework | steps/s (each repeat) | others' load | step s | rollout s | training s | first step s | wall s "
             "| peak RSS MiB | completion tokens | vs TRL |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for key in bp.order(runs, GRPO):
        name = GRPO.names[key[0]]
        ok = done.get(key)
        if not ok:
            lines.append(f"| {name} | failed: {next(r['error'] for r in runs if (r['framework'], r['mode']) == key)} ||||||||||")
            continue
        each = [make_steady(r["steps"]) for r in ok]
        base = best.get(("trl", "grpo"))
        rates = " / ".join(f"{e['steps_per_s']:.3f}" for e in each)
        load = " / ".join("-" if r["others"] is None else f"{r['others']:.2f}" for r in ok)
        ratio = f"{best[key] / base:.2f}x" if base else "-"
        lines.append(f"| {name} | {rates} | {load} | "
                     f"{min(e['step_s'] for e in each):.3f} | {min(e['rollout_s'] for e in each):.3f} | "
                     f"{min(e['training_s'] for e in each):.3f} | {min(r['first_step_s'] for r in ok):.1f} | "
                     f"{min(r['wall_s'] for r in ok):.1f} | {max(r['rss_mib'] for r in ok):,.0f} | "
                     f"{statistics.mean(s['completion_tokens'] for r in ok for s in r['steps']):.1f} | "
                     f"{ratio} |")
    return "\n".join(lines) + "\n"


def reward_table(runs: list[dict], buckets: int = 6) -> str:
    """The reward curves: the mean reward of each run over `buckets` equal spans of steps, and over the last half."""
    done = [r for rows in bp.finished(runs, GRPO).values() for r in rows]
    if not done:
        return ""
    n = len(done[0]["steps"])
    size = max(1, -(-n // buckets))
    spans = [(a, min(a + size, n)) for a in range(0, n, size)]
    lines = ["| steps | " + " | ".join(f"{GRPO.names[r['framework']]} #{r['repeat']}" for r in done) + " |",
             "|---|" + "---:|" * len(done)]
    for a, b in spans:
        lines.append(f"| {a + 1}-{b} | " + " | ".join(f"{statistics.mean(s['reward'] for s in r['steps'][a:b]):.3f}" for r in done) + " |")
    lines.append(f"| last half ({(n + 1) // 2 + 1}-{n}) | " + " | ".join(f"{last_half(r['steps']):.3f}" for r in done) + " |")
    return "\n".join(lines) + "\n"


def scored_steps(prompts: list[str], expected: dict, generations: int) -> list[list[str]]:
    """The prompts a run's reward was given (each completion's, G adjacent a prompt), one per group, cut into steps
    as the prepared ones are, special tokens removed (our reward sees them decoded without; TRL's, as in its dataset)."""
    groups = []
    for p in prompts[::generations]:
        for special in expected["specials"]:
            p = p.replace(special, "")
        groups.append(p)
    sizes = [len(step) for step in expected["prompts"]]
    starts = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
    return [groups[a:b] for a, b in zip(starts, starts[1:])] + ([groups[starts[-1]:]] if groups[starts[-1]:] else [])


def grpo_fairness(runs: list[dict], expected: dict, args: argparse.Namespace) -> tuple[str, bool]:
    """The fairness lines: the same prompts at every step in every run; the reward curves within `reward_tol` over
    the last half (each framework's mean over its repeats); and whether both held."""
    done = bp.finished(runs, GRPO)
    off = [(r["framework"], r["repeat"]) for rows in done.values() for r in rows
           if scored_steps(r["prompts"], expected, args.generations) != expected["prompts"]]
    prompts_ok = not off
    halves = {f: statistics.mean(last_half(r["steps"]) for r in rows) for (f, _), rows in done.items()}
    tokens = {f: statistics.mean(s["completion_tokens"] for r in rows for s in r["steps"]) for (f, _), rows in done.items()}
    lines = [f"{'OK' if prompts_ok else 'FAIL'}: prompts, each step's as every run's reward was given them against the prepared "
             f"steps ({sum(map(len, expected['prompts'])):,} prompts x G {args.generations}): "
             + ("equal in every run" if prompts_ok else "different in " + ", ".join(f"{GRPO.names[f]} #{n}" for f, n in off))]
    reward_ok = True
    if "ours" in halves and "trl" in halves:
        diff = abs(halves["trl"] - halves["ours"])
        reward_ok = diff <= args.reward_tol
        noise = 3 * sum(standard_error(rows[0]["steps"]) ** 2 for rows in done.values()) ** 0.5
        lines.append(f"{'OK' if reward_ok else 'FAIL'}: reward over the last half of the steps, the mean of the repeats: ours "
                     f"{halves['ours']:.3f}, TRL {halves['trl']:.3f}, |difference| {diff:.3f} (limit {args.reward_tol:g}; the "
                     f"steps' noise, 3 standard errors of the difference: {noise:.3f}); completion tokens: ours "
                     f"{tokens['ours']:.1f}, TRL {tokens['trl']:.1f} a completion on average")
    lines.append("Not equal, and not comparable step by step: the sampled completions (each framework draws from its own "
                 "random stream), hence the rewards, advantages and losses.")
    return "\n".join(lines) + "\n", prompts_ok and reward_ok


def report(runs: list[dict], expected: Any, args: argparse.Namespace) -> tuple[str, bool]:
    """The Markdown of a GRPO or DPO race: a caption, the table(s), the fairness section; and whether it passed."""
    model = (f"Llama (random init, hidden {args.hidden}, {args.layers} layers, {args.precision}, {args.attn}, on {args.device}), "
             f"{args.steps} steps, {args.threads} threads, {os.cpu_count()} CPU cores; {args.repeats} repeat(s), each run a fresh "
             "process, the order reversed every other repeat; others' load: cores kept busy by other processes during the "
             "run (0 on a quiet machine); the other columns are the best of the repeats (a busy machine only slows a run); "
             "first step: process start to the end of the first optimizer step; wall: the whole process, final save "
             "included; peak RSS: the largest process (ours: the rank).")
    if args.method == "grpo":
        fair, ok = grpo_fairness(runs, expected, args)
        caption = (f"GRPO: {args.rows:,} quickstart prompts, {args.micro_batch * args.accum} a step (micro batch "
                   f"{args.micro_batch} x {args.accum}) x G {args.generations} completions of at most "
                   f"{args.completion_tokens} tokens, one update per rollout, TRL's defaults (loss_type dapo, scale_rewards "
                   "group, beta 0, temperature 1, top_p 1, top_k 0), reward: difflib similarity to the answer; " + model +
                   f" steps/s: one over the median step after step {bp.STEADY_AFTER}; rollout: sampling and scoring (ours: "
                   "generation_s; TRL: _generate_and_score_completions); training: the rest of the step.\n\n")
        text = (caption + grpo_table(runs) + "\nMean reward per span of steps (each run):\n\n" + reward_table(runs)
                + "\nFairness: the same prompts in the same order, initial weights, reward function, loss and schedule.\n\n" + fair)
        rate = "steps/s"
    else:
        fair, ok = bp.fairness_text(bp.fairness(runs, expected, DPO), args.loss_tol, DPO)
        caption = (f"DPO: {args.rows:,} synthetic pairs of at most {args.max_length} tokens a row, micro batch {args.micro_batch} "
                   f"pairs x accumulation {args.accum}, sigmoid loss, beta {BETA}; mode: the reference (precomputed: one pass "
                   "before the first step in both; live: a frozen copy in both); " + model + " tokens/s: non-pad tokens of both "
                   f"rows of each pair, median over the steps after step {bp.STEADY_AFTER}; step ms, the same median.\n\n")
        text = (caption + bp.table(runs, DPO) + "\nFairness: the same token ids, pairs, batches, initial weights, reference and "
                "schedule.\n\n" + fair)
        rate = "tokens/s"
    return text + bp.notes(runs, GRPO if args.method == "grpo" else DPO, rate), ok and not any("error" in r for r in runs)
