"""Sampling completions for the online methods (finetune.methods.online): seeded, through the engine's generate, vLLM's,
or a generator of the sampler's own; cut at the EOS token or at the template's end-of-turn text."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from finetune.data.images import IN_BATCH, never_written, pictures_of, seen

if TYPE_CHECKING:
    import torch


def sample(engine: Any, prompts: list[list[int]], cfg: Any, tokenizer: Any, seed: tuple[int, ...],
           vllm: Any = None, images: list[list[Any]] | None = None, private: bool = False, stop: str | None = None) -> list[list[int]]:
    """G = cfg.generations (an OnlineConfig) sampled completions of each prompt (adjacent), each cut after its first EOS (kept: it is labelled), through
    the engine (eval mode, its precision; generation synced across ranks where parameters are gathered), or through
    vLLM's engine (a finetune.methods.vllm_rollout.VllmSampler, synced with the policy). `images`: each prompt's (a
    vision-language model's), shown to the sampler: each prompt is then sampled as G rows of its own. `private`: the
    draws come from a generator of their own (`GumbelMax`), not torch's global one, which a training step running
    meanwhile in another thread draws its dropout from (method.async_generation); each prompt is then G rows. `stop`: the
    text that ends a turn where the EOS token does not (a chat template's, method.tools): each completion is cut after it."""
    import torch

    from finetune.data.batches import left_padded

    if vllm is not None:
        return [cut(row, tokenizer.eos_token_id) for row in vllm.sample(prompts, cfg, hash(seed) % 2**63)]
    g, rows, pictures = cfg.generations, len(prompts) * cfg.generations, pictures_of(tokenizer)
    showing, shown = private, []
    if private:
        prompts, images = [p for p in prompts for _ in range(g)], [im for im in (images or [[] for _ in prompts]) for _ in range(g)]
        g = 1
    if pictures is not None:  # each prompt G times with its images (a processor's image inputs do not repeat along the
        # rows); a layout whose ranks run the vision tower together: one more row, a blank image's, where none shows one
        repeated, shown = pictures.blank_row([p for p in prompts for _ in range(g)],
                                             [im for im in (images or [[] for _ in prompts]) for _ in range(g)])
        showing = showing or any(shown)
        if showing:
            prompts = repeated
    batch = left_padded(prompts, tokenizer.pad_token_id)
    if any(shown):
        batch |= {IN_BATCH + k: v for k, v in pictures.batch(shown, batch["input_ids"]).items()}
    width = batch["input_ids"].shape[1]
    never = never_written(tokenizer) | ({"stop_strings": [stop], "tokenizer": tokenizer} if stop else {})
    model = engine.generation_model
    device = next(model.parameters()).device
    devices = [device] if device.type == "cuda" else []

    def generate(_: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        if private:  # greedy over Gumbel-perturbed logits: a sample, drawn from the generator's stream only
            drawn = torch.Generator(device=device).manual_seed(hash(seed) % 2**63)
            return model.generate(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], do_sample=False,
                                  logits_processor=[GumbelMax(cfg.temperature, cfg.top_p, drawn)], max_new_tokens=cfg.completion_tokens,
                                  pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, **seen(batch), **never)
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(hash(seed) % 2**63)
            return model.generate(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], do_sample=True,
                                  temperature=cfg.temperature, top_p=cfg.top_p, top_k=0, max_new_tokens=cfg.completion_tokens,
                                  num_return_sequences=1 if showing else g, pad_token_id=tokenizer.pad_token_id,
                                  eos_token_id=tokenizer.eos_token_id, synced_gpus=engine.lockstep, **seen(batch), **never)

    with torch.no_grad():
        out = engine.inference(generate, batch)
    rows_out = [cut(row, tokenizer.eos_token_id) for row in out[:rows, width:].tolist()]  # without a blank image's row
    return [cut_text(row, tokenizer, stop) for row in rows_out] if stop else rows_out


class GumbelMax:
    """A logits processor that makes greedy decoding draw a sample: the logits over `temperature`, nucleus-filtered
    (transformers' TopPLogitsWarper), plus Gumbel noise from `generator`; their argmax is distributed as softmax(logits /
    temperature) restricted to the nucleus (the Gumbel-max trick), and no draw touches torch's global generator."""

    def __init__(self, temperature: float, top_p: float, generator: Any) -> None:
        self.temperature, self.top_p, self.generator = temperature, top_p, generator

    def __call__(self, input_ids: Any, scores: torch.Tensor) -> torch.Tensor:
        import torch
        from transformers import TopPLogitsWarper

        scores = scores.float() / self.temperature
        if self.top_p < 1:
            scores = TopPLogitsWarper(self.top_p)(input_ids, scores)
        u = torch.rand(scores.shape, generator=self.generator, device=scores.device).clamp_(1e-20, 1 - 1e-7)
        return scores - torch.log(-torch.log(u))


def cut_text(row: list[int], tokenizer: Any, stop: str) -> list[int]:
    """A sampled row up to the token that completes `stop`, which is kept (what generate padded after it dropped)."""
    if stop not in tokenizer.decode(row):
        return row
    lo, hi = 1, len(row)  # the shortest prefix whose text holds it
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if stop in tokenizer.decode(row[:mid]) else (mid + 1, hi)
    return row[:lo]


def cut(row: list[int], eos: int) -> list[int]:
    """A sampled row up to its first EOS, which is kept (the padding after it dropped)."""
    return row[: row.index(eos) + 1] if eos in row else row



def spoken(tokenizer: Any, piece: list[int], stop: str | None) -> str:
    """What a sampled turn says: its text, without special tokens or the text that ended it."""
    text = tokenizer.decode(piece, skip_special_tokens=True)
    return text[: text.index(stop)] if stop and stop in text else text


def ends(piece: list[int], tokenizer: Any, stop: str | None) -> bool:
    """The sampled turn ended (its EOS, or the template's end-of-turn text), not cut at completion_tokens."""
    return stop in tokenizer.decode(piece) if stop else tokenizer.eos_token_id in piece
