"""REINFORCE Leave-One-Out (method=rloo): Ahmadian et al., "Back to Basics: Revisiting REINFORCE Style Optimization for
Learning from Human Feedback in LLMs", 2024 (arXiv:2402.14740), section 3.2; Kool et al. 2019 for the estimator.

The rollout is GRPO's (finetune.methods.online: G = `method.generations` completions per prompt, sampled by the policy,
scored by `method.rewards`; dynamic sampling, the overlong reward and vLLM alike). What differs is how a completion's
reward becomes its gradient. Each completion is one action: its baseline is the mean reward of the other G - 1
completions of its prompt, and the loss is REINFORCE's, over the whole completion's log-prob:

    A_i = r_i - 1/(G-1) sum_{j != i} r_j  =  G/(G-1) (r_i - mean(r_1..r_G))
    L   = - sum_i A_i log pi(o_i | q),    log pi(o_i | q) = sum_t log pi(o_it | q, o_i<t)

divided by the global batch's completions (the loop's normaliser: 1/G per prompt as in the paper's eq. 6, averaged
over prompts). No ratio, no clip and no old log-probs: every rollout trains once, on policy. No std either: the
baseline is unbiased as it is.

With `method.beta` > 0 the KL to the reference is part of the reward, as the paper writes it (section 2.1, RLHF's
r(x, y) - beta KL): each completion's r_i becomes r_i - beta sum_t (log pi(o_it) - log pi_ref(o_it)), the sampled
policy's and the reference's log-probs of its tokens taken before the step (no gradient through it: REINFORCE carries
it). The metric `kl` is that sum per completion; `reward` stays the rewards' own sum.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from finetune.config import METHOD_NAME, at_least, checked
from finetune.data.batches import on_grid
from finetune.methods.base import Output
from finetune.methods.online import Online, OnlineConfig, OnlineMethod, completion_mask

if TYPE_CHECKING:
    import torch


@dataclass
class RlooConfig(OnlineConfig):
    """method=rloo: online reinforcement learning from rewards by REINFORCE with a leave-one-out baseline: `generations`
    completions sampled per prompt at each step, scored by `rewards`, each pushed up or down by how its reward compares
    with the others'."""

    name: str = checked(METHOD_NAME, "rloo")
    beta: float = checked(at_least(0), 0.0)
    """The weight of the KL to the reference, subtracted from each completion's reward (the paper's; TRL's RLOO uses 0.05);
    0: no KL and no reference model."""


class Rloo(OnlineMethod):
    """The RLOO record (finetune.methods.base.Method)."""

    name = "rloo"
    config = RlooConfig

    def objective(self, cfg: RlooConfig, reference: Any, router: Any, head: Any) -> RLOO:
        return RLOO(cfg, reference, router)


METHOD = Rloo()


class RLOO(Online):
    """The RLOO loss over a rollout batch (`rollout` makes it from a batch of prompts before each step)."""

    def advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        return leave_one_out(rewards)

    def finished(self, engine: Any, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """beta > 0: each completion's KL to the reference (summed over its tokens) taken from its reward, the advantages
        made again from what is left; `sum_kl` carries it to the metric."""
        import torch

        if self.cfg.beta == 0:
            return batch
        from finetune.methods.losses import labelled_logps

        def both(model: Any, b: dict[str, torch.Tensor]) -> torch.Tensor:
            return torch.stack([on_grid(labelled_logps(model, b)[0].float(), b), on_grid(self.reference(model, b, per_token=True).float(), b)])

        policy, reference = engine.inference(both, batch).detach().cpu()
        kl = sequence_kl(policy, reference, completion_mask(batch))
        shaped = batch["sum_reward"] - self.cfg.beta * kl
        batch["advantages"] = leave_one_out(shaped.view(-1, self.cfg.generations)).reshape(-1)
        batch["sum_kl"] = kl
        return batch

    def __call__(self, model: Any, batch: dict[str, torch.Tensor]) -> Output:
        from finetune.methods.losses import labelled_logps

        logps, aux = labelled_logps(model, batch, self.router is not None)
        logps = on_grid(logps, batch)  # [completions, tokens - 1], padded or not
        mask = completion_mask(batch)
        if "advantages" not in batch:  # evaluation: the rows' own responses' cross-entropy, per token, summed over rows
            out: Output = ((-(logps * mask).sum(-1) / mask.sum(-1).clamp(min=1)).sum(), {})
        else:
            loss = rloo_loss(logps, batch["advantages"].float(), mask)
            sums = {k[len("sum_"):]: v.sum() for k, v in batch.items() if k.startswith("sum_")}
            out = (loss, {"kl": logps.new_zeros(()), **sums, "completion_tokens": mask.sum()})
        if self.router is not None:
            return self.router.apply(out[0], out[1], aux, self.count(batch))
        return out


def leave_one_out(rewards: torch.Tensor) -> torch.Tensor:
    """[prompts, G] rewards -> each minus the mean of the other G - 1 of its row (RLOO's baseline)."""
    g = rewards.shape[1]
    return rewards - (rewards.sum(dim=1, keepdim=True) - rewards) / (g - 1)


def sequence_kl(policy: torch.Tensor, reference: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each completion's KL estimate: the sum over its tokens of log pi - log pi_ref (the sampled tokens' log ratio)."""
    return ((policy - reference) * mask).sum(-1)


def rloo_loss(logps: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """REINFORCE's loss summed over N completions: - sum_i A_i sum_t log pi(o_it) (the loop divides by completions)."""
    return -(advantages * (logps * mask).sum(-1)).sum()
