"""PEFT variants (peft.use_rslora, peft.init, optim.loraplus_lr_ratio) and NEFTune (train.neftune_alpha): each
changes what runs, and evaluation sees no noise."""

from __future__ import annotations

import math

import pytest
import torch

from finetune.rank import model
from finetune.config import CheckpointingConfig, ConfigError, LoraInit, OptimConfig, PeftConfig, PeftMethod
from finetune.rank.engine.common import InBackward, build_optimizer, build_scheduler, lora_b, param_groups
from tests.conftest import tiny_model

IDS = torch.randint(3, 60, (2, 12), generator=torch.Generator().manual_seed(0))


def adapted(**peft):
    torch.manual_seed(0)
    net, _ = tiny_model()
    return model.apply_strategies(net, checkpointing=CheckpointingConfig(), peft=PeftConfig(name=PeftMethod.lora, dropout=0.0, **peft))


def lora_layers(net):
    from peft.tuners.lora import LoraLayer

    return [m for m in net.modules() if isinstance(m, LoraLayer)]


def test_rslora_scales_by_alpha_over_sqrt_r():
    plain, rs = adapted(r=4, alpha=8), adapted(r=4, alpha=8, use_rslora=True)
    assert {m.scaling["default"] for m in lora_layers(plain)} == {8 / 4}
    assert {m.scaling["default"] for m in lora_layers(rs)} == {8 / math.sqrt(4)}


def test_gaussian_init_draws_a_from_a_normal_of_std_one_over_r():
    net = adapted(r=4, init=LoraInit.gaussian)
    a = torch.cat([m.lora_A["default"].weight.flatten() for m in lora_layers(net)])
    a = a.detach()
    assert abs(float(a.std()) - 1 / 4) < 0.02 and abs(float(a.mean())) < 0.02  # default: Kaiming-uniform, std ~0.1
    assert all(not m.lora_B["default"].weight.any() for m in lora_layers(net))


@pytest.mark.parametrize("init", [LoraInit.pissa, LoraInit.olora])
def test_pissa_olora_move_the_weight_into_the_adapter_and_change_nothing_at_step_0(init):
    torch.manual_seed(0)
    original, _ = tiny_model()
    before = {n: p.detach().clone() for n, p in original.named_parameters()}
    with torch.no_grad():
        reference = original(input_ids=IDS).logits
    net = adapted(r=4, init=init)
    layer = lora_layers(net)[0]
    base, name = layer.get_base_layer().weight, next(n for n in before if before[n].shape == layer.get_base_layer().weight.shape)
    assert not torch.equal(base, before[name])  # the base holds the residual now
    rebuilt = base + layer.scaling["default"] * layer.lora_B["default"].weight @ layer.lora_A["default"].weight
    assert torch.allclose(rebuilt, before[name], atol=1e-5)  # base + adapter == the original weight
    with torch.no_grad():
        assert torch.allclose(net(input_ids=IDS).logits, reference, atol=1e-4)


def test_a_trained_pissa_adapter_saves_as_a_lora_of_the_original_base(tmp_path):
    """final/ (engine.export: save_pretrained under model.adapter_save_kwargs) holds a plain LoRA adapter of rank 2r
    that, applied to the untouched base, is the trained model."""
    import json

    from peft import PeftModel

    net = adapted(r=4, init=LoraInit.pissa)
    with torch.no_grad():  # "training": move every adapter weight
        for p in net.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.05)
        trained = net(input_ids=IDS).logits
    with model.adapter_save_kwargs(net) as kwargs:
        net.save_pretrained(tmp_path / "final", **kwargs)
    saved = json.loads((tmp_path / "final" / "adapter_config.json").read_text())
    assert (saved["r"], saved["lora_alpha"], saved["init_lora_weights"]) == (8, 64, True)
    torch.manual_seed(0)
    base, _ = tiny_model()
    loaded = PeftModel.from_pretrained(base, tmp_path / "final")
    with torch.no_grad():
        assert torch.allclose(loaded(input_ids=IDS).logits, trained, atol=1e-4)
    with model.adapter_save_kwargs(adapted()) as kwargs:
        assert kwargs == {}  # a default init saves as always


def test_loraplus_puts_the_b_matrices_in_groups_of_their_own_rate():
    net = adapted(r=4)
    params = [p for p in net.parameters() if p.requires_grad]
    fast = lora_b(net)
    assert len(fast) == len(params) // 2 == 14  # 2 blocks x 7 linears, one B each
    assert all(".lora_B." in n for n, p in net.named_parameters() if id(p) in fast)
    for name in ("adamw", "adam", "sgd", "adamw_8bit", "adafactor", "torch.optim.NAdam"):
        cfg = OptimConfig(name=name, lr=1e-3, loraplus_lr_ratio=16, warmup_steps=2)
        opt = build_optimizer(params, cfg, fast=fast)
        sched = build_scheduler(opt, cfg, max_steps=10)
        sched.step()  # warmup: each group at half its own peak
        rates = {id(p): g["lr"] for g in opt.param_groups for p in g["params"]}
        assert sorted({rates[id(p)] for p in params if id(p) in fast}) == pytest.approx([0.5 * 16e-3]), name
        assert sorted({rates[id(p)] for p in params if id(p) not in fast}) == pytest.approx([0.5e-3]), name
    same = param_groups(params, 0.1, fast=fast)  # no ratio: the two groups as before
    assert [len(g["params"]) for g in same] == [28, 0] and "lr" not in same[0]


def test_loraplus_rates_hold_in_backward():
    net = adapted(r=4)
    params = [p for p in net.parameters() if p.requires_grad]
    fast = lora_b(net)
    cfg = OptimConfig(lr=1e-3, loraplus_lr_ratio=4)
    steps = InBackward(params, cfg, None, fast)
    build_scheduler(steps.lead, cfg, max_steps=10)
    steps.begin()
    rates = {id(p): g["lr"] for opt in steps.optimizers for g in opt.param_groups for p in g["params"]}
    assert all(rates[id(p)] == pytest.approx(4e-3 if id(p) in fast else 1e-3) for p in params)


def noisy_model(alpha=5.0):
    torch.manual_seed(0)
    net, _ = tiny_model()
    return model.apply_strategies(net, checkpointing=CheckpointingConfig(), peft=PeftConfig(), neftune_alpha=alpha)


def test_neftune_adds_noise_in_training_forwards_only():
    torch.manual_seed(0)
    clean, tok = tiny_model()
    noisy = noisy_model()
    mask = torch.ones_like(IDS)
    mask[1, 8:] = 0  # the second row is 8 tokens long
    with torch.no_grad():
        clean.eval()
        reference = clean(input_ids=IDS, attention_mask=mask).logits
        noisy.train()
        assert not torch.allclose(noisy(input_ids=IDS, attention_mask=mask).logits, reference, atol=1e-3)
        noisy.eval()
        assert torch.equal(noisy(input_ids=IDS, attention_mask=mask).logits, reference)
        prompt = IDS[:1, :6]
        assert torch.equal(noisy.generate(prompt, max_new_tokens=5, do_sample=False, pad_token_id=0),
                           clean.generate(prompt, max_new_tokens=5, do_sample=False, pad_token_id=0))


def test_neftune_scales_by_each_sequences_real_length():
    net = noisy_model(alpha=4.0)
    embed = net.get_input_embeddings()
    seen = {}
    embed.register_forward_hook(lambda m, a, out: seen.setdefault("noisy", out))  # after NEFTune's hook
    mask = torch.ones_like(IDS)
    mask[1, 4:] = 0
    net.train()
    with torch.no_grad():
        net(input_ids=IDS, attention_mask=mask)
        noise = seen["noisy"] - embed.weight[IDS]
    d = embed.weight.shape[1]
    for row, length in ((0, 12), (1, 4)):
        bound = 4.0 / math.sqrt(length * d)
        assert float(noise[row].abs().max()) <= bound and float(noise[row].abs().max()) > 0.9 * bound
    from finetune.rank.neftune import lengths

    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3, 4]])  # a packed row: samples of 3, 2 and 5 tokens
    assert lengths(None, pos, torch.Size([1, 10, d])).flatten().tolist() == [3, 3, 3, 2, 2, 5, 5, 5, 5, 5]


@pytest.mark.parametrize("overrides,line", [
    (["optim.loraplus_lr_ratio=16"], "optim.loraplus_lr_ratio=16 speeds up LoRA's B matrices, and peft=none trains none: add "
     "peft=lora (or dora/qlora), or remove optim.loraplus_lr_ratio"),
    (["peft=qlora", "peft.init=pissa"], "peft.init=pissa with peft=qlora: PiSSA/OLoRA decompose the full-precision base weight "
     "and PEFT cannot take the residual back into a 4-bit base exactly: use peft=lora with peft.init=pissa, or peft=qlora "
     "with peft.init=default"),
    (["peft=dora", "peft.init=olora"], "peft.init=olora with peft=dora: PEFT converts only plain LoRA adapters back to the "
     "original base at save: use peft=lora with peft.init=olora, or peft=dora with peft.init=default"),
    (["peft=lora", "peft.init=pissa", "zero=stage2"], "peft.init=pissa under zero.stage=2: PEFT converts the trained adapter "
     "to the original base at save by loading the step-0 adapter into the live model, which a sharded or partitioned model "
     "cannot take: use parallelism=single or ddp with zero=none, or peft.init=default"),
    (["peft=lora", "peft.init=pissa", "method=dpo", "data=quickstart_dpo", "method.reference=adapter_disabled"],
     "method.reference=adapter_disabled with peft.init=pissa: the base under the adapter holds the residual (the weight less "
     "its principal part), not the model you started from: use method.reference=precomputed or live, or peft.init=default"),
    (["peft=lora", "peft.init=loftq"], "peft.init=loftq: PEFT computes LoftQ on CUDA only and replaces the base weights with "
     "their 4-bit approximation, which no saved adapter converts back to model.path, so final/ could not hold the trained "
     "model: use peft=qlora with peft.init=default (or pissa/olora with peft=lora)"),
    (["peft.use_rslora=true"], "peft.use_rslora=true has no effect with peft=none: remove it or change the option"),
    (["train.neftune_alpha=5", "parallelism=tp2", "launcher.nproc_per_node=2", "train.global_batch_size=32"],
     "train.neftune_alpha with parallelism.tp=2: the embedding's output is split or staged across ranks there, so each rank "
     "would draw its own noise and scale it by its own part of the sequence: use NEFTune with parallelism=single, ddp or "
     "fsdp (or zero), or remove train.neftune_alpha"),
])
def test_variants_refused_where_they_cannot_work(compose, overrides, line):
    with pytest.raises(ConfigError) as e:
        compose(overrides)
    assert str(e.value) == line


def test_variants_compose_where_they_work(compose):
    cfg = compose(["peft=lora", "peft.init=pissa", "peft.use_rslora=true", "optim.loraplus_lr_ratio=16", "train.neftune_alpha=5"])
    assert (cfg.peft.init, cfg.optim.loraplus_lr_ratio, cfg.train.neftune_alpha) == (LoraInit.pissa, 16, 5)
    compose(["peft=qlora", "optim.loraplus_lr_ratio=16", "zero=stage2", "train.neftune_alpha=5"])
    compose(["peft=lora", "parallelism=fsdp", "launcher.nproc_per_node=2", "optim.loraplus_lr_ratio=4", "train.neftune_alpha=5"])


def test_an_adapter_disabled_reference_sees_no_noise_in_a_training_step():
    from finetune.rank.reference import adapter_disabled

    torch.manual_seed(0)
    net, _ = tiny_model()
    peft = PeftConfig(name=PeftMethod.lora, dropout=0.0)
    noisy = model.apply_strategies(net, checkpointing=CheckpointingConfig(), peft=peft, neftune_alpha=5.0)
    batch = {"input_ids": IDS, "labels": IDS, "attention_mask": torch.ones_like(IDS)}
    noisy.train()
    with torch.no_grad():
        quiet = adapter_disabled(noisy, batch)
        assert noisy.get_input_embeddings().training is True  # put back as it was: the policy's forward is noisy
        noisy.eval()
        assert torch.equal(quiet, adapter_disabled(noisy, batch))
