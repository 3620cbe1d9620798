"""Evaluation: loss over the held-out set, exact match of greedy generations, and generation samples (each prompt,
its reference and the model's output) for the logs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from finetune.config import TrainConfig
from finetune.data.batches import collate, eval_batches, for_generation, left_padded, shard
from finetune.data.images import never_written, pictures_of
from finetune.data.tokenize import Example
from finetune.rank.dist import Dist
from finetune.rank.engine.base import Engine
from finetune.rank.engine.common import add_metrics


def evaluate(engine: Engine, objective: Any, examples: list[Any], *, dist: Dist, tokenizer: Any, batch_size: int,
             exact_match_samples: int = 0, sample_prompts: int = 0, max_new_tokens: int = 64) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """Eval loss (mean over every loss unit of the eval set, all ranks), the objective's own
    metrics (DPO: eval_rewards/accuracy...) and optionally exact match (DPO: of the chosen response).

    Returns the metrics and, with `sample_prompts`, the first that many eval prompts with their reference and the greedy
    output (on the main rank; [] on the others): one generation serves both, sharded over the data-parallel ranks."""
    mine = shard(examples, engine.dp_rank, engine.dp_size)
    owner = int(engine.owner)  # tp/pp: one rank per model replica counts
    loss_sum = count = 0.0
    metrics: dict[str, float] = {}
    for batch in eval_batches(mine, batch_size, tokenizer.pad_token_id, pictures_of(tokenizer)):
        loss, sums = engine.inference(objective, batch)
        loss_sum += owner * float(loss)
        add_metrics(metrics, {k: owner * v for k, v in sums.items()})
        count += owner * objective.count(batch)
    for _ in range(lockstep_extra(engine, len(examples), batch_size)):
        engine.inference(objective, collate(examples[:1], tokenizer.pad_token_id, pictures=pictures_of(tokenizer)))  # ZeRO-3: match the other ranks' forwards
    names = getattr(objective, "eval_metrics", objective.metrics)  # GRPO's rollout metrics have no evaluation value
    loss_sum, count, *values = dist.sum(loss_sum, count, *(metrics.get(k, 0.0) for k in names))
    out = {"eval_loss": loss_sum / max(count, 1)} | {f"eval_{k}": v / max(count, 1) for k, v in zip(names, values)}
    examples = for_generation(examples)  # none for text rows: there is no prompt to continue
    wanted = min(max(exact_match_samples, sample_prompts), len(examples))
    if not wanted or engine.generation_model is None:  # pipeline stages: exact_match_of_export, after training
        return out, []
    indices = shard(range(wanted), engine.dp_rank, engine.dp_size)  # this rank's share, by position in the eval set
    scored = [examples[i] for i in indices]
    extra = lockstep_extra(engine, wanted, batch_size)
    texts = generate(engine.generation_model, tokenizer, scored + examples[:1] * extra * batch_size, batch_size=batch_size,
                     max_new_tokens=max_new_tokens, device=dist.device, synced=engine.lockstep)[: len(scored)]
    if exact_match_samples:
        hits = [text.strip() == e.reference.strip() for i, text, e in zip(indices, texts, scored) if i < exact_match_samples]
        correct, total = dist.sum(owner * sum(hits), owner * len(hits))
        out["exact_match"] = correct / max(total, 1)
    samples: list[dict[str, Any]] = []
    if sample_prompts:
        shares = dist.gather([(i, text) for i, text in zip(indices, texts)] if owner else [])  # one replica's ranks answer alike
        outputs = dict(pair for share in shares for pair in share)
        samples = [{"index": i, "prompt": tokenizer.decode(examples[i].input_ids[: examples[i].prompt_len]),
                    "reference": examples[i].reference, "output": outputs[i]} for i in range(min(sample_prompts, wanted))]
    return out, samples if dist.is_main else []


def lockstep_extra(engine: Engine, total: int, batch_size: int) -> int:
    """Batches this rank must add so every rank runs as many forwards (engines with `lockstep`)."""
    if not engine.lockstep:
        return 0
    most = -(-total // engine.dp_size)  # the largest shard
    return -(-most // batch_size) - -(-len(shard(range(total), engine.dp_rank, engine.dp_size)) // batch_size)


def exact_match_of_export(path: Path, examples: list[Any], cfg: TrainConfig, device: torch.device) -> float:
    """Exact match of the exported Hugging Face model at `path`, loaded whole on this one process:
    how pipeline parallel runs measure it after training, since no rank holds a model that can generate."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"exact match: pipeline stages cannot generate, so this rank evaluates {path} on one process", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).to(device)
    scored = for_generation(examples)[: cfg.exact_match_samples]
    correct = exact_match(model, tokenizer, scored, batch_size=cfg.eval_batch_size, max_new_tokens=cfg.max_new_tokens, device=device)
    return correct / max(len(scored), 1)


def exact_match(model: Any, tokenizer: Any, examples: list[Example], *, batch_size: int, max_new_tokens: int,
                device: torch.device, synced: bool = False, count: int | None = None) -> int:
    """How many greedy continuations of the prompt equal the reference response (stripped).

    Args:
        synced: ZeRO-3 across ranks: every rank keeps generating until all are done.
        count: score only the first `count` examples (the rest keep ranks in lockstep).
    """
    texts = generate(model, tokenizer, examples, batch_size=batch_size, max_new_tokens=max_new_tokens, device=device, synced=synced)
    count = len(examples) if count is None else count
    return sum(text.strip() == e.reference.strip() for text, e in zip(texts[:count], examples))


@torch.no_grad()
def generate(model: Any, tokenizer: Any, examples: list[Example], *, batch_size: int, max_new_tokens: int,
             device: torch.device, synced: bool = False) -> list[str]:
    """The greedy continuation of each example's prompt, decoded without special tokens.

    Args:
        synced: ZeRO-3 across ranks: every rank keeps generating until all are done.
    """
    model.eval()
    texts: list[str] = []
    pictures = pictures_of(tokenizer)
    never = never_written(tokenizer)
    for i in range(0, len(examples), batch_size):
        rows = examples[i : i + batch_size]
        prompts, shown = [e.input_ids[: e.prompt_len] for e in rows], [list(e.images) for e in rows]
        if pictures is not None:  # a layout whose ranks run the vision tower together: a blank image's row where none shows one
            prompts, shown = pictures.blank_row(prompts, shown)
        batch = left_padded(prompts, tokenizer.pad_token_id)
        ids, mask, width = batch["input_ids"], batch["attention_mask"], batch["input_ids"].shape[1]
        seen = {k: v.to(device) for k, v in pictures.batch(shown, ids).items()} \
            if pictures is not None and any(shown) else {}  # the prompts' images, as the model reads them
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                             synced_gpus=synced, **seen, **never)
        texts += tokenizer.batch_decode(out[: len(rows), width:], skip_special_tokens=True)
    return texts
