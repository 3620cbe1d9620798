"""A peer's run, in a process of its own: `benchmark_peers.py --child SPEC` trains the prepared job with transformers'
Trainer, TRL's SFTTrainer, DPOTrainer or GRPOTrainer, writing one line per optimizer step to OUT/steps.jsonl, then saves
the final weights, as ours does. benchmark_peers.py (SFT) and peers_rl.py (GRPO, DPO) say what each race makes equal.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any, Callable

from benchmark_peers import BETAS, EPS, LR, MAX_GRAD_NORM, SEED
from peers_rl import reward


def peer(spec: dict) -> int:
    """Train with transformers' Trainer ("hf"), TRL's SFTTrainer ("trl") or, with spec's method dpo, TRL's DPOTrainer on
    the prepared rows, in order, writing one line per optimizer step to OUT/steps.jsonl; then save the final weights, as
    ours does. Method grpo: `peer_grpo`."""
    import torch

    torch.set_num_threads(spec["threads"])
    if spec.get("method") == "grpo":
        return peer_grpo(spec)
    from datasets import load_from_disk
    from torch.utils.data import SequentialSampler
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = Path(spec["out"])
    packed = spec["mode"] == "packed"
    net = AutoModelForCausalLM.from_pretrained(spec["weights"], attn_implementation=spec["attn"], dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(spec["weights"])
    data = load_from_disk(spec["data"])
    common = trainer_args(spec)
    if spec.get("method") == "dpo":
        base, kwargs = dpo_trainer(spec, common, tokenizer)
    elif spec["framework"] == "hf":
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
    step = {"tokens": 0, "loss": 0.0}

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

    def take() -> dict:
        line = dict(step)
        step.update(tokens=0, loss=0.0)
        return line

    trainer = Sequential(model=net, train_dataset=data, callbacks=[step_writer(out, take)], **kwargs)
    trainer.train()
    trainer.save_model(str(out / "final"))
    return 0


def step_writer(out: Path, take: Callable[[], dict]) -> Any:
    """A TrainerCallback that writes a line per optimizer step to OUT/steps.jsonl: the step's end in seconds from the
    start of training, and `take()`, the step's own numbers (which it resets)."""
    from transformers import TrainerCallback

    class Steps(TrainerCallback):
        start = 0.0

        def on_train_begin(self, args, state, control, **kw):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            line = {"kind": "train", "step": state.global_step, "elapsed_s": time.perf_counter() - self.start, **take()}
            with open(out / "steps.jsonl", "a") as f:
                f.write(json.dumps(line) + "\n")

    return Steps()


def trainer_args(spec: dict) -> dict:
    """The TrainingArguments every peer's run shares: our optimizer, schedule, batch, seed and precision; no
    checkpoints, no reports, no progress bar, a log line every step."""
    return {"output_dir": spec["out"], "max_steps": spec["steps"], "per_device_train_batch_size": spec["micro_batch"],
            "gradient_accumulation_steps": spec["accum"], "learning_rate": LR, "lr_scheduler_type": "constant",
            "warmup_steps": 0, "weight_decay": 0.0, "adam_beta1": BETAS[0], "adam_beta2": BETAS[1], "adam_epsilon": EPS,
            "max_grad_norm": MAX_GRAD_NORM, "optim": "adamw_torch_fused", "seed": SEED,
            "bf16": spec["precision"] == "bf16", "fp16": False, "use_cpu": spec["device"] == "cpu", "dataloader_num_workers": 0,
            "logging_steps": 1, "save_strategy": "no", "report_to": "none", "disable_tqdm": True}


def dpo_trainer(spec: dict, common: dict, tokenizer: Any) -> tuple[type, dict]:
    """TRL's DPOTrainer on our token ids (its dataset preparation skipped: the rows come tokenized) and its kwargs:
    sigmoid loss, our beta, the reference as `spec["mode"]` says, nothing cut, no gradient checkpointing."""
    import datasets
    from trl import DPOConfig, DPOTrainer

    # TRL keeps its precomputed reference log-probs in a cache file beside the dataset, keyed by the dataset and the
    # weights: a second run would read the first one's back instead of computing them (ours computes them in every run)
    datasets.disable_caching()

    class Tokenized(DPOTrainer):
        def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
            return dataset

    config = DPOConfig(**common, gradient_checkpointing=False, max_length=None, beta=spec["beta"], loss_type=["sigmoid"],
                       precompute_ref_log_probs=spec["mode"] == "precomputed")
    return Tokenized, {"args": config, "processing_class": tokenizer}


def peer_grpo(spec: dict) -> int:
    """TRL's GRPOTrainer on the prepared prompts, in order, with `reward`; one line per optimizer step (its time, its
    rollout's, mean reward and completion length) to OUT/steps.jsonl; then the final weights saved, as ours does."""
    import torch
    from datasets import load_from_disk
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    out = Path(spec["out"])
    net = AutoModelForCausalLM.from_pretrained(spec["weights"], attn_implementation=spec["attn"], dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(spec["weights"])
    config = GRPOConfig(**trainer_args(spec), gradient_checkpointing=False, num_generations=spec["generations"],
                        max_completion_length=spec["completion_tokens"], shuffle_dataset=False, loss_type="dapo",
                        scale_rewards="group", beta=0.0, epsilon=0.2, num_iterations=1, mask_truncated_completions=False,
                        temperature=1.0, top_p=1.0, top_k=0)
    step: dict[str, Any] = {"generation_s": 0.0, "reward": [], "completion_tokens": []}

    class Timed(GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            tic = time.perf_counter()
            batch = super()._generate_and_score_completions(inputs)
            step["generation_s"] += time.perf_counter() - tic
            step["reward"].append(self._metrics["train"]["reward"][-1])
            step["completion_tokens"].append(float(batch["completion_mask"].sum(1).float().mean()))
            return batch

    def take() -> dict:
        line = {"generation_s": step["generation_s"], "reward": statistics.mean(step["reward"]),
                "completion_tokens": statistics.mean(step["completion_tokens"])}
        step.update(generation_s=0.0, reward=[], completion_tokens=[])
        return line

    trainer = Timed(model=net, reward_funcs=[reward], args=config, train_dataset=load_from_disk(spec["data"]),
                    processing_class=tokenizer, callbacks=[step_writer(out, take)])
    trainer.train()
    trainer.save_model(str(out / "final"))
    return 0
