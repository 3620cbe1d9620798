"""Tensor and pipeline parallel for families other than Llama: the layout comes from what
transformers publishes for the family (its block class, tp plan and pipeline plan), the loss of
tp2 / pp2 equals one process's, and a family that cannot be split is refused by the dry run."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import last_line, read_metrics, reload_and_evaluate, run_cli, train_here
from ranks import launch_here
from finetune.config import ConfigError
from finetune.families import FAMILIES
from finetune.rank import parallel

STEPS = ["+recipe=quickstart_sft", "train.max_steps=2", "optim.warmup_steps=0", "train.micro_batch_size=8",
         "train.exact_match_samples=0", "train.progress_bar=false", "train.eval_every=0", "train.tensorboard=false"]
SINGLE = ["parallelism=single", "launcher.nproc_per_node=1"]

GPT2_TP = ("error: parallelism.tp=2: transformers publishes no tensor-parallel plan for model_type=gpt2 and its fused Conv1D "
           "layers (c_attn, c_proj, c_fc) are not the Llama layout our own plan splits: use parallelism=fsdp or ddp")
GPT2_PP = ("error: parallelism.pp=2: transformers publishes no pipeline plan for model_type=gpt2 (which modules run before and "
           "after its blocks), so it cannot be cut into stages: use parallelism=fsdp or ddp")


def meta_model(family: str, **keys):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(family, **{"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
                                             "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100,
                                             "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, **keys})
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_records_agree_with_what_transformers_publishes(family):
    """The dry run refuses from families.FAMILIES (no transformers there): the records must say what transformers says."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(family)
    assert FAMILIES[family].tp_plan == bool(config.base_model_tp_plan)
    assert FAMILIES[family].pp_plan == bool(config.base_model_pp_plan)


def test_layouts_are_read_from_the_family():
    assert parallel.block_list(meta_model("llama"))[0] == "model.layers"
    assert parallel.block_list(meta_model("gpt_neox"))[0] == "gpt_neox.layers"
    assert parallel.block_list(meta_model("gpt2"))[0] == "transformer.h"
    phi3, source = parallel.block_tp_plan(meta_model("phi3"))
    assert source == "transformers' plan"
    assert phi3["self_attn.qkv_proj"] == "colwise_gather_output" and phi3["self_attn.o_proj"] == "rowwise_split_input"
    assert parallel.block_tp_plan(meta_model("qwen3"))[0]["self_attn.q_norm"] == parallel.PARTIAL_GRADIENT
    assert parallel.pipe_layout(meta_model("gpt_neox")) == parallel.PipeLayout(
        body="gpt_neox", blocks="gpt_neox.layers", before=("gpt_neox.embed_in", "gpt_neox.emb_dropout"),
        after=("gpt_neox.final_layer_norm", "lm_head"))
    with pytest.raises(ConfigError, match="transformers publishes no tensor-parallel plan for model_type=gpt2"):
        parallel.block_tp_plan(meta_model("gpt2"))
    # No published plan: ours for a Llama block only (Qwen3's q/k norms would need transformers' handling)
    llama, qwen3 = meta_model("llama"), meta_model("qwen3")
    llama.config.base_model_tp_plan = qwen3.config.base_model_tp_plan = None
    assert parallel.block_tp_plan(llama) == (parallel.OWN_TP_PLAN, "our Llama plan")
    with pytest.raises(ConfigError) as e:
        parallel.block_tp_plan(qwen3)
    assert str(e.value) == ("parallelism.tp: transformers publishes no tensor-parallel plan for model_type=qwen3 (base_model_tp_plan), "
                            "and its blocks are not Llama blocks, the only ones our own plan splits (they hold mlp.down_proj, "
                            "mlp.gate_proj, mlp.up_proj, self_attn.k_norm, self_attn.k_proj, self_attn.o_proj, self_attn.q_norm, "
                            "self_attn.q_proj, self_attn.v_proj): use parallelism=fsdp or ddp")
    with pytest.raises(ConfigError, match="transformers publishes no pipeline plan for model_type=gpt2"):
        parallel.pipe_layout(meta_model("gpt2", tie_word_embeddings=False))


@pytest.mark.parametrize("layout,line", [("parallelism=tp2", GPT2_TP), ("parallelism=pp2", GPT2_PP)], ids=["tp2", "pp2"])
def test_gpt2_is_refused_by_the_dry_run(layout, line, tmp_path):
    out = run_cli("+recipe=quickstart_sft", "model.init.model_type=gpt2", layout, "launcher.dry_run=true",
                  f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert out.returncode == 2 and "torch.distributed.run" not in out.stdout
    assert last_line(out.stderr) == line
    assert "Traceback" not in out.stderr


def losses(run_dir):
    return [m["loss"] for m in read_metrics(run_dir) if m["kind"] == "train"]


def eval_after(run_dir):
    return json.loads((run_dir / "summary.json").read_text())["after"]["eval_loss"]


def run(tmp_path, name, *overrides):
    out = launch_here(*STEPS, *overrides, f"hydra.run.dir={tmp_path / name}", cwd=tmp_path)
    assert out.returncode == 0, name + out.stdout[-2000:] + out.stderr[-3000:]
    return tmp_path / name


def single(tmp_path, *overrides):
    """The one-process run the layouts are compared with: the rank's code in this process (the maths, not the launch)."""
    train_here([*STEPS, *overrides, *SINGLE], tmp_path / "single")
    return tmp_path / "single"


# (family, extra overrides, layouts compared with one process): phi3's fused qkv/gate_up (gathered by
# its plan), olmo2's q/k norms over the full width (gathered), mixtral's packed experts (sharded by
# its plan; see below), gpt_neox's blocks at gpt_neox.layers with a fused colwise qkv and partial rotary.
CASES = [
    ("phi3", [], {"tp2": ["parallelism=tp2"], "pp2": ["parallelism=pp2"],
                  "tp2_pp2": ["parallelism=tp2_pp2", "launcher.nproc_per_node=4"]}),  # TP inside pipeline stages
    ("olmo2", [], {"tp2": ["parallelism=tp2"]}),
    ("gpt_neox", [], {"pp2": ["parallelism=pp2"]}),
]


@pytest.mark.slow
@pytest.mark.parametrize("family,extra,layouts", CASES, ids=[c[0] for c in CASES])
def test_family_layouts_follow_the_single_process_run(family, extra, layouts, tmp_path):
    common = [f"model.init.model_type={family}", *extra]
    reference = single(tmp_path, *common)
    for name, layout in layouts.items():
        got = run(tmp_path, name, *common, *layout)
        # fp32 on both sides; only the order of float sums differs (the tolerance of tests/test_parallel.py)
        assert losses(got) == pytest.approx(losses(reference), rel=1e-4), name
        assert eval_after(got) == pytest.approx(eval_after(reference), rel=1e-4), name
        # one Hugging Face checkpoint, gathered from TP shards / pipeline stages
        assert reload_and_evaluate(got / "final", got)[0] == pytest.approx(eval_after(reference), rel=1e-4), name


@pytest.mark.slow
def test_moe_experts_under_tp_follow_one_process_and_resume(tmp_path):
    """Mixtral's experts sharded by transformers' plan (packed gate/up: strided shards, saved whole
    in the distributed checkpoint): the one-process loss, and a resume reproduces the last step."""
    common = ["model.init.model_type=mixtral", "train.max_steps=3"]  # step 3 after the resume uses the restored optimizer
    reference = single(tmp_path, *common)
    tp2 = run(tmp_path, "tp2", *common, "parallelism=tp2", "train.save_every=1")
    assert losses(tp2) == pytest.approx(losses(reference), rel=1e-4)
    assert reload_and_evaluate(tp2 / "final", tp2)[0] == pytest.approx(eval_after(reference), rel=1e-4)
    resumed = run(tmp_path, "resumed", *common, "parallelism=tp2", f"train.resume={tp2 / 'checkpoints/step_1'}")
    assert losses(resumed) == pytest.approx(losses(tp2)[1:], rel=1e-6)


@pytest.mark.slow
def test_lora_on_experts_under_tp_is_one_line(tmp_path):
    """transformers shards Mixtral's experts as fused 3-D parameters; PEFT's adapter on them cannot follow."""
    out = launch_here(*STEPS, "model.init.model_type=mixtral", "parallelism=tp2", "peft=lora", "peft.dropout=0.0",
                  f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert out.returncode != 0
    assert last_line(out.stderr) == (
        "error: engine: peft: an adapter on mixtral's mlp.experts cannot follow transformers' tensor-parallel style for it "
        "(moe_tp_experts): leave it out of peft.target_modules (e.g. peft.target_modules=[q_proj,k_proj,v_proj,o_proj]), "
        "or use parallelism=fsdp")
