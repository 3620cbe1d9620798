"""Attention and mixture-of-experts across families (issue 16, item 1): model.attn_implementation=auto
picks what the family and the device can run (gemma2 soft-caps its attention logits: no sdpa), an
explicit kernel the family cannot run is refused by the dry run; LoRA reaches a MoE's fused experts
through PEFT's target_parameters, QLoRA leaves them unquantized and the planner counts them so, the
router's load-balancing loss is reported; peft.target_modules that match nothing name what exists."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from conftest import last_line, read_metrics, run_cli, train_here
from ranks import launch_here
from finetune.launcher.compose import preflight
from finetune.config import ASSETS, ConfigError, PeftConfig, PeftMethod
from finetune.families import FAMILIES, attention_limits, pick_attention

TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256)
FAMILY_KEYS = {
    "gemma2": dict(head_dim=16),  # soft-capped attention logits by default (attn_logit_softcapping=50.0)
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16),
}
SHORT = ["parallelism=single", "launcher.nproc_per_node=1", "train.max_steps=2", "optim.warmup_steps=0", "train.eval_every=0",
         "train.exact_match_samples=0", "train.progress_bar=false", "train.memory_report=false", "train.micro_batch_size=4",
         "train.global_batch_size=8"]
"""Two optimizer steps of 8 rows on one CPU process."""
SMALL_EVAL = ["data.eval=null", "data.eval_size=16"]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """Tiny random-init gemma2, mixtral and qwen3_moe saved as model directories with the shipped tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    root = tmp_path_factory.mktemp("families")
    tok = AutoTokenizer.from_pretrained(ASSETS / "tokenizer")
    out = {}
    for family, keys in FAMILY_KEYS.items():
        config = AutoConfig.for_model(family, **TINY, **keys, vocab_size=len(tok), pad_token_id=tok.pad_token_id,
                                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
        torch.manual_seed(0)
        out[family] = root / family
        AutoModelForCausalLM.from_config(config).save_pretrained(out[family])
        tok.save_pretrained(out[family])
    return out


def at(path: Path) -> list[str]:
    return ["+recipe=quickstart_sft", "model=pretrained", f"model.path={path}"]


# ---------------------------------------------------------------------------------------------
# Attention


def test_family_records_agree_with_what_transformers_publishes():
    """Family.sdpa / Family.flash are the model classes' _supports_sdpa / _supports_flash_attn."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    for family, record in FAMILIES.items():
        cls = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[family])
        assert (record.sdpa, record.flash) == (cls._supports_sdpa, cls._supports_flash_attn), family


def test_auto_picks_what_the_family_and_the_device_can_run():
    capped = attention_limits({"model_type": "gemma2", "attn_logit_softcapping": 50.0})
    assert capped == {"sdpa": "soft-caps attention logits (attn_logit_softcapping=50.0), which sdpa cannot"}
    assert attention_limits({"model_type": "gemma3_text", "attn_logit_softcapping": 30.0}) == \
        {"sdpa": "soft-caps attention logits (attn_logit_softcapping=30.0), which sdpa cannot"}  # read from the key, any family
    assert attention_limits({"model_type": "llama"}) == {}
    assert pick_attention("auto", "gemma2", capped, "needs CUDA") == \
        ("eager", "auto: gemma2 soft-caps attention logits (attn_logit_softcapping=50.0), which sdpa cannot; flash_attention_2 needs CUDA")
    assert pick_attention("auto", "gemma2", capped, None) == ("flash_attention_2", "auto: flash-attn runs here")
    assert pick_attention("auto", "llama", {}, "needs CUDA") == ("sdpa", "auto: flash_attention_2 needs CUDA")
    assert pick_attention("eager", "llama", {}, None) == ("eager", "model.attn_implementation=eager")
    assert preflight([]).model.attn_implementation.value == "auto"  # the default


def test_the_dry_run_refuses_sdpa_on_gemma2_and_says_what_auto_picks(models, tmp_path):
    refused = run_cli(*at(models["gemma2"]), "model.attn_implementation=sdpa", "launcher.dry_run=true", cwd=tmp_path, timeout=60)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert last_line(refused.stderr) == (
        "error: model.attn_implementation=sdpa cannot run this gemma2 model: it soft-caps attention logits "
        "(attn_logit_softcapping=50.0), which sdpa cannot: use model.attn_implementation=eager, "
        "or auto (flash_attention_2 where flash-attn runs, else eager)")
    shown = run_cli(*at(models["gemma2"]), "launcher.dry_run=true", cwd=tmp_path, timeout=60)
    assert shown.returncode == 0, shown.stderr
    assert "# attention: eager (auto: gemma2 soft-caps attention logits (attn_logit_softcapping=50.0), which sdpa cannot; " \
           "flash_attention_2 needs CUDA)" in shown.stdout


def test_the_plan_says_which_attention_and_counts_eager(models):
    from finetune.planner.activations import block_activation_bytes
    from finetune.planner.counts import architecture
    from finetune.planner.peak import plan

    cfg = preflight(at(models["gemma2"]))
    assert "attention: eager (auto: gemma2 soft-caps attention logits (attn_logit_softcapping=50.0), which sdpa cannot; " \
           "flash_attention_2 needs CUDA)" in plan(cfg).notes
    eager = preflight([*at(models["gemma2"]), "model.attn_implementation=eager"])
    arch = architecture(cfg.model)
    assert block_activation_bytes(arch, cfg, 64, 64) == block_activation_bytes(arch, eager, 64, 64)  # auto is eager here


@pytest.mark.slow
def test_gemma2_trains_with_the_default_attention_through_the_cli(models, tmp_path):
    out = run_cli(*at(models["gemma2"]), *SHORT, f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "[finetune] attention: eager (auto: gemma2 soft-caps attention logits" in out.stdout
    losses = [m["loss"] for m in read_metrics(tmp_path / "run") if m["kind"] == "train"]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses), losses


# ---------------------------------------------------------------------------------------------
# Mixture of experts


def lora(path: Path, *overrides: str):
    """The model at `path` with the adapters of `peft=lora OVERRIDES`, and the config."""
    from transformers import AutoModelForCausalLM

    from finetune.rank.model import apply_strategies

    cfg = preflight([*at(path), "peft=lora", *overrides])
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return apply_strategies(model, checkpointing=cfg.checkpointing, peft=cfg.peft), cfg


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_lora_adapts_the_experts_and_the_planner_counts_as_peft(models, family):
    from finetune.rank.model import trainable_parameters
    from finetune.planner.counts import architecture, count_params

    net, cfg = lora(models[family])  # peft.dropout=0.05, the recipe's default: on the linear adapters only
    tuner = net.base_model
    experts = [n for n in tuner.targeted_parameter_names if ".mlp.experts." in n]
    assert len(experts) == 2 * TINY["num_hidden_layers"]  # gate_up_proj and down_proj of every layer
    assert not any(".mlp.gate." in n for n in tuner.targeted_parameter_names)  # the router stays as pretrained
    counts = count_params(architecture(cfg.model), cfg)
    assert trainable_parameters(net) == net.get_nb_trainable_parameters() == (counts.trainable, counts.total)
    dropouts = [m for m in net.modules() if isinstance(m, torch.nn.Dropout)]
    assert dropouts and all(d.p == 0.05 for d in dropouts)
    assert net.peft_config["default"].lora_dropout == 0.0  # so that PEFT can load the adapter back
    names = ["experts"] if family == "mixtral" else ["q_proj", "gate_up_proj"]  # by module, or by weight
    net, cfg = lora(models[family], f"peft.target_modules=[{','.join(names)}]")
    counts = count_params(architecture(cfg.model), cfg)
    assert trainable_parameters(net) == (counts.trainable, counts.total)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_moe_lora_trains_the_experts_and_reports_the_router_loss(models, family, tmp_path):
    from safetensors.torch import load_file

    train_here([*at(models[family]), *SHORT, *SMALL_EVAL, "peft=lora"], tmp_path / "run")
    rows = read_metrics(tmp_path / "run")
    train = [m for m in rows if m["kind"] == "train"]
    assert len(train) == 2 and all(math.isfinite(m["loss"]) and math.isfinite(m["router_aux_loss"]) for m in train)
    assert all("eval_router_aux_loss" in m for m in rows if m["kind"] == "eval")
    adapter = load_file(tmp_path / "run" / "final" / "adapter_model.safetensors")
    lora_b = [v for k, v in adapter.items() if ".experts." in k and "lora_B" in k]
    assert len(lora_b) == 2 * TINY["num_hidden_layers"] and all(v.abs().sum() > 0 for v in lora_b)  # zero at init: trained


def test_the_router_loss_is_added_when_the_config_asks(models):
    """transformers' rule: router_aux_loss_coef x the load-balancing loss joins the loss when output_router_logits is true."""
    from transformers import AutoModelForCausalLM

    from finetune.data.batches import collate
    from finetune.data.sources import load_rows
    from finetune.data.examples import tokenize
    from finetune.rank.model import load_tokenizer
    from finetune.methods.sft import SFT
    from finetune.methods.losses import router_loss

    cfg = preflight(at(models["mixtral"]))
    model = AutoModelForCausalLM.from_pretrained(models["mixtral"], dtype=torch.float32).eval()
    assert router_loss(model.config).added is False  # output_router_logits is false by default: reported, not added
    model.config.output_router_logits = True
    router = router_loss(model.config)
    assert router.coef == model.config.router_aux_loss_coef and router.added
    tok = load_tokenizer(cfg.model)
    rows, _ = tokenize(load_rows(cfg.data.eval, "train", "data.eval").subset([0, 1, 2, 3]), tok, cfg.data, "data.eval")
    batch = collate(rows, tok.pad_token_id)
    with torch.no_grad():
        plain, _ = SFT()(model, batch)
        added, metrics = SFT(router)(model, batch)
    units = SFT().count(batch)
    aux = metrics["router_aux_loss"] / units
    assert 1.0 <= aux <= 4.0  # top-2 of 4 experts, balanced: about k = 2
    assert torch.allclose(added, plain + router.coef * aux * units)
    assert router_loss(AutoModelForCausalLM.from_pretrained(models["gemma2"]).config) is None  # no router, no metric


def test_dora_on_experts_is_refused_before_launch(models):
    with pytest.raises(ConfigError) as e:
        preflight([*at(models["mixtral"]), "peft=dora"])
    assert str(e.value) == ("peft=dora cannot adapt this mixtral model's experts (fused weights, which PEFT adapts through "
                            "target_parameters, without DoRA): use peft=lora, or name linear layers only, e.g. "
                            "peft.target_modules=[q_proj,k_proj,v_proj,o_proj]")
    preflight([*at(models["mixtral"]), "peft=dora", "peft.target_modules=[q_proj,v_proj]"])  # attention only: fine


def test_lora_on_experts_under_tp_is_refused_before_launch(models):
    """transformers shards the experts' fused weights with its own style; PEFT's adapter cannot follow (the
    rank refuses it too: tests/test_families_parallel.py); a local config.json says so before launch."""
    layout = ["parallelism=tp2", "launcher.nproc_per_node=2"]
    with pytest.raises(ConfigError) as e:
        preflight([*at(models["mixtral"]), *layout, "peft=lora"])
    assert str(e.value) == ("peft=lora with peft.target_modules=['all-linear'] adapts this mixtral model's experts (fused 3-D "
                            "weights), which parallelism.tp=2 shards with transformers' expert style that PEFT's adapter cannot "
                            "follow: name the linear layers (e.g. peft.target_modules=[q_proj,k_proj,v_proj,o_proj]), or use "
                            "parallelism=fsdp")
    preflight([*at(models["mixtral"]), *layout, "peft=lora", "peft.target_modules=[q_proj,v_proj]"])  # attention only: fine


def test_qlora_leaves_the_experts_unquantized_and_the_planner_counts_their_bytes(models, tmp_path):
    """bitsandbytes 4-bit quantizes nn.Linear layers only; a MoE's experts are 3-D parameters, so they stay
    fp32 (4 bytes each): the plan says so, and its weights are the bytes the model holds."""
    from finetune.rank.model import apply_strategies, load_model, load_tokenizer
    from finetune.planner.peak import plan

    cfg = preflight([*at(models["qwen3_moe"]), "peft=qlora", "parallelism=single", "launcher.nproc_per_node=1"])
    tok = load_tokenizer(cfg.model)
    base = load_model(cfg.model, tok, attention="sdpa", peft=cfg.peft, compute_dtype=torch.float32, zero3=False,
                      run_dir=tmp_path, is_main=True, barrier=lambda: None)
    experts = [p for n, p in base.named_parameters() if ".experts." in n]
    assert experts and all(p.dtype == torch.float32 and p.ndim == 3 for p in experts)
    net = apply_strategies(base, checkpointing=cfg.checkpointing, peft=cfg.peft)
    held = sum(p.numel() * p.element_size() for p in net.parameters())
    held += sum(t.numel() * t.element_size() for m in net.modules() if type(m).__name__ == "Linear4bit"
                for t in (m.weight.quant_state.absmax, m.weight.quant_state.state2.absmax))  # 4-bit blocks' constants
    planned = plan(cfg)
    assert abs(planned.weights - held) / held < 0.01, (planned.weights, held)
    expert_bytes = 4 * sum(p.numel() for p in experts)
    assert expert_bytes > 0.3 * held  # counting them 4-bit would miss by far
    assert any(n.startswith("QLoRA: bitsandbytes quantizes nn.Linear layers only: this qwen3_moe model's experts ("
                            f"{expert_bytes // 4:,} parameters") and n.endswith("stay unquantized, fp32: 4 bytes each, counted so")
               for n in planned.notes), planned.notes


# ---------------------------------------------------------------------------------------------
# PEFT targets


def test_all_linear_is_the_default():
    assert PeftConfig().target_modules == ["all-linear"]
    for option in ("lora", "dora", "qlora"):
        assert preflight([f"peft={option}"]).peft.target_modules == ["all-linear"]


def test_targets_that_match_nothing_name_what_exists_before_launch_and_on_the_rank_alike(tmp_path):
    """For every counted family: the launcher's refusal (from config.json as a file) is the rank's (from the modules)."""
    from test_family_params import CASES, build

    from finetune.rank.model import lora_targets

    for i, (family, keys) in enumerate(CASES):
        model = build(family, keys, tmp_path / str(i))
        with pytest.raises(ConfigError) as launcher:
            preflight([*at(tmp_path / str(i)), "peft=lora", "peft.target_modules=[q_proj,W_pack]"])
        with pytest.raises(ConfigError) as rank:
            lora_targets(model, PeftConfig(name=PeftMethod.lora, target_modules=["q_proj", "W_pack"]))
        assert str(launcher.value) == str(rank.value), family
    assert str(launcher.value) == ("peft.target_modules: q_proj, W_pack match no module of this gpt2 model: its linear "
                                   "layers are c_attn, c_fc, c_proj, lm_head (or use [all-linear])")
    model = build("mixtral", dict(num_local_experts=4), tmp_path / "m")
    with pytest.raises(ConfigError) as e:
        lora_targets(model, PeftConfig(name=PeftMethod.lora, target_modules=["W_pack"]))
    assert str(e.value) == ("peft.target_modules: W_pack matches no module of this mixtral model: its linear layers are "
                            "k_proj, lm_head, o_proj, q_proj, v_proj; its experts' fused weights down_proj, gate_up_proj "
                            "(experts: all of them); its router gate (or use [all-linear])")


def test_a_pipeline_says_it_does_not_report_the_router_loss(models, tmp_path):
    """Pipeline stages hand each other hidden states: the routers' logits stay in their stage, so the loss
    is not reported (rather than reported as 0), and a config that adds it to the loss is refused."""
    import json
    import shutil

    args = [*at(models["mixtral"]), *SHORT[2:], "parallelism=pp2", "train.micro_batch_size=4", "train.global_batch_size=8",
            "data.max_length=64"]
    out = launch_here(*args, f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "router aux loss: not reported under parallelism.pp=2 (each stage keeps its routers' logits)" in out.stdout
    assert not any("router_aux_loss" in m for m in read_metrics(tmp_path / "run") if m["kind"] == "train")
    added = tmp_path / "added"
    shutil.copytree(models["mixtral"], added)
    config = json.loads((added / "config.json").read_text())
    (added / "config.json").write_text(json.dumps({**config, "output_router_logits": True}))
    out = run_cli(*at(added), *args[3:], f"hydra.run.dir={tmp_path / 'added_run'}", cwd=tmp_path)  # refused before launch
    assert out.returncode != 0 and not (tmp_path / "added_run" / "ranks").exists()
    assert last_line(out.stderr) == ("error: parallelism.pp=2: this MoE adds its router loss to the loss (config.json sets "
                                     "output_router_logits), which pipeline stages cannot collect (each keeps its routers' "
                                     "logits): set output_router_logits false in config.json, or use parallelism=fsdp or tp")
