"""Evaluation: loss over the held-out set, and exact match of greedy generations."""

from __future__ import annotations

from typing import Any

import torch

from finetune.data import Example, eval_batches, shard
from finetune.dist import Dist


def evaluate(engine: Any, objective: Any, examples: list[Example], *, dist: Dist, tokenizer: Any, batch_size: int,
             exact_match_samples: int = 0, max_new_tokens: int = 64) -> dict[str, float]:
    """Eval loss (mean over every response token of the eval set, all ranks) and optionally exact match."""
    mine = shard(examples, dist.rank, dist.world_size)
    loss_sum = count = 0.0
    for batch in eval_batches(mine, batch_size, tokenizer.pad_token_id):
        loss_sum += engine.eval_loss(batch, objective)
        count += objective.count(batch)
    loss_sum, count = dist.sum(loss_sum, count)
    out = {"eval_loss": loss_sum / max(count, 1)}
    if exact_match_samples:
        scored = shard(examples[:exact_match_samples], dist.rank, dist.world_size)
        correct, total = dist.sum(exact_match(engine.generation_model, tokenizer, scored, batch_size=batch_size,
                                              max_new_tokens=max_new_tokens, device=dist.device), len(scored))
        out["exact_match"] = correct / max(total, 1)
    return out


@torch.no_grad()
def exact_match(model: Any, tokenizer: Any, examples: list[Example], *, batch_size: int, max_new_tokens: int,
                device: torch.device) -> int:
    """How many greedy continuations of the prompt equal the reference response (stripped)."""
    model.eval()
    correct = 0
    for i in range(0, len(examples), batch_size):
        chunk = examples[i : i + batch_size]
        width = max(e.prompt_len for e in chunk)
        ids = torch.full((len(chunk), width), tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, e in enumerate(chunk):  # left padding: every prompt ends where generation starts
            ids[row, width - e.prompt_len :] = torch.tensor(e.input_ids[: e.prompt_len])
            mask[row, width - e.prompt_len :] = 1
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
        texts = tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
        correct += sum(text.strip() == e.reference.strip() for text, e in zip(texts, chunk))
    return correct
