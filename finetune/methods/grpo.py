"""Group Relative Policy Optimization (method=grpo): Shao et al., "DeepSeekMath: Pushing the Limits of Mathematical
Reasoning in Open Language Models", 2024 (arXiv:2402.03300), section 4.1; online reinforcement learning from rewards.

Each step, for every prompt q of the batch (a row of any SFT form: its conversation without the last response) the
current policy samples G = `method.generations` completions o_1..o_G (`method.temperature`, `method.top_p`, at most
`method.completion_tokens` tokens, seeded by (train.seed, step, rank): a resumed run samples the same ones). The
rewards (finetune.methods.rewards: exact match against the row's own response, a format check, a length penalty, a user's
function, a reward model) score each completion, r_i = sum_k w_k R_k(q, o_i), and its advantage is its reward's
z-score within its group (eq. 3 of the paper's outcome supervision, the same for every token of o_i):

    A_i = (r_i - mean(r_1..r_G)) / (std(r_1..r_G) + 1e-4)

The loss is the negated clipped surrogate with a per-token KL penalty (eq. 3):

    J = 1/G sum_i 1/|o_i| sum_t [ min(rho_it A_i, clip(rho_it, 1 - eps, 1 + eps) A_i) - beta D_KL,it ]
    rho_it = pi(o_it | q, o_i<t) / pi_old(o_it | q, o_i<t)
    D_KL,it = pi_ref / pi - log(pi_ref / pi) - 1          (eq. 4: Schulman's unbiased estimator, >= 0)

with eps = `method.epsilon` and beta = `method.beta` (default 0: no KL and no reference model, as TRL now does;
with beta > 0 the reference is method.reference=live, a frozen copy of the initial model, or adapter_disabled
under peft). With one optimizer step per rollout (method.updates_per_rollout=1) pi_old is the policy itself (rho = 1 in
value; its gradient is A_i grad log pi); with mu > 1 the rollout's completions train mu steps against the log-probs they
were sampled with (`old_logps`, kept by `rollout`), and the clip acts from the second.

The loss averages each completion's tokens, then sums over completions; the loop divides by the completions of the
global batch (so every prompt's group weighs the same). What later papers changed is each an option (`grpo_loss`,
`group_advantages`; docs/grpo.md names the published recipe of each combination): the tokens' weighing
(`method.loss_type`: bnpo, Dr. GRPO's constant, DAPO's token-level mean), the advantage's scale (`method.scale_rewards`:
the batch's std, or none as in Dr. GRPO), DAPO's clip-higher (`method.epsilon_high`), GSPO's sequence-level ratio
(`method.importance_sampling_level`), DAPO's masking of truncated completions and its soft overlong reward. Generation runs through the engine (`generation_model`,
synced across ranks where parameters are gathered collectively: FSDP2, ZeRO-3) before the step, or through a vLLM
engine on each rank with method.vllm (finetune.methods.vllm_rollout, the policy's weights loaded into it first); its
time is reported apart (`generation_s`). Evaluation scores the rows' own responses (their per-token cross-entropy as
`eval_loss`) and, at the end, exact match of greedy completions, as SFT does.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, fields
from enum import Enum
from typing import TYPE_CHECKING, Any

from finetune.config import (METHOD_NAME, POSITIVE, SOME_NAMES, TEXT, Accepts, Config, ConfigError, DataConfig, DataFormat, Logits, Spelled,
                             MethodConfig, Reference, at_least, checked, in_range, unused)
from finetune.data.images import IN_BATCH, SHOWN, never_written, pictures_of, seen
from finetune.data.tokenize import IGNORE, Encoded, Example
from finetune.methods.base import CAUSAL_LM, Output, Sampling
from finetune.methods.sft import METHOD as SFT_METHOD

if TYPE_CHECKING:
    import torch

class GrpoLoss(str, Enum, metaclass=Spelled):
    grpo = "grpo"
    bnpo = "bnpo"
    dr_grpo = "dr_grpo"
    dapo = "dapo"


class RewardScale(str, Enum, metaclass=Spelled):
    group = "group"
    batch = "batch"
    none = "none"


class RatioLevel(str, Enum, metaclass=Spelled):
    token = "token"
    sequence = "sequence"


@dataclass
class GrpoConfig(MethodConfig):
    """method=grpo: online reinforcement learning from rewards (Group Relative Policy Optimization): `generations`
    completions sampled per prompt at each step, scored by `rewards`, the policy moved towards the better ones of each
    group."""

    name: str = checked(METHOD_NAME, "grpo")
    beta: float = checked(at_least(0), 0.0)
    """The weight of the per-token KL to the reference; 0: no KL term and no reference model (TRL's default since
    DAPO/Dr. GRPO)."""
    reference: Reference = Reference.precomputed
    """With beta > 0, where the reference log-probs come from: live (a frozen copy of the initial model) or
    adapter_disabled (with peft); precomputed cannot score completions sampled while training."""
    generations: int = checked(at_least(2), 8)
    """Completions sampled per prompt (the group G); each one's advantage is its reward's z-score in its group."""
    completion_tokens: int = checked(POSITIVE, 64)
    """The most tokens a sampled completion has (generation stops at the EOS token or here)."""
    temperature: float = checked(POSITIVE, 1.0)
    """The sampling temperature of the completions."""
    top_p: float = checked(in_range(0, 1), 1.0)
    """Nucleus sampling's probability mass (1: the whole distribution)."""
    epsilon: float = checked(in_range(0, 1, hi_open=True), 0.2)
    """The policy ratio's clip range [1 - epsilon, 1 + epsilon] (PPO's; DeepSeekMath's 0.2). It acts from a rollout's
    second update (method.updates_per_rollout > 1): the first trains at ratio 1."""
    epsilon_high: float | None = checked(POSITIVE, None)
    """The clip range's upper side, 1 + epsilon_high (DAPO's clip-higher: 0.28 beside epsilon 0.2, room for unlikely
    tokens to rise); null: epsilon."""
    loss_type: GrpoLoss = GrpoLoss.grpo
    """How the token terms are weighed: grpo (each completion's tokens averaged, every completion weighing the same:
    DeepSeekMath), bnpo (each micro-batch's tokens averaged), dr_grpo (each completion's tokens summed over
    completion_tokens, a constant: Dr. GRPO), dapo (every token of the global batch weighing the same: DAPO)."""
    scale_rewards: RewardScale = RewardScale.group
    """What an advantage, its reward minus its group's mean, is divided by: its group's reward std (group: DeepSeekMath),
    the global batch's (batch), or nothing (none: Dr. GRPO, whose paper shows the std favours groups of near-equal
    rewards)."""
    importance_sampling_level: RatioLevel = RatioLevel.token
    """token: each token's own policy ratio (PPO's); sequence: one ratio per completion, the geometric mean of its
    tokens' (GSPO, for mixture-of-experts policies whose token ratios are noisy; its paper clips with epsilon 3e-4 and
    epsilon_high 4e-4). Like the clip, it acts from a rollout's second update."""
    mask_truncated_completions: bool = False
    """Completions cut at completion_tokens before their EOS carry no loss (DAPO): a cut answer is not judged."""
    overlong_buffer: int | None = checked(POSITIVE, None)
    """The `overlong` reward's soft zone: a completion longer than completion_tokens - overlong_buffer tokens loses up to 1
    linearly, -1 at the limit (DAPO's soft overlong punishment)."""
    updates_per_rollout: int = checked(at_least(1), 1)
    """Optimizer steps on each rollout (mu; TRL's num_iterations): the completions sampled at step k train steps
    k .. k + mu - 1 against the log-probs they were sampled with (the clipped ratio); those steps' own prompts are not
    read. train.save_every must be a multiple of it (a checkpoint falls between rollouts)."""
    rewards: list[str] = checked(SOME_NAMES, factory=lambda: ["exact_match"])
    """The reward functions, summed with `reward_weights`: built-in exact_match (1 when the completion equals the row's
    response, stripped), similarity (partial credit: difflib's matched-character ratio with the response), format (1
    when the completion matches `format_pattern`), length (minus the completion's tokens over completion_tokens), overlong
    (0, then down to -1 over the last `overlong_buffer` tokens before completion_tokens: DAPO's), or a
    Python function `package.module:function` (finetune.methods.rewards says how it is called), or `reward:PATH`: a
    reward model this project trained (method=reward), scoring prompt + completion."""
    reward_weights: list[float] | None = checked(Accepts("a list of numbers", lambda v: len(v) > 0, ("[]",)), None)
    """One weight per entry of `rewards` (null: 1 each)."""
    format_pattern: str | None = checked(TEXT, None)
    """The regular expression the `format` reward matches each whole completion against (Python's re.fullmatch, DOTALL)."""
    vllm: bool = False
    """Sample the completions with vLLM (`pip install vllm`) instead of transformers' generate: an engine on each rank
    beside training (colocated), the policy's weights (gathered, any adapter merged in) loaded into it before each
    rollout."""
    vllm_memory: float = checked(in_range(0.05, 0.95), 0.3)
    """With vllm: the fraction of the GPU's memory vLLM takes for its weights and KV cache (its gpu_memory_utilization);
    training gets the rest."""


class Grpo:
    """The GRPO record (finetune.methods.base.Method)."""

    name = "grpo"
    config = GrpoConfig
    forms = (DataFormat.alpaca, DataFormat.chat, DataFormat.sharegpt, DataFormat.completion)
    unit = "prompt"
    columns = ("",)
    rows_per_example = 1  # x method.generations completions, each a row with gradients (`sampling`)
    no_grad_rows = 0
    unpacked = "method=grpo samples each prompt's completions as rows of their own"
    split_tokens = ("the GRPO loss averages each completion's tokens, and each rank holds a slice of them; use parallelism.cp=1 "
                    "(with checkpointing=full for long completions)")
    scalars = ()
    images = None  # its prompts' images: shown to the sampler, and to the policy with each completion
    attached = False
    model_class = CAUSAL_LM

    def check_row(self, row: dict[str, Any], data: DataConfig, where: str) -> None:
        SFT_METHOD.check_row(row, data, where)

    def encode(self, row: dict[str, Any], where: str, tokenizer: Any, data: DataConfig, chat: bool) -> Encoded:
        return SFT_METHOD.encode(row, where, tokenizer, data, chat)

    def join(self, rows: list[Example], scalars: dict[str, float]) -> Example:
        return rows[0]

    def settle(self, examples: list[Any], data: DataConfig, key: str) -> list[Any]:
        return examples

    def sampling(self, cfg: GrpoConfig) -> Sampling:
        return Sampling(cfg.generations, cfg.completion_tokens, "vllm" if cfg.vllm else "generate", cfg.vllm_memory if cfg.vllm else 0.0)

    def reference(self, cfg: GrpoConfig) -> Reference | None:
        return cfg.reference if cfg.beta > 0 else None

    def validate(self, cfg: Config) -> None:
        from finetune.methods import rewards

        m = cfg.method
        if m.beta == 0:
            unused(m, "method", tuple(f.name for f in fields(m) if f.name != "reference"),
                   "with method=grpo and method.beta=0 (no KL term, no reference)")
        elif m.reference == Reference.precomputed:
            raise ConfigError("method.reference=precomputed cannot score GRPO's completions, which are sampled while training: use "
                              "method.reference=live (or adapter_disabled with peft), or method.beta=0 (no KL term)")
        if cfg.data.format == DataFormat.text:
            raise ConfigError("method=grpo samples a response to each row's prompt, and data.format=text rows have none: use alpaca, "
                              "chat, sharegpt or completion rows")
        if cfg.parallelism.pp > 1:
            raise ConfigError(f"method=grpo with parallelism.pp={cfg.parallelism.pp} is not supported: pipeline stages cannot "
                              "generate the completions (no rank holds the whole model); use fsdp, zero or tp")
        mu = m.updates_per_rollout
        if mu == 1:
            ratio = ("epsilon", "epsilon_high", "importance_sampling_level")
            unused(m, "method", tuple(f.name for f in fields(m) if f.name not in ratio),
                   "with method.updates_per_rollout=1: each rollout trains once, at policy ratio 1, where neither the clip "
                   "nor the ratio's level acts (set method.updates_per_rollout=2 or more)")
        if m.epsilon_high is not None and m.epsilon_high < m.epsilon:
            raise ConfigError(f"method.epsilon_high={m.epsilon_high:g} is below method.epsilon={m.epsilon:g}: it is the clip's upper "
                              "side, raised above the lower one (DAPO: 0.28 beside 0.2); drop it or raise it")
        if ("overlong" in m.rewards) != (m.overlong_buffer is not None):
            raise ConfigError("method.rewards has overlong but method.overlong_buffer is not set: the tokens before "
                              "completion_tokens where the penalty starts (DAPO: a quarter of it), e.g. "
                              f"method.overlong_buffer={max(1, m.completion_tokens // 4)}" if m.overlong_buffer is None else
                              f"method.overlong_buffer={m.overlong_buffer} has no effect without the overlong reward: add overlong "
                              "to method.rewards or remove it")
        if m.overlong_buffer is not None and m.overlong_buffer > m.completion_tokens:
            raise ConfigError(f"method.overlong_buffer={m.overlong_buffer} is longer than method.completion_tokens="
                              f"{m.completion_tokens}: the soft zone ends at the limit; use at most {m.completion_tokens}")
        if mu > 1 and cfg.train.save_every % mu:
            raise ConfigError(f"train.save_every={cfg.train.save_every} is not a multiple of method.updates_per_rollout={mu}: a checkpoint "
                              f"must fall between rollouts (the sampled completions are not saved); use train.save_every={mu * max(1, cfg.train.save_every // mu)}")
        if cfg.logits.name == Logits.chunked:
            raise ConfigError("logits=chunked with method=grpo is not supported: the GRPO loss needs each token's log-prob, which "
                              "the chunked head reduces per row; use logits=full")
        if m.vllm:
            from finetune.disk import local_vision

            if local_vision(cfg.model) is not None:
                raise ConfigError(f"method.vllm=true with model.path={cfg.model.path}, a vision-language model: the vLLM sampler "
                                  "is given the prompts' tokens, not their images: set method.vllm=false (transformers' "
                                  "generate samples from both)")
            vllm_rules(cfg)
        elif m.vllm_memory != GrpoConfig().vllm_memory:
            raise ConfigError(f"method.vllm_memory={m.vllm_memory:g} is set but method.vllm=false: it is the share of the GPU vLLM "
                              "takes; set method.vllm=true or drop it")
        rewards.resolve(m)

    def objective(self, cfg: GrpoConfig, reference: Any, router: Any, head: Any) -> GRPO:
        return GRPO(cfg, reference, router)


METHOD = Grpo()


def vllm_mismatch() -> str | None:
    """What the installed vLLM requires of torch and transformers that this environment does not have (vLLM's releases
    pin their own torch: 0.33.0 needs torch==2.14.0 and transformers<5.21), as `vLLM V needs NAME SPEC, but this
    environment has NAME W`; None when they agree, or vLLM has no package metadata (a source checkout)."""
    from importlib import metadata

    from packaging.requirements import Requirement

    try:
        version, required = metadata.version("vllm"), metadata.requires("vllm") or []
    except metadata.PackageNotFoundError:
        return None
    for text in required:
        req = Requirement(text)
        if req.name not in ("torch", "transformers") or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
            continue
        try:
            have = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            continue
        if not req.specifier.contains(have, prereleases=True):
            return f"vLLM {version} needs {req.name}{req.specifier}, but this environment has {req.name} {have}"
    return None


def vllm_rules(cfg: Config) -> None:
    """method.vllm=true: vLLM installed, and a layout whose weights it can load whole (finetune.methods.vllm_rollout)."""
    import importlib.util

    from finetune.config import PeftMethod

    if importlib.util.find_spec("vllm") is None:
        raise ConfigError("method.vllm=true: vLLM is not installed here: pip install vllm (its wheels are built for CUDA GPUs), or "
                          "drop method.vllm to sample with transformers' generate")
    mismatch = vllm_mismatch()
    if mismatch:
        raise ConfigError(f"method.vllm=true: {mismatch}, so vLLM and this training would not run on the versions either was "
                          "built for: install vLLM in a virtualenv of its own (docs/grpo.md, vLLM), not into this one")
    p = cfg.parallelism
    if p.tp > 1 or p.cp > 1:
        raise ConfigError(f"method.vllm=true with parallelism.tp={p.tp} cp={p.cp} is not supported: each rank's vLLM engine holds "
                          "the whole model and its own process group would cut across the model's; use fsdp or zero (gathered "
                          "for vLLM), or method.vllm=false")
    if cfg.peft.name == PeftMethod.qlora:
        raise ConfigError("method.vllm=true with peft=qlora is not supported: vLLM would load the 4-bit base dequantized and merged "
                          "at every step; use peft=lora, or method.vllm=false (generate runs on the 4-bit model)")
    if cfg.peft.name == PeftMethod.dora:
        raise ConfigError("method.vllm=true with peft=dora is not supported: a DoRA weight is not W + its delta (its magnitude "
                          "rescales it); use peft=lora, or method.vllm=false")


class GRPO:
    """The GRPO loss over a rollout batch (`rollout` makes it from a batch of prompts before each step)."""

    def __init__(self, cfg: GrpoConfig, reference: Any = None, router: Any = None) -> None:
        self.cfg, self.reference, self.router = cfg, reference, router
        self.rewards: list[Any] | None = None  # resolved (reward models loaded) at the first rollout
        self.rollout_every = cfg.updates_per_rollout  # the loop stops on a signal only after a rollout's last update
        self.buffer: list[dict[str, torch.Tensor]] = []  # the rollout the next updates train on
        self.vllm: Any = None  # method.vllm: the rank's VllmSampler, built at the first rollout
        self.prompt_tokens: int | None = None  # the longest prompt (data.max_length, set by finetune.train): vLLM's context
        names = [f"rewards/{name}" for name in cfg.rewards]
        self.metrics = ("reward", "reward_std", *names, "kl", "completion_tokens") + ((router.metric,) if router else ())
        self.eval_metrics = (router.metric,) if router else ()  # evaluation scores the rows' own responses: no rollout

    def count(self, batch: dict[str, torch.Tensor]) -> int:
        """Completions in a rollout batch (rows with labels in an evaluation batch); under loss_type=dapo the completion
        tokens that carry the loss: the loop divides the global batch's summed loss by it."""
        if self.cfg.loss_type == GrpoLoss.dapo and "advantages" in batch:
            return int(completion_mask(batch).sum())
        return int(batch["input_ids"].shape[0])

    def metric_count(self, batch: dict[str, torch.Tensor]) -> int:
        """What the metrics (rewards, KL) are averaged over: completions."""
        return int(batch["input_ids"].shape[0])

    def __call__(self, model: Any, batch: dict[str, torch.Tensor]) -> Output:
        import torch

        from finetune.methods.losses import forward_aux, logits_token_logps

        logits, aux = forward_aux(model, batch, self.router is not None)
        logps = logits_token_logps(logits, batch["labels"])
        mask = (batch["labels"][:, 1:] != IGNORE).float()
        if "advantages" not in batch:  # evaluation: the rows' own responses' cross-entropy, per token, summed over rows
            loss = (-(logps * mask).sum(-1) / mask.sum(-1).clamp(min=1)).sum()
            out: Output = (loss, {})
        else:
            reference = None
            if self.cfg.beta > 0:
                with torch.no_grad():
                    reference = self.reference(model, batch, per_token=True).float()
            c = self.cfg
            loss, kl = grpo_loss(logps, batch["advantages"].float(), completion_mask(batch), c.epsilon, c.beta, reference,
                                 batch.get("old_logps"), epsilon_high=c.epsilon_high, level=c.importance_sampling_level,
                                 loss_type=c.loss_type, max_tokens=c.completion_tokens)
            sums = {k[len("sum_"):]: v.sum() for k, v in batch.items() if k.startswith("sum_")}
            out = (loss, {**sums, "kl": kl, "completion_tokens": mask.sum()})
        if self.router is not None:
            return self.router.apply(out[0], out[1], aux, self.count(batch))
        return out

    def loss(self, logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> Output:
        raise NotImplementedError("method=grpo does not run under pipeline parallel (refused before launch)")

    def rows_loss(self, logps: torch.Tensor, batch: dict[str, torch.Tensor]) -> Output:
        raise NotImplementedError("method=grpo does not run with logits=chunked (refused before launch)")

    def rollout(self, engine: Any, micro_batches: list[dict[str, torch.Tensor]], *, step: int, tokenizer: Any,
                seed: int) -> tuple[list[dict[str, torch.Tensor]], float]:
        """Each micro-batch of prompts -> a batch of its G completions per prompt, with their advantages and rewards
        (columns `sum_<metric>`, summed by the loss into its metrics); and the seconds generation took. With
        method.updates_per_rollout=mu > 1 the first step of every mu samples (and keeps each token's log-prob under the
        policy that sampled it, `old_logps`); the next mu - 1 steps train on the same completions, their prompts unread."""
        from finetune.methods import rewards
        from finetune.methods.losses import token_logps

        mu = self.cfg.updates_per_rollout
        if (step - 1) % mu and self.buffer:
            return self.buffer, 0.0
        if (step - 1) % mu:
            raise RuntimeError(f"step {step} is inside a rollout of method.updates_per_rollout={mu} steps, whose completions are gone "
                               "(a checkpoint falls between rollouts: train.save_every is a multiple of it)")
        if self.rewards is None:
            self.rewards = rewards.resolve(self.cfg, load_models=True)
        tic, out = time.perf_counter(), []
        if self.cfg.vllm:
            if self.vllm is None:
                from finetune.methods.vllm_rollout import VllmSampler

                self.vllm = VllmSampler(engine, tokenizer, self.cfg, prompt_tokens=self.prompt_tokens)
            self.vllm.sync(engine)
        for k, mb in enumerate(micro_batches):
            prompts, answers = split_rows(mb)
            shown = mb.get(SHOWN)  # a vision-language model's prompts' images: sampled from, and trained with
            completions = sample(engine, prompts, self.cfg, tokenizer, seed=(seed, step, engine.dp_rank, k), vllm=self.vllm,
                                 images=shown)
            batch = self.scored(prompts, answers, completions, tokenizer, shown)
            if mu > 1:  # the sampling policy's log-probs, for the ratio of the later updates (eval mode: no dropout)
                batch["old_logps"] = engine.inference(token_logps, batch).detach().float().cpu()
            out.append(batch)
        if self.cfg.scale_rewards == RewardScale.batch:  # the global batch's reward std, over every rank's completions
            std = batch_std([b["sum_reward"] for b in out], engine)
            for b in out:
                b["advantages"] = group_advantages(b["sum_reward"].view(-1, self.cfg.generations), RewardScale.batch, std).view(-1)
        self.buffer = out if mu > 1 else []
        return out, time.perf_counter() - tic

    def scored(self, prompts: list[list[int]], answers: list[list[int]], completions: list[list[int]], tokenizer: Any,
               images: list[list[Any]] | None = None) -> dict[str, torch.Tensor]:
        """The training batch of the completions (prompt + completion, labels on the completion) and their advantages;
        each completion shows its prompt's `images`."""
        import torch

        from finetune.methods import rewards
        from finetune.data.batches import collate

        g = self.cfg.generations
        texts = tokenizer.batch_decode(completions, skip_special_tokens=True)
        columns = {"prompts": [p for p in tokenizer.batch_decode(prompts, skip_special_tokens=True) for _ in range(g)],
                   "completions": texts, "answers": [a for a in tokenizer.batch_decode(answers, skip_special_tokens=True) for _ in range(g)],
                   "completion_tokens": [len(c) for c in completions]}
        total, each = rewards.score(self.rewards or [], **columns)
        r = torch.tensor(total, dtype=torch.float32).view(-1, g)
        shown = images or [[] for _ in prompts]
        examples = [Example(list(p) + list(c), [IGNORE] * len(p) + list(c), len(p), text, images=tuple(im))
                    for p, im, group in zip(prompts, shown, _groups(completions, g)) for c, text in zip(group, texts)]
        batch = collate(examples, tokenizer.pad_token_id, pictures=pictures_of(tokenizer))
        batch["advantages"] = group_advantages(r, self.cfg.scale_rewards, r.std()).view(-1)  # batch: `rollout` divides anew
        if self.cfg.mask_truncated_completions:  # cut before their EOS: no loss
            batch["kept"] = torch.tensor([float(tokenizer.eos_token_id in c) for c in completions])
        batch["sum_reward"] = r.view(-1)
        batch["sum_reward_std"] = r.std(dim=1, keepdim=True).expand_as(r).reshape(-1)
        for name, values in each.items():
            batch[f"sum_rewards/{name}"] = torch.tensor(values, dtype=torch.float32)
        return batch


def _groups(items: list[Any], g: int) -> list[list[Any]]:
    return [items[i : i + g] for i in range(0, len(items), g)]


def group_advantages(rewards: torch.Tensor, scale: RewardScale = RewardScale.group, std: Any = None) -> torch.Tensor:
    """Each reward minus its group's mean (a row of `rewards`: a prompt's G completions), divided by its group's std
    (group), by `std`, the global batch's (batch), or by nothing (none); a std is the sample's (n - 1), plus 1e-4."""
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if scale == RewardScale.none:
        return centred
    return centred / ((rewards.std(dim=1, keepdim=True) if scale == RewardScale.group else std) + 1e-4)


def batch_std(rewards: list[torch.Tensor], engine: Any) -> float:
    """The sample std of every reward of the global batch: this rank's (`rewards`) with every other data-parallel
    replica's (one rank per replica counts: `engine.owner`), summed across ranks in one collective."""
    import torch
    import torch.distributed as td

    r = torch.cat([t.double().view(-1) for t in rewards])
    moments = torch.stack([torch.tensor(float(r.numel()), dtype=torch.float64), r.sum(), (r * r).sum()]) * float(engine.owner)
    if td.is_available() and td.is_initialized() and td.get_world_size() > 1:
        device = torch.device("cuda", torch.cuda.current_device()) if td.get_backend() == "nccl" else torch.device("cpu")
        moments = moments.to(device)
        td.all_reduce(moments)
        moments = moments.cpu()
    n, total, squares = moments.tolist()
    return max((squares - total * total / n) / max(n - 1, 1), 0.0) ** 0.5


def completion_mask(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """[rows, tokens - 1]: 1 where a token of a completion carries the loss (its label; under mask_truncated_completions,
    only in a completion that ended with its EOS)."""
    mask = (batch["labels"][:, 1:] != IGNORE).float()
    return mask * batch["kept"][:, None].to(mask) if "kept" in batch else mask


def grpo_loss(logps: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, epsilon: float, beta: float,
              reference: torch.Tensor | None, old_logps: torch.Tensor | None = None, *, epsilon_high: float | None = None,
              level: RatioLevel = RatioLevel.token, loss_type: GrpoLoss = GrpoLoss.grpo,
              max_tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(the loss summed as the loop normalises it, the summed per-completion mean KL) of N completions' per-token
    log-probs (N x T, 0 where `mask` is 0); `old_logps` None: the policy sampled them (one update per rollout: rho = 1).

    The ratio per token, or per completion (level=sequence: GSPO, Zheng et al. 2025, arXiv:2507.18071, eq. 7:
    s_i = exp(1/|o_i| sum_t log rho_it)), clipped to [1 - epsilon, 1 + epsilon_high] (DAPO's clip-higher, Yu et al.
    2025, arXiv:2503.14476, eq. 10). The token terms l_it summed by `loss_type` over this micro-batch's N completions
    (the loop then divides by `count`, summed over the global batch):
    grpo:    sum_i 1/|o_i| sum_t l_it              count: completions (DeepSeekMath, arXiv:2402.03300, eq. 3)
    bnpo:    N / sum_i |o_i| * sum_i sum_t l_it    count: completions (this micro-batch's token mean: TRL's bnpo)
    dr_grpo: 1/max_tokens * sum_i sum_t l_it       count: completions (Dr. GRPO, Liu et al. 2025, arXiv:2503.20783)
    dapo:    sum_i sum_t l_it                      count: the global batch's tokens (DAPO eq. 10's 1 / sum_i |o_i|)"""
    import torch

    old = logps.detach() if old_logps is None else old_logps
    log_ratio = logps - old
    if level == RatioLevel.sequence:
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1))[:, None]
    ratio = torch.exp(log_ratio)
    a = advantages[:, None]
    high = epsilon if epsilon_high is None else epsilon_high
    surrogate = torch.minimum(ratio * a, torch.clamp(ratio, 1 - epsilon, 1 + high) * a)
    kl = torch.zeros_like(logps)
    if reference is not None:
        delta = reference - logps
        kl = torch.exp(delta) - delta - 1
    per_token = -(surrogate - beta * kl)
    tokens = mask.sum(-1).clamp(min=1)
    summed = (per_token * mask).sum(-1)
    if loss_type == GrpoLoss.grpo:
        loss = (summed / tokens).sum()
    elif loss_type == GrpoLoss.bnpo:
        loss = summed.sum() / mask.sum().clamp(min=1) * mask.shape[0]
    elif loss_type == GrpoLoss.dr_grpo:
        loss = summed.sum() / float(max_tokens or mask.shape[1])
    else:
        loss = summed.sum()
    return loss, ((kl.detach() * mask).sum(-1) / tokens).sum()


def split_rows(batch: dict[str, torch.Tensor]) -> tuple[list[list[int]], list[list[int]]]:
    """Each row's prompt (the tokens before its first label) and its response (the labelled tokens)."""
    prompts, answers = [], []
    for ids, labels in zip(batch["input_ids"].tolist(), batch["labels"].tolist()):
        first = next(i for i, t in enumerate(labels) if t != IGNORE)
        prompts.append(ids[:first])
        answers.append([t for t in labels if t != IGNORE])
    return prompts, answers


def sample(engine: Any, prompts: list[list[int]], cfg: GrpoConfig, tokenizer: Any, seed: tuple[int, ...],
           vllm: Any = None, images: list[list[Any]] | None = None) -> list[list[int]]:
    """G sampled completions of each prompt (adjacent), each cut after its first EOS (kept: it is labelled), through
    the engine (eval mode, its precision; generation synced across ranks where parameters are gathered), or through
    vLLM's engine (a finetune.methods.vllm_rollout.VllmSampler, synced with the policy). `images`: each prompt's (a
    vision-language model's), shown to the sampler: each prompt is then sampled as G rows of its own."""
    import torch

    from finetune.data.batches import left_padded

    if vllm is not None:
        return [cut(row, tokenizer.eos_token_id) for row in vllm.sample(prompts, cfg, hash(seed) % 2**63)]
    g, rows, pictures = cfg.generations, len(prompts) * cfg.generations, pictures_of(tokenizer)
    showing, shown = False, []
    if pictures is not None:  # each prompt G times with its images (a processor's image inputs do not repeat along the
        # rows); a layout whose ranks run the vision tower together: one more row, a blank image's, where none shows one
        repeated, shown = pictures.blank_row([p for p in prompts for _ in range(g)],
                                             [im for im in (images or [[] for _ in prompts]) for _ in range(g)])
        showing = any(shown)
        if showing:
            prompts = repeated
    batch = left_padded(prompts, tokenizer.pad_token_id)
    if showing:
        batch |= {IN_BATCH + k: v for k, v in pictures.batch(shown, batch["input_ids"]).items()}
    width = batch["input_ids"].shape[1]
    never = never_written(tokenizer)
    model = engine.generation_model
    device = next(model.parameters()).device
    devices = [device] if device.type == "cuda" else []

    def generate(_: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(hash(seed) % 2**63)
            return model.generate(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], do_sample=True,
                                  temperature=cfg.temperature, top_p=cfg.top_p, top_k=0, max_new_tokens=cfg.completion_tokens,
                                  num_return_sequences=1 if showing else g, pad_token_id=tokenizer.pad_token_id,
                                  eos_token_id=tokenizer.eos_token_id, synced_gpus=engine.lockstep, **seen(batch), **never)

    with torch.no_grad():
        out = engine.inference(generate, batch)
    return [cut(row, tokenizer.eos_token_id) for row in out[:rows, width:].tolist()]  # without a blank image's row


def cut(row: list[int], eos: int) -> list[int]:
    """A sampled row up to its first EOS, which is kept (the padding after it dropped)."""
    return row[: row.index(eos) + 1] if eos in row else row
