"""Every group option and recipe composes and validates; cross-group rules give one clear line."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from finetune.config import ASSETS, ConfigError, Strategy
from finetune.launcher.compose import RECIPES

# Options that need a value only the user can give.
NEEDS = {
    ("model", "pretrained"): ["model.path=/some/local/model"],
    ("data", "jsonl"): ["data.train=/some/train.jsonl"],
    ("zero", "stage3_nvme"): ["zero.nvme_path=/tmp"],
    ("launcher", "deepspeed"): ["zero=stage2"],
    ("data", "quickstart_dpo"): ["method=dpo"],
    ("method", "dpo"): ["data=quickstart_dpo"],
    ("data", "quickstart_kto"): ["method=kto"],
    ("method", "kto"): ["data=quickstart_kto"],
    ("data", "quickstart_tools"): ["model.init.max_position_embeddings=1536"],
    ("method", "orpo"): ["data=quickstart_dpo"],
    ("method", "reward"): ["data=quickstart_dpo"],
    ("method", "distill"): [f"method.teacher={ASSETS / 'models' / 'quickstart_tools_sft'}"],  # the shipped tokenizer's vocabulary
    # layouts with more ranks than the default launch, on a model they fit
    ("parallelism", "pp2_interleaved"): ["launcher.nproc_per_node=2", "model.init.num_hidden_layers=4", "train.global_batch_size=32",
                                         "train.micro_batch_size=8"],
    ("parallelism", "pp4"): ["launcher.nproc_per_node=4", "model.init.num_hidden_layers=4", "train.micro_batch_size=8"],
    ("parallelism", "tp2_pp2"): ["launcher.nproc_per_node=4", "train.micro_batch_size=8"],
    ("parallelism", "cp4"): ["launcher.nproc_per_node=4", "model.init.num_key_value_heads=4"],
    ("parallelism", "cp8"): ["launcher.nproc_per_node=8", "model.init.num_attention_heads=8", "model.init.num_key_value_heads=8"],
    ("parallelism", "tp4"): ["launcher.nproc_per_node=4", "model.init.num_hidden_layers=16", "model.init.num_attention_heads=8", "model.init.num_key_value_heads=8"],
    ("parallelism", "tp8"): ["launcher.nproc_per_node=8", "model.init.num_hidden_layers=16", "model.init.num_attention_heads=8", "model.init.num_key_value_heads=8"],
    ("parallelism", "tp8_pp16"): ["launcher.nproc_per_node=8", "launcher.nnodes=16", "model.init.num_hidden_layers=16", "model.init.num_attention_heads=8", "model.init.num_key_value_heads=8", "train.micro_batch_size=2",
                                  "launcher.master_port=29500"],
}
GROUPS = sorted(p.name for p in RECIPES.iterdir() if p.is_dir() and p.name != "recipe")


def options() -> list[tuple[str, str]]:
    return [(g, f.stem) for g in GROUPS for f in sorted((RECIPES / g).glob("*.yaml"))]


def test_every_group_has_options():
    assert set(GROUPS) >= {"model", "data", "method", "precision", "checkpointing", "zero", "parallelism", "peft", "optim", "launcher", "train"}
    for group in GROUPS:
        assert list((RECIPES / group).glob("*.yaml")), group


@pytest.mark.parametrize("group,option", options())
def test_every_group_option_composes_and_validates(compose, group, option):
    extra = NEEDS.get((group, option), [])
    if group == "parallelism" and option != "single" and not extra:
        extra = ["launcher.nproc_per_node=2", "train.global_batch_size=32"]
    cfg = compose([f"{group}={option}", *extra])
    assert cfg is not None


@pytest.mark.parametrize("recipe", sorted(f.stem for f in (RECIPES / "recipe").glob("*.yaml")))
def test_every_recipe_composes_validates_and_documents_itself(compose, recipe):
    if recipe.startswith("optuna_") and importlib.util.find_spec("hydra_plugins.hydra_optuna_sweeper") is None:
        pytest.skip("hydra-optuna-sweeper is not installed (pip install -e '.[sweep]')")
    cfg = compose([f"+recipe={recipe}"])
    text = (RECIPES / "recipe" / f"{recipe}.yaml").read_text().splitlines()
    assert text[0] == "# @package _global_"
    assert text[1].startswith("# ") and any(f"+recipe={recipe}" in line for line in text[:4])
    assert cfg.train.max_steps > 0


def test_every_yaml_option_starts_with_its_schema():
    for group in GROUPS:
        for f in (RECIPES / group).glob("*.yaml"):
            text = f.read_text()
            assert text.startswith("# "), f  # one comment line: what it is
            schema = f.stem if group == "method" else group  # a method's option composes its own class (base_dpo)
            assert f"defaults: [base_{schema}]" in text, f


def test_quickstart_recipe_values(compose):
    cfg = compose(["+recipe=quickstart_sft"])
    assert cfg.parallelism.strategy == Strategy.ddp
    assert cfg.world_size == 2 and cfg.data_parallel_size == 2
    assert cfg.grad_accum_steps == 1
    assert Path(cfg.data.train).is_file() and Path(cfg.model.tokenizer, "tokenizer.json").is_file()


def test_command_line_beats_recipe(compose):
    cfg = compose(["+recipe=quickstart_sft", "optim.lr=3e-4", "train.max_steps=50", "parallelism=single", "launcher.nproc_per_node=1"])
    assert cfg.optim.lr == 3e-4 and cfg.train.max_steps == 50
    assert cfg.parallelism.strategy == Strategy.single and cfg.world_size == 1


def test_accumulation_is_derived_from_global_batch(compose):
    cfg = compose(["parallelism=ddp", "launcher.nproc_per_node=2", "train.micro_batch_size=4", "train.global_batch_size=32"])
    assert cfg.grad_accum_steps == 4


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["train.global_batch_size=30"],
         "train.global_batch_size=30 is not a multiple of train.micro_batch_size=8 x data-parallel size 1 = 8: use e.g. train.global_batch_size=24"),
        (["launcher.nproc_per_node=2"],
         "parallelism=single runs one process, but the launcher starts 2 (launcher.nproc_per_node=2 x launcher.nnodes=1): use parallelism=ddp or launcher.nproc_per_node=1"),
        (["parallelism=ddp", "launcher.nproc_per_node=4", "train.global_batch_size=2", "train.micro_batch_size=1"],
         "train.global_batch_size=2 is smaller than the data-parallel size 4: every rank needs at least one sample per step"),
        (["model.path=/x"],
         "model.path='/x' and model.init are both set: choose one (model.init=null to load weights)"),
        (["model.from_scratch=true"],
         "model.from_scratch=true builds model.path's config.json with random weights, and model.path is null: set model.path (a "
         "directory or hub id with a config.json), or use model.init for a random-init text model"),
        (["model=tiny_vlm", "model.recipe_if_missing=quickstart_sft"],
         "model.from_scratch=true with model.recipe_if_missing=quickstart_sft: the recipe would train the weights that from_scratch "
         "does not read: remove one of them"),
        (["data.max_length=1024"],
         "data.max_length=1024 exceeds model.init.max_position_embeddings=512: lower one or raise the other"),
        (["train.max_steps=0"], "train.max_steps=0 must be at least 1"),
        (["optim.scheduler=linear", "optim.min_lr_ratio=0.1"],
         "optim.min_lr_ratio=0.1 applies to optim.scheduler=cosine only (got linear): set optim.min_lr_ratio=0 or optim.scheduler=cosine"),
        (["launcher.nnodes=2", "launcher.node_rank=2", "parallelism=ddp"],
         "launcher.node_rank=2 must be in [0, launcher.nnodes=2)"),
        (["peft.r=8"], "peft.r=8 has no effect with peft=none: remove it or change the option"),
        (["peft=lora", "peft.quant_type=fp4"], "peft.quant_type=fp4 has no effect with peft=lora (only with qlora): remove it or change the option"),
        (["checkpointing=full", "checkpointing.every=3"],
         "checkpointing.every=3 has no effect with checkpointing=full (only with selective): remove it or change the option"),
        (["zero.reduce_bucket_size=5"], "zero.reduce_bucket_size=5 has no effect with zero=none (no DeepSpeed): remove it or change the option"),
        (["zero=stage2", "zero.stage3_max_live_parameters=5"],
         "zero.stage3_max_live_parameters=5 has no effect with ZeRO stage 2 (stage 3 only): remove it or change the option"),
        (["precision=bf16", "precision.loss_scale_window=10"],
         "precision.loss_scale_window=10 has no effect with precision=bf16 (only with fp16): remove it or change the option"),
        (["data.eval=null", "train.exact_match_samples=8"],
         "train.exact_match_samples needs an eval set: set data.eval or data.eval_size"),
    ],
)
def test_cross_group_rules(compose, overrides, message):
    with pytest.raises(ConfigError) as e:
        compose(overrides)
    assert str(e.value) == message
