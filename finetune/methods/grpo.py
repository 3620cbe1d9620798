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
(`method.importance_sampling_level`), DAPO's masking of truncated completions, its soft overlong reward and its dynamic
sampling. The rollout (sampling, scoring, dynamic sampling's refills) is every online method's: finetune.methods.online,
which method=rloo shares. Generation runs through the engine (`generation_model`, synced across ranks where parameters
are gathered collectively: FSDP2, ZeRO-3) before the step, or through a vLLM engine on each rank with method.vllm
(finetune.methods.vllm_rollout, the policy's weights loaded into it first); its time is reported apart (`generation_s`). Evaluation scores the rows' own responses (their per-token cross-entropy as
`eval_loss`) and, at the end, exact match of greedy completions, as SFT does.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from enum import Enum
from typing import TYPE_CHECKING, Any

from finetune.config import METHOD_NAME, POSITIVE, Config, ConfigError, Spelled, at_least, checked, in_range, unused
from finetune.data.batches import on_grid
from finetune.methods.base import Output
from finetune.methods.collectives import batch_std
from finetune.methods.online import Online, OnlineConfig, OnlineMethod, completion_mask, completions

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
class GrpoConfig(OnlineConfig):
    """method=grpo: online reinforcement learning from rewards (Group Relative Policy Optimization): `generations`
    completions sampled per prompt at each step, scored by `rewards`, the policy moved towards the better ones of each
    group."""

    name: str = checked(METHOD_NAME, "grpo")
    beta: float = checked(at_least(0), 0.0)
    """The weight of the per-token KL to the reference in the loss; 0: no KL term and no reference model (TRL's default
    since DAPO/Dr. GRPO)."""
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
    updates_per_rollout: int = checked(at_least(1), 1)
    """Optimizer steps on each rollout (mu; TRL's num_iterations): the completions sampled at step k train steps
    k .. k + mu - 1 against the log-probs they were sampled with (the clipped ratio); those steps' own prompts are not
    read. train.save_every must be a multiple of it (a checkpoint falls between rollouts)."""
    async_generation: bool = False
    """Sample the next step's rollout while this step trains, in a thread, by a copy of the policy refreshed every step:
    one step off-policy, corrected by the clipped ratio to the sampler's log-probs (finetune.methods.background). Single
    process or DDP; the copy's weights are counted by the planner."""


class Grpo(OnlineMethod):
    """The GRPO record (finetune.methods.base.Method)."""

    name = "grpo"
    config = GrpoConfig

    def validate(self, cfg: Config) -> None:
        super().validate(cfg)
        m = cfg.method
        mu = m.updates_per_rollout
        if m.async_generation:
            async_rules(cfg)
        elif mu == 1:
            ratio = ("epsilon", "epsilon_high", "importance_sampling_level")
            unused(m, "method", tuple(f.name for f in fields(m) if f.name not in ratio),
                   "with method.updates_per_rollout=1: each rollout trains once, at policy ratio 1, where neither the clip "
                   "nor the ratio's level acts (set method.updates_per_rollout=2 or more, or method.async_generation=true)")
        if m.epsilon_high is not None and m.epsilon_high < m.epsilon:
            raise ConfigError(f"method.epsilon_high={m.epsilon_high:g} is below method.epsilon={m.epsilon:g}: it is the clip's upper "
                              "side, raised above the lower one (DAPO: 0.28 beside 0.2); drop it or raise it")
        if mu > 1 and cfg.train.save_every % mu:
            raise ConfigError(f"train.save_every={cfg.train.save_every} is not a multiple of method.updates_per_rollout={mu}: a checkpoint "
                              f"must fall between rollouts (the sampled completions are not saved); use train.save_every={mu * max(1, cfg.train.save_every // mu)}")

    def objective(self, cfg: GrpoConfig, reference: Any, router: Any, head: Any) -> GRPO:
        return GRPO(cfg, reference, router)


METHOD = Grpo()


def async_rules(cfg: Config) -> None:
    """method.async_generation=true: a layout where each rank holds the whole model and the sampler's thread needs no
    collective (finetune.methods.background)."""
    from finetune.methods.online import whole_model

    m, why = cfg.method, "method.async_generation=true"
    if not whole_model(cfg):
        raise ConfigError(f"{why} runs on parallelism=single or ddp: its sampler is a whole copy of the policy on each rank, "
                          "sampling in a thread while the step trains, and sharded weights (fsdp, tp, zero) are gathered by "
                          "collectives the step's own would interleave with; use parallelism=ddp, or drop it")
    for key, on, reason in (("vllm", m.vllm and not m.vllm_servers, "a colocated vLLM engine would sample on the training's device "
                             "while the step trains; sample through a server of its own (method.vllm_servers=[HOST:PORT])"),
                            ("dynamic_sampling", m.dynamic_sampling, "its refills' rounds are agreed across ranks by a collective, "
                             "which the sampler's thread cannot join while the step trains"),
                            ("updates_per_rollout", m.updates_per_rollout > 1, "a rollout sampled ahead trains once")):
        if on:
            raise ConfigError(f"{why} with method.{key}={getattr(m, key) if key == 'updates_per_rollout' else 'true'} is not "
                              f"supported: {reason}; drop one of them")
    if cfg.data.streaming:
        raise ConfigError(f"{why} with data.streaming=true is not supported: the next step's prompts are read while this step "
                          "trains, and a stream serves each step once, in order; use data.streaming=false")


class GRPO(Online):
    """The GRPO loss over a rollout batch (`rollout` makes it from a batch of prompts before each step)."""

    def __init__(self, cfg: GrpoConfig, reference: Any = None, router: Any = None) -> None:
        self.updates = cfg.updates_per_rollout
        super().__init__(cfg, reference, router)
        if self.updates > 1 or self.overlapped:  # the ratio can leave 1: the share of tokens the clip holds
            self.metrics += ("clipped",)

    def advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        return group_advantages(rewards, self.cfg.scale_rewards, rewards.std())  # batch: `rescaled` divides anew

    def finished(self, engine: Any, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        from finetune.methods.losses import labelled_logps

        if self.updates > 1 or self.overlapped:  # the sampling policy's log-probs (`engine`: the background sampler's copy,
            # method.async_generation), for the ratio of the later updates (eval mode: no dropout)
            logps = engine.inference(lambda model, b: labelled_logps(model, b)[0], batch)
            batch["old_logps"] = on_grid(logps.detach().float(), batch).cpu()
        return batch

    def rescaled(self, engine: Any, batches: list[dict[str, torch.Tensor]]) -> None:
        if self.cfg.scale_rewards == RewardScale.batch:  # the global batch's reward std, over every rank's completions
            std = batch_std([b["sum_reward"] for b in batches], engine)
            for b in batches:
                b["advantages"] = group_advantages(b["sum_reward"].view(-1, self.cfg.generations), RewardScale.batch, std).view(-1)

    def count(self, batch: dict[str, torch.Tensor]) -> int:
        """Completions in a rollout batch (rows with labels in an evaluation batch); under loss_type=dapo the completion
        tokens that carry the loss: the loop divides the global batch's summed loss by it."""
        if self.cfg.loss_type == GrpoLoss.dapo and "advantages" in batch:
            return int(completion_mask(batch).sum())
        return completions(batch)

    def __call__(self, model: Any, batch: dict[str, torch.Tensor]) -> Output:
        import torch

        from finetune.methods.losses import labelled_logps

        logps, aux = labelled_logps(model, batch, self.router is not None)
        logps = on_grid(logps, batch)  # [completions, tokens - 1], padded or not
        mask = completion_mask(batch)
        if "advantages" not in batch:  # evaluation: the rows' own responses' cross-entropy, per token, summed over rows
            loss = (-(logps * mask).sum(-1) / mask.sum(-1).clamp(min=1)).sum()
            out: Output = (loss, {})
        else:
            reference = None
            if self.cfg.beta > 0:
                with torch.no_grad():
                    reference = on_grid(self.reference(model, batch, per_token=True).float(), batch)
            c = self.cfg
            loss, kl = grpo_loss(logps, batch["advantages"].float(), mask, c.epsilon, c.beta, reference,
                                 batch.get("old_logps"), epsilon_high=c.epsilon_high, level=c.importance_sampling_level,
                                 loss_type=c.loss_type, max_tokens=c.completion_tokens)
            sums = {k[len("sum_"):]: v.sum() for k, v in batch.items() if k.startswith("sum_")}
            out = (loss, {**sums, "kl": kl, "completion_tokens": mask.sum()})
            if "old_logps" in batch:
                out[1]["clipped"] = clipped(logps.detach(), batch["old_logps"], mask, c)
        if self.router is not None:
            return self.router.apply(out[0], out[1], aux, self.count(batch))
        return out


def group_advantages(rewards: torch.Tensor, scale: RewardScale = RewardScale.group, std: Any = None) -> torch.Tensor:
    """Each reward minus its group's mean (a row of `rewards`: a prompt's G completions), divided by its group's std
    (group), by `std`, the global batch's (batch), or by nothing (none); a std is the sample's (n - 1), plus 1e-4."""
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if scale == RewardScale.none:
        return centred
    return centred / ((rewards.std(dim=1, keepdim=True) if scale == RewardScale.group else std) + 1e-4)


def clipped(logps: torch.Tensor, old_logps: torch.Tensor, mask: torch.Tensor, cfg: GrpoConfig) -> torch.Tensor:
    """Per completion, the share of its tokens whose ratio to the sampler is outside [1 - epsilon, 1 + epsilon_high]
    (where the clip may hold the gradient at 0; TRL's clip_ratio), summed over completions."""
    import torch

    ratio = torch.exp(logps - old_logps.to(logps))
    high = cfg.epsilon if cfg.epsilon_high is None else cfg.epsilon_high
    out = ((ratio < 1 - cfg.epsilon) | (ratio > 1 + high)).float() * mask
    return (out.sum(-1) / mask.sum(-1).clamp(min=1)).sum()


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
