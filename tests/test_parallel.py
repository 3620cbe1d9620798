"""FSDP2, tensor parallel and pipeline parallel on CPU (gloo): the same loss curve as one process,
one Hugging Face checkpoint from any layout, resume from torch.distributed.checkpoint, and the
layouts that cannot work refused before any rank starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from finetune.config import ConfigError
from finetune.rank.parallel import bubble_fraction, split_blocks

from conftest import last_line, read_metrics, reload_and_evaluate, run_cli, train_here
from ranks import launch_here

# A 4-block tiny Llama (4 heads, 2 key/value heads), 4 steps, 2 micro-batches per rank and step.
STEPS = ["+recipe=quickstart_sft", "model.init.num_hidden_layers=4", "train.max_steps=4", "optim.warmup_steps=1",
         "train.micro_batch_size=8", "train.exact_match_samples=0", "train.progress_bar=false", "train.eval_every=0"]


def losses(run_dir):
    return [m["loss"] for m in read_metrics(run_dir) if m["kind"] == "train"]


def grad_norms(run_dir):
    return [m["grad_norm"] for m in read_metrics(run_dir) if m["kind"] == "train"]


def summary(run_dir):
    return json.loads((run_dir / "summary.json").read_text())


def test_block_split_and_bubble():
    assert [list(r) for r in split_blocks(5, 2)] == [[0, 1, 2], [3, 4]]
    assert [len(r) for r in split_blocks(80, 16)] == [5] * 16
    assert bubble_fraction(num_stages=2, microbatches=2, per_rank=1) == pytest.approx(1 / 3)
    assert bubble_fraction(num_stages=4, microbatches=4, per_rank=2) == pytest.approx(1 / 9)  # interleaving halves it
    assert bubble_fraction(num_stages=16, microbatches=64, per_rank=1) == pytest.approx(15 / 79)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["parallelism=tp4", "launcher.nproc_per_node=4"],
         "parallelism.tp=4 must divide the model's num_key_value_heads=2: use a tp that divides 2"),
        (["parallelism=pp4", "launcher.nproc_per_node=4"],
         "parallelism.pp=4 x pp_stages_per_rank=1 = 4 pipeline stages, but the model has 2 blocks: use at most 2 stages"),
        (["parallelism=tp2", "launcher.nproc_per_node=3", "train.global_batch_size=48"],
         "parallelism.tp=2 x parallelism.pp=1 = 2 ranks per model replica does not divide the launch size 3 "
         "(launcher.nproc_per_node=3 x launcher.nnodes=1): launch a multiple of 2 ranks"),
        (["parallelism=tp2", "zero=stage2"],
         "zero=stage2 does not compose with parallelism.tp=2: ZeRO shards over data-parallel ranks on the DeepSpeed engine; "
         "FSDP2, tensor, pipeline and context parallel run on the mesh engine: use parallelism=ddp with zero, or zero=none"),
        (["parallelism=fsdp", "precision=fp16"],
         "precision=fp16 is not supported with parallelism.strategy=fsdp tp=1 pp=1 (no sharded loss scaler here): use precision=bf16"),
        (["parallelism=pp2", "parallelism.pp_schedule=interleaved_1f1b"],
         "parallelism.pp_schedule=interleaved_1f1b with pp_stages_per_rank=1: interleaved_1f1b needs 2 or more stages per rank, "
         "gpipe and 1f1b exactly 1"),
        (["parallelism=pp2", "train.micro_batch_size=32", "train.global_batch_size=32"],
         "parallelism.pp_schedule=1f1b needs at least as many micro-batches per step as pipeline stages (2), got 1 "
         "(train.global_batch_size=32 / (train.micro_batch_size=32 x data-parallel 1)): lower train.micro_batch_size"),
        (["parallelism=ddp", "parallelism.fsdp_offload=true"],
         "parallelism.fsdp_offload=true has no effect with strategy=ddp (only with fsdp): remove it or change the option"),
        (["parallelism=tp2", "peft=qlora"],
         "peft=qlora is not supported with tensor parallel (parallelism.tp=2): bitsandbytes keeps a 4-bit weight as one flat "
         "buffer of packed pairs with per-block constants, which has no rows or columns to split (no maintained library splits "
         "it): use peft=qlora with parallelism=fsdp or pp, or peft=lora with tp"),
        (["parallelism=tp2", "peft=dora"],
         "peft=dora is not supported with tensor parallel (its weight norm spans the sharded dimension): use peft=lora with tp, "
         "or dora with fsdp/ddp"),
    ],
)
def test_layouts_that_cannot_work_are_refused(compose, overrides, message):
    with pytest.raises(ConfigError) as e:
        compose(["+recipe=quickstart_sft", "train.exact_match_samples=0", *overrides])
    assert str(e.value) == message


def test_refused_before_any_rank_starts(tmp_path):
    out = run_cli("+recipe=quickstart_sft", "parallelism=pp4", "launcher.nproc_per_node=4", f"hydra.run.dir={tmp_path / 'run'}",
                  cwd=tmp_path)
    assert out.returncode == 2 and "torch.distributed.run" not in out.stdout
    assert last_line(out.stderr).startswith("error: parallelism.pp=4 x pp_stages_per_rank=1 = 4 pipeline stages")
    assert not (tmp_path / "run").exists()


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    run = tmp_path_factory.mktemp("single") / "run"
    train_here([*STEPS, "parallelism=single", "launcher.nproc_per_node=1"], run)  # the rank's code in this process: the maths, not the launch
    return run


# The status line each pipeline layout prints at start: STEPS has global batch 32 and micro batch 8
# (4 micro-batches on one data-parallel replica); bubble (ranks - 1) / (micro-batches + ranks - 1), and
# with v stages per rank (interleaved; micro batch 4: 8 micro-batches) (ranks - 1) / (v x micro-batches + ranks - 1).
PIPELINE_LINE = {
    "pp2-1f1b": "pipeline: 2 stages on 2 ranks, 4 micro-batches per step, 1f1b, bubble 20.0%",
    "pp2-compile": "pipeline: 2 stages on 2 ranks, 4 micro-batches per step, 1f1b, bubble 20.0%",
    "pp2-gpipe": "pipeline: 2 stages on 2 ranks, 4 micro-batches per step, gpipe, bubble 20.0%",
    "pp2-interleaved": "pipeline: 4 stages on 2 ranks, 8 micro-batches per step, interleaved_1f1b, bubble 5.9%",
}


_layout_runs: dict[tuple[str, ...], tuple[Path, str]] = {}


def layout_run(args: list[str], tmp_path_factory) -> tuple[Path, str]:
    """(run directory, stdout) of STEPS under `args`, saving a checkpoint every 2 steps: launched once per test process,
    for the layout's comparison with one process and as the uninterrupted run its resume continues."""
    key = tuple(args)
    if key not in _layout_runs:
        run = tmp_path_factory.mktemp("layout") / "run"
        out = launch_here(*STEPS, *args, "train.save_every=2", f"hydra.run.dir={run}", cwd=run.parent)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        _layout_runs[key] = run, out.stdout
    return _layout_runs[key]


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [["parallelism=fsdp"], ["parallelism=fsdp_offload"], ["parallelism=fsdp", "parallelism.fsdp_reshard_after_forward=false"],
     ["parallelism=tp2"], ["parallelism=pp2"], ["parallelism=pp2", "parallelism.pp_schedule=gpipe"],
     ["parallelism=pp2_interleaved", "train.micro_batch_size=4"], ["parallelism=tp2", "launcher.nproc_per_node=4"],
     ["parallelism=fsdp", "train.compile=true", "checkpointing=full", "data.padding_free=false"],  # padded: see test_compile
     ["parallelism=pp2", "train.compile=true"]],
    ids=["fsdp", "fsdp-offload", "fsdp-no-reshard", "tp2", "pp2-1f1b", "pp2-gpipe", "pp2-interleaved", "tp2xdp2",
         "fsdp-compile-checkpointing", "pp2-compile"],
)
def test_layout_follows_the_single_process_run_and_exports_one_checkpoint(layout, one_process, tmp_path_factory, request):
    run, stdout = layout_run(layout, tmp_path_factory)
    # fp32 on both sides; only the order of float sums differs (measured: equal to 4 decimals).
    assert losses(run) == pytest.approx(losses(one_process), rel=1e-4)
    assert grad_norms(run) == pytest.approx(grad_norms(one_process), rel=1e-3)
    after = summary(run)["after"]["eval_loss"]
    assert after == pytest.approx(summary(one_process)["after"]["eval_loss"], rel=1e-4)
    # One Hugging Face checkpoint, gathered from shards / stages, gives the same eval loss on one process.
    assert reload_and_evaluate(run / "final", run)[0] == pytest.approx(after, rel=1e-4)
    layout_id = request.node.callspec.id
    if "compile" in layout_id:  # the layers compiled inside FSDP2's units / a pipeline's stages
        assert next(m for m in read_metrics(run) if m["kind"] == "train")["compile_s"] > 0
    assert [line for line in stdout.splitlines() if line.startswith("pipeline: ")] == (
        [PIPELINE_LINE[layout_id]] if layout_id in PIPELINE_LINE else [])


@pytest.mark.slow
@pytest.mark.parametrize("layout,resume_with", [("fsdp", ["launcher.nproc_per_node=1"]), ("pp2", []),
                                                 ("tp2", ["parallelism=fsdp", "launcher.nproc_per_node=1"]),
                                                 ("pp2 peft=lora", []), ("fsdp peft=qlora peft.dropout=0", ["launcher.nproc_per_node=1"])],
                         ids=["fsdp-2-ranks-resumed-on-1", "pp2", "tp2-resumed-on-1", "pp2-lora", "fsdp-qlora-resumed-on-1"])
def test_resume_from_the_layouts_distributed_checkpoint(layout, resume_with, tmp_path, tmp_path_factory):
    """DCP shards reshard on load: FSDP saved on 2 ranks resumes on 1, tensor-parallel shards resume
    on one process (the refusal under parallelism=single says so); the same trajectory. LoRA's optimizer
    has no parameter without weight decay: its empty group is left out (DCP could not load it back).
    The uninterrupted run is the layout test's, where it has one (fsdp, tp2, pp2)."""
    layout, *extra = layout.split()
    full, _ = layout_run([f"parallelism={layout}", *extra], tmp_path_factory)
    common = [*STEPS, f"parallelism={layout}", *extra, "train.save_every=2"]
    written = sorted(p.name for p in (full / "checkpoints/step_2").iterdir())
    assert written == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.json", "rng_0.pt", "rng_1.pt", "trainer_state.pt"]  # a shard per rank
    resumed = launch_here(*common, *resume_with, f"train.resume={full / 'checkpoints/step_2'}",
                      f"hydra.run.dir={tmp_path / 'resumed'}", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {full / 'checkpoints/step_2'} at step 2" in resumed.stdout
    assert [m["step"] for m in read_metrics(tmp_path / "resumed") if m["kind"] == "train"] == [3, 4]
    assert losses(tmp_path / "resumed") == pytest.approx(losses(full)[2:], rel=1e-6)
    assert summary(tmp_path / "resumed")["after"]["eval_loss"] == pytest.approx(summary(full)["after"]["eval_loss"], rel=1e-6)
    if layout == "tp2":  # the torch engine cannot read DCP shards: the refusal names the layout that can
        single = launch_here(*common, "parallelism=single", "launcher.nproc_per_node=1", f"train.resume={full / 'checkpoints/step_2'}",
                         f"hydra.run.dir={tmp_path / 'single'}", cwd=tmp_path)
        assert single.returncode != 0
        assert single.stderr.strip().splitlines()[-1] == (
            f"error: resume: train.resume: {full / 'checkpoints/step_2'} was saved with engine=mesh (mesh engine), this run "
            "has engine=torch: that checkpoint format cannot change it; resume under fsdp or tp with the same pp, on any number of "
            "ranks (DCP reshards): on one process, parallelism=fsdp launcher.nproc_per_node=1")


SINGLE_RUNS = {  # the one-process runs the layouts are compared with (made once per test process)
    "lora": ["peft=lora", "peft.dropout=0.0"],  # dropout draws differ per rank layout
    "bf16": ["precision=bf16"],
    "dora": ["peft=dora", "peft.dropout=0.0"],
    "dpo": ["method=dpo", "data=quickstart_dpo"],
    "qlora": ["peft=qlora", "peft.dropout=0.0"],
    "packed": ["data.packing=true"],
}
_single: dict[str, Path] = {}


def single_run(name: str, tmp_path_factory) -> Path:
    if name not in _single:
        run = tmp_path_factory.mktemp(f"single_{name}")
        train_here([*STEPS, "train.max_steps=3", "parallelism=single", "launcher.nproc_per_node=1", *SINGLE_RUNS[name]], run)
        _single[name] = run
    return _single[name]


@pytest.mark.slow
@pytest.mark.parametrize("layout,single,rel", [
    (["parallelism=fsdp", "peft=lora", "peft.dropout=0.0"], "lora", 1e-4),
    (["parallelism=tp2", "peft=lora", "peft.dropout=0.0"], "lora", 1e-4),
    (["parallelism=pp2", "peft=lora", "peft.dropout=0.0"], "lora", 1e-5),
    (["parallelism=pp2", "peft=dora", "peft.dropout=0.0"], "dora", 1e-5),
    (["parallelism=tp2_pp2", "launcher.nproc_per_node=4", "peft=lora", "peft.dropout=0.0"], "lora", 1e-5),
    # DPO with chunked logits under a pipeline: the last stage returns each row's log-probs (reference scoring too)
    (["parallelism=pp2", "method=dpo", "data=quickstart_dpo", "checkpointing=selective", "logits=chunked"], "dpo", 1e-4),
    # the 4-bit base sharded by FSDP2 (its packed bytes; the constants whole on each rank), or split into stages
    (["parallelism=fsdp", "peft=qlora", "peft.dropout=0.0", "train.memory_report=categories"], "qlora", 1e-5),
    (["parallelism=pp2", "peft=qlora", "peft.dropout=0.0"], "qlora", 1e-5),
    # packed rows: every stage hands the rows' position ids on with its hidden states (per-sample causal blocks)
    (["parallelism=pp2", "data.packing=true"], "packed", 1e-5),
    # bf16 autocast rounds each matmul to 8 bits of mantissa; splitting them over 2 ranks changes only
    # which partial products are rounded (measured: within 1e-3 relative), while a broken TP or
    # recompute would be off by far more
    (["parallelism=tp2", "precision=bf16", "checkpointing=full"], "bf16", 2e-3),
], ids=["fsdp_lora", "tp2_lora", "pp2_lora", "pp2_dora", "tp2_pp2_lora", "pp2_dpo", "fsdp_qlora", "pp2_qlora", "pp2_packed", "tp2_bf16_ckpt"])
def test_memory_strategies_combine_with_layouts(tmp_path, tmp_path_factory, layout, single, rel):
    """LoRA under FSDP2, TP, a pipeline and TP x PP (4 ranks), DoRA under a pipeline, QLoRA under FSDP2 and a pipeline, packed rows under
    a pipeline, bf16 + full checkpointing under TP, DPO with chunked logits under a pipeline: they run and match one process (the adapters exported in PEFT form, whole)."""
    reference = single_run(single, tmp_path_factory)
    out = launch_here(*STEPS, "train.max_steps=3", *layout, f"hydra.run.dir={tmp_path}", cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert losses(tmp_path) == pytest.approx(losses(reference), rel=rel)
    if single in ("lora", "dora", "qlora"):  # gathered from FSDP/TP shards; merged from the pipeline's stages
        from safetensors.torch import load_file

        ours, ref = (load_file(run / "final/adapter_model.safetensors") for run in (tmp_path, reference))
        assert set(ours) == set(ref)
        if single == "dora":
            assert any("lora_magnitude_vector" in k for k in ref)
        elif "parallelism=fsdp" not in layout or single == "qlora":
            assert all(torch.allclose(ours[k], ref[k], atol=1e-5) for k in ref)
    if single == "dpo":
        assert losses(tmp_path)[0] == pytest.approx(0.6931472, abs=1e-5)
    if layout[:2] == ["parallelism=fsdp", "peft=qlora"]:  # planned: 4-bit shards, constants whole, one 4-bit block gathered
        from finetune import config
        from finetune.planner.counts import architecture, fsdp_frozen_and_gathered
        from finetune.planner.records import MIB

        rows = read_metrics(tmp_path)
        planned, measured = (next(r for r in rows if r["kind"] == kind) for kind in ("plan", "memory"))
        cfg = config.load(tmp_path / "config.yaml")
        _, gathered = fsdp_frozen_and_gathered(architecture(cfg.model), cfg, 0.0, 4, 4)
        # MemTracker's peak is the loss's backward, when no block is gathered: the shards alone
        assert planned["plan_weights_mib"] - gathered / MIB == pytest.approx(measured["mem_params_mib"], rel=0.05)
        assert planned["plan_gradients_mib"] == pytest.approx(measured["mem_grads_mib"], rel=0.01)
        assert planned["plan_optimizer_mib"] == pytest.approx(measured["mem_optimizer_mib"], rel=0.01)
        assert planned["plan_peak_mib"] == pytest.approx(measured["mem_peak_total_mib"], rel=0.15)


def test_pipeline_scores_exact_match_on_the_exported_model(tmp_path):
    """No pipeline stage can generate: after training, rank 0 scores exact match on final/, on one process."""
    from dataclasses import replace

    from finetune import config
    from finetune.rank.heldout import exact_match_of_export

    run = tmp_path / "run"
    out = launch_here("+recipe=quickstart_sft", "parallelism=pp2", "train.max_steps=2", "optim.warmup_steps=0", "train.micro_batch_size=8",
                  "train.eval_every=0",
                  "train.exact_match_samples=6", "train.progress_bar=false", f"hydra.run.dir={run}", cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert f"exact match: pipeline stages cannot generate, so this rank evaluates {run / 'final'} on one process" in out.stdout
    assert "exact_match  (not measured) -> " in out.stdout  # the initial model is not scored: its stages cannot generate
    before, after = summary(run)["before"], summary(run)["after"]
    assert "exact_match" not in before
    cfg = config.load(run / "config.yaml")
    _, model, tok, evals = reload_and_evaluate(run / "final", run)
    assert after["exact_match"] == exact_match_of_export(run / "final", evals, cfg.train, torch.device("cpu"))
    # Make 2 of the 6 scored references what the exported model generates (one prompt at a time, greedy):
    # exactly those count, and the 7th (beyond train.exact_match_samples) does not.
    for e in evals[:2] + evals[6:7]:
        ids = torch.tensor([e.input_ids[: e.prompt_len]])
        made = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=cfg.train.max_new_tokens,
                              do_sample=False, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
        e.reference = tok.decode(made[0, ids.shape[1]:], skip_special_tokens=True)
    one_at_a_time = replace(cfg.train, eval_batch_size=1)
    assert exact_match_of_export(run / "final", evals, one_at_a_time, torch.device("cpu")) == pytest.approx(2 / 6)
