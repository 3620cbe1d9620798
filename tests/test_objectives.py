"""SFT loss: masking and token-count normalisation against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from finetune.config import OptimConfig, PrecisionConfig, Scheduler, Strategy
from finetune.data.tokenize import IGNORE
from finetune.rank.dist import Dist
from finetune.rank.engine.torch_engine import TorchEngine, build_scheduler
from finetune.methods.sft import SFT
from finetune.methods.losses import token_loss_sum


def test_token_loss_sum_by_hand():
    # vocab of 2; position t predicts label t+1. Uniform logits cost ln 2 per token; logits
    # (0, ln 3) give p(1) = 3/4.
    logits = torch.tensor([[[0.0, 0.0], [0.0, math.log(3)], [5.0, 5.0], [9.0, 9.0]]])
    labels = torch.tensor([[IGNORE, 1, 1, IGNORE]])  # prompt, response, response, padding
    expected = math.log(2) + -math.log(0.75)
    assert token_loss_sum(logits, labels).item() == pytest.approx(expected, rel=1e-6)
    assert SFT().count({"labels": labels}) == 2


class Table(torch.nn.Module):
    """A 'model' whose logits at each position are a learned row per input token."""

    def __init__(self) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(torch.tensor([[0.0, 1.0, 2.0], [1.0, 0.0, -1.0], [0.5, 0.5, 0.0]]))

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=False):
        return type("Out", (), {"logits": self.table[input_ids]})()


def batch(ids, labels):
    t = torch.tensor([ids])
    return {"input_ids": t, "attention_mask": torch.ones_like(t), "labels": torch.tensor([labels])}


A = batch([0, 1, 2], [IGNORE, 2, IGNORE])  # 1 response token
B = batch([2, 0, 1, 1], [IGNORE, 0, 1, 2])  # 3 response tokens


def one_step(micro_batches, count):
    torch.manual_seed(0)
    model = Table()
    optim = OptimConfig(lr=1.0, eps=1.0, max_grad_norm=None, scheduler=Scheduler.constant)
    engine = TorchEngine(model, optim=optim, precision=PrecisionConfig(), max_steps=10, strategy=Strategy.single,
                         dist=Dist(0, 0, 1, torch.device("cpu")))
    result = engine.train_step(micro_batches, SFT(), count)
    return model.table.detach().clone(), result


def test_accumulation_normalises_by_tokens_not_micro_batches():
    # Reference: the mean over all 4 response tokens of the global batch.
    model = Table()
    ref = (token_loss_sum(model(A["input_ids"], None).logits, A["labels"])
           + token_loss_sum(model(B["input_ids"], None).logits, B["labels"])) / 4
    ref.backward()
    g = model.table.grad
    # AdamW's first step with eps=1, lr=1 and no decay moves each weight by g / (|g| + 1).
    expected = model.table.detach() - g / (g.abs() + 1.0)

    split, result = one_step([A, B], count=4)  # two micro-batches of 1 and 3 tokens
    assert torch.allclose(split, expected, atol=1e-6)
    assert result.loss_sum / 4 == pytest.approx(ref.item(), rel=1e-6)
    mean_of_means = (token_loss_sum(model(A["input_ids"], None).logits, A["labels"]) / 1
                     + token_loss_sum(model(B["input_ids"], None).logits, B["labels"]) / 3) / 2
    assert abs(mean_of_means.item() - ref.item()) > 0.05  # the test would catch per-batch averaging
    assert result.grad_norm == pytest.approx(g.norm().item(), rel=1e-6)


def test_warmup_then_cosine_to_min_ratio():
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=1.0)
    sched = build_scheduler(opt, OptimConfig(lr=1.0, warmup_steps=4, min_lr_ratio=0.1), max_steps=14)
    lrs = []
    for _ in range(14):
        lrs.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    assert lrs[:5] == pytest.approx([0.0, 0.25, 0.5, 0.75, 1.0])
    assert lrs[9] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 5 / 10)))
    assert sched.get_last_lr()[0] == pytest.approx(0.1)
