"""ZeRO through DeepSpeed: the generated JSON and argv (golden), the refusals, and real runs on
CPU (DeepSpeed's CPU accelerator, gloo) checked against the single-process torch engine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from finetune.config import ConfigError
from finetune.launcher.command import build
from finetune.layouts.zero import deepspeed_config

from conftest import REPO, read_metrics, run_cli, tiny_model, train_here
from ranks import launch_here


def test_stage3_offload_fp16_recipe_golden(compose):
    """The classic 'does not fit' recipe: the whole JSON and command, as its dry run shows them."""
    cfg = compose(["+recipe=zero3_offload_fp16"])
    spec = build(cfg, "/runs/z3", python="python", cpu_count=32, port=29400)
    assert spec.argv == [
        "python", "-m", "finetune.rank.deepspeed_runner", "--num_nodes=1", "--num_gpus=4",
        "--master_addr=127.0.0.1", "--master_port=29400", "--module", "finetune.train", "/runs/z3/config.yaml",
    ]
    assert json.loads(spec.files["deepspeed.json"]) == {
        "train_batch_size": 16,
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 4,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}},
        "steps_per_print": 101,
        "wall_clock_breakdown": False,
        "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000, "hysteresis": 1, "min_loss_scale": 1},
        "zero_optimization": {
            "stage": 3, "overlap_comm": True, "contiguous_gradients": True, "reduce_bucket_size": 500_000_000,
            "stage3_prefetch_bucket_size": 50_000_000, "stage3_param_persistence_threshold": 100_000,
            "stage3_max_live_parameters": 1_000_000_000, "stage3_max_reuse_distance": 1_000_000_000,
            "sub_group_size": 1_000_000_000, "stage3_gather_16bit_weights_on_model_save": True,
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "offload_param": {"device": "cpu", "pin_memory": True},
        },
    }


def test_json_follows_every_yaml_number(compose):
    """What the YAML says is what DeepSpeed runs, field by field."""
    cfg = compose([
        "parallelism=ddp", "launcher.nproc_per_node=2", "zero=stage2_offload", "precision=bf16",
        "train.micro_batch_size=3", "train.global_batch_size=24", "optim.lr=7e-5", "optim.betas=[0.8,0.95]",
        "optim.eps=1e-6", "optim.weight_decay=0.1", "optim.max_grad_norm=0.5", "zero.pin_memory=false",
        "zero.overlap_comm=false", "zero.contiguous_gradients=false", "zero.reduce_bucket_size=1234",
        "zero.allgather_bucket_size=5678",
    ])
    ds = deepspeed_config(cfg)
    assert (ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == (24, 3, 4)
    assert ds["gradient_clipping"] == 0.5
    assert ds["optimizer"]["params"] == {"lr": 7e-5, "betas": [0.8, 0.95], "eps": 1e-6, "weight_decay": 0.1}
    assert ds["bf16"] == {"enabled": True} and "fp16" not in ds
    assert ds["zero_optimization"] == {
        "stage": 2, "overlap_comm": False, "contiguous_gradients": False, "reduce_bucket_size": 1234,
        "allgather_bucket_size": 5678, "offload_optimizer": {"device": "cpu", "pin_memory": False},
    }
    cfg = compose(["zero=stage3_nvme", "zero.nvme_path=/tmp", "optim.max_grad_norm=null", "precision=fp16",
                   "precision.initial_scale_power=12", "precision.loss_scale_window=50"])
    ds = deepspeed_config(cfg)
    assert ds["gradient_clipping"] == 0.0
    assert ds["fp16"]["initial_scale_power"] == 12 and ds["fp16"]["loss_scale_window"] == 50
    assert ds["zero_optimization"]["offload_param"] == {"device": "nvme", "pin_memory": True, "nvme_path": "/tmp"}
    assert ds["zero_optimization"]["offload_optimizer"] == {"device": "nvme", "pin_memory": True, "nvme_path": "/tmp"}


def test_multi_node_deepspeed_argv(compose, tmp_path):
    hostfile = tmp_path / "hosts.ds"
    hostfile.write_text("node-a slots=8\nnode-b slots=8\n")
    cfg = compose(["zero=stage1", "parallelism=ddp", "launcher.nnodes=2", "launcher.node_rank=1", "launcher.nproc_per_node=8",
                   f"launcher.hostfile={hostfile}", "launcher.no_ssh=true", "launcher.master_addr=10.1.1.1",
                   "launcher.master_port=29501", "train.global_batch_size=128"])
    spec = build(cfg, "/r", python="python", cpu_count=64)
    assert spec.argv == [
        "python", "-m", "finetune.rank.deepspeed_runner", "--num_nodes=2", "--num_gpus=8", f"--hostfile={hostfile}",
        "--no_ssh", "--node_rank=1", "--master_addr=10.1.1.1", "--master_port=29501", "--module", "finetune.train", "/r/config.yaml",
    ]


def test_auto_launcher_picks_deepspeed_for_zero_and_torchrun_otherwise(compose):
    assert "finetune.rank.deepspeed_runner" in build(compose(["zero=stage0"]), "/r", python="p", cpu_count=1).argv
    two = ["parallelism=ddp", "launcher.nproc_per_node=2", "train.global_batch_size=32"]
    assert "torch.distributed.run" in build(compose(["zero=none", *two]), "/r", python="p", cpu_count=1).argv
    torchrun = build(compose(["zero=stage2", "launcher=torchrun", *two]), "/r", python="p", cpu_count=1)
    assert "torch.distributed.run" in torchrun.argv and "deepspeed.json" not in torchrun.files


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["zero=stage3_nvme"], "NVMe offload needs a directory on a fast local disk: set zero.nvme_path=/local/nvme"),
        (["zero=stage1", "zero.offload_optimizer=cpu"],
         "zero.offload_optimizer=cpu needs ZeRO stage 2 or 3 (got stage 1): use zero=stage2_offload or zero=stage3_offload"),
        (["zero=stage2", "zero.offload_param=cpu"], "zero.offload_param=cpu needs ZeRO stage 3 (got stage 2): use zero=stage3_offload"),
        (["zero=stage2", "parallelism=ddp", "launcher.nproc_per_node=4", "train.global_batch_size=2", "train.micro_batch_size=1"],
         "train.global_batch_size=2 is smaller than the data-parallel size 4: every rank needs at least one sample per step"),
        (["launcher=deepspeed"],
         "launcher=deepspeed starts the DeepSpeed engine, which needs a zero option: use zero=stage0..stage3 or launcher=torchrun"),
        (["zero=stage2", "parallelism=ddp", "launcher.nnodes=2", "train.global_batch_size=16"],
         "launcher.nnodes=2 with the deepspeed launcher needs launcher.hostfile (one 'host slots=N' line per node; see launch/hostfile.example)"),
        (["zero.offload_optimizer=cpu"], "zero.offload_* needs DeepSpeed: choose a zero option (e.g. zero=stage2_offload), not zero=none"),
        (["launcher=torchrun", "launcher.no_ssh=true"],
         "launcher.hostfile and launcher.no_ssh are deepspeed launcher settings: use launcher=deepspeed (or unset them)"),
    ],
)
def test_what_cannot_work_is_refused(compose, overrides, message):
    with pytest.raises(ConfigError) as e:
        compose(overrides)
    assert str(e.value) == message


# ---------------------------------------------------------------------------------------------
# Real runs: 2 ranks, DeepSpeed CPU accelerator, the same weights loaded from a local directory.

STEPS = ["+recipe=quickstart_sft", "train.max_steps=4", "optim.warmup_steps=1", "train.exact_match_samples=0",
         "train.progress_bar=false", "train.eval_every=0"]


@pytest.fixture(scope="module")
def start_model(tmp_path_factory):
    """A tiny random-init model saved to disk: every run below starts from the same weights
    (ZeRO-3 builds random-init models inside zero.Init, which draws different random numbers)."""
    path = tmp_path_factory.mktemp("start") / "model"
    net, tok = tiny_model()
    net.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def train_losses(run_dir):
    return [m["loss"] for m in read_metrics(run_dir) if m["kind"] == "train"]


def final_eval(run_dir):
    return [m["eval_loss"] for m in read_metrics(run_dir) if m["kind"] == "eval"][-1]


def single_process_run(tmp, start_model, steps):
    """The torch engine on one process, from `start_model`: what the 2-rank runs are compared with (the rank's code in
    this process: the maths, not the launch)."""
    train_here([*steps, "model=pretrained", f"model.path={start_model}", "parallelism=single", "launcher.nproc_per_node=1"],
               tmp / "run")
    return tmp / "run"


@pytest.fixture(scope="module")
def torch_reference(start_model, tmp_path_factory):
    return single_process_run(tmp_path_factory.mktemp("ref"), start_model, STEPS)


_zero_runs: dict[str, tuple[Path, str]] = {}


CLI_ZERO = "stage2"
"""The option launched through the real CLI (DeepSpeed's runner starts the ranks); the others run the same ranks forked
(tests/ranks.py): what is compared is the ranks' arithmetic, and the launch is the same command for every stage."""


def zero_run(zero: str, start_model: Path, tmp_path_factory) -> tuple[Path, str]:
    """(run directory, stdout) of STEPS from `start_model` under `zero`, saving a checkpoint every 2 steps: launched once per
    test process, for the comparison with one process and as the uninterrupted run a resume continues."""
    if zero not in _zero_runs:
        run = tmp_path_factory.mktemp(f"zero_{zero}") / "run"
        out = (run_cli if zero == CLI_ZERO else launch_here)(
            *STEPS, f"zero={zero}", "model=pretrained", f"model.path={start_model}", "train.save_every=2", f"hydra.run.dir={run}",
            cwd=run.parent)
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
        _zero_runs[zero] = run, out.stdout
    return _zero_runs[zero]


@pytest.mark.slow
@pytest.mark.parametrize("zero", ["stage0", "stage1", "stage2", "stage2_offload", "stage3", "stage3_offload"])
def test_two_rank_zero_matches_single_process_torch(zero, start_model, torch_reference, tmp_path_factory):
    run, stdout = zero_run(zero, start_model, tmp_path_factory)
    if zero == CLI_ZERO:
        assert "finetune.rank.deepspeed_runner --num_nodes=1 --num_gpus=2" in stdout
    # Tolerance: fp32 on both sides; only the order of float sums differs (measured: < 1e-6 relative).
    assert train_losses(run) == pytest.approx(train_losses(torch_reference), rel=1e-4)
    assert final_eval(run) == pytest.approx(final_eval(torch_reference), rel=1e-4)
    # The exported Hugging Face weights are whole (consolidated from the shards under ZeRO-3).
    ours, ref = load_file(run / "final/model.safetensors"), load_file(torch_reference / "final/model.safetensors")
    assert set(ours) == set(ref)
    assert all(torch.allclose(ours[k], ref[k], atol=1e-5) for k in ref)


@pytest.mark.slow
def test_chunked_logits_under_zero3_follow_single_process_torch(start_model, torch_reference, tmp_path):
    """logits=chunked under ZeRO-3 on two ranks whose micro-batches hold different numbers of labelled tokens: every
    call of the output layer gathers its partition, so the rank with fewer chunks makes zero-weighted calls to match
    (it waited forever for the other's gathers before)."""
    run = tmp_path / "run"
    out = launch_here(*STEPS, "zero=stage3", "model=pretrained", f"model.path={start_model}", "logits=chunked",
                      "logits.chunk_tokens=8", f"hydra.run.dir={run}", cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert train_losses(run) == pytest.approx(train_losses(torch_reference), rel=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("zero", ["stage2", "none"])
def test_resume_continues_the_same_trajectory(zero, start_model, tmp_path, tmp_path_factory):
    """From the checkpoint at step 2 of 4 (the uninterrupted run is the ZeRO comparison's, where it has one)."""
    full, _ = zero_run(zero, start_model, tmp_path_factory)
    assert (full / "checkpoints/latest").read_text().strip() == "step_4"
    resumed = launch_here(*STEPS, f"zero={zero}", "model=pretrained", f"model.path={start_model}", "train.save_every=2",
                      f"train.resume={full / 'checkpoints/step_2'}", f"hydra.run.dir={tmp_path / 'resumed'}", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "at step 2" in resumed.stdout
    steps = [m["step"] for m in read_metrics(tmp_path / "resumed") if m["kind"] == "train"]
    assert steps == [3, 4]
    assert train_losses(tmp_path / "resumed") == pytest.approx(train_losses(full)[2:], rel=1e-6)
    assert final_eval(tmp_path / "resumed") == pytest.approx(final_eval(full), rel=1e-6)


@pytest.mark.slow
@pytest.mark.cores(2)
def test_two_nodes_on_one_machine_train_together(start_model, torch_reference, tmp_path):
    """Two `deepspeed --no_ssh` launches (node ranks 0 and 1) on 127.0.0.1 form one 2-rank job."""
    from finetune.launcher.launch import free_port

    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=1\n127.0.0.1 slots=1\n")
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "finetune.launch", *STEPS, "zero=stage2", "model=pretrained", f"model.path={start_model}",
             "launcher.nnodes=2", "launcher.nproc_per_node=1", f"launcher.node_rank={rank}", f"launcher.hostfile={hostfile}",
             "launcher.no_ssh=true", f"launcher.master_port={port}", f"hydra.run.dir={tmp_path / f'node{rank}'}"],
            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for rank in (0, 1)
    ]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][-2000:] + outs[1][-2000:]
    assert "dist_world_size=2" in outs[0]
    assert train_losses(tmp_path / "node0") == pytest.approx(train_losses(torch_reference), rel=1e-4)


DPO_STEPS = ["method=dpo", "data=quickstart_dpo", "train.max_steps=4", "optim.warmup_steps=1", "train.micro_batch_size=4",
             "train.global_batch_size=16", "train.exact_match_samples=0", "train.progress_bar=false", "train.eval_every=0"]


@pytest.fixture(scope="module")
def torch_dpo(start_model, tmp_path_factory):
    return single_process_run(tmp_path_factory.mktemp("dpo_ref"), start_model, DPO_STEPS)


@pytest.mark.slow
@pytest.mark.parametrize("zero,reference", [("stage3", "live"), ("stage2", "precomputed")])
def test_dpo_under_zero_matches_single_process_torch(zero, reference, start_model, torch_dpo, tmp_path):
    """The live reference under ZeRO-3 is sharded like the policy (an optimizer-less DeepSpeed engine)."""
    out = launch_here(*DPO_STEPS, f"zero={zero}", f"method.reference={reference}", "model=pretrained", f"model.path={start_model}",
                      "parallelism=ddp", "launcher.nproc_per_node=2", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    ours = [m for m in read_metrics(tmp_path / "run") if m["kind"] == "train"]
    ref = [m for m in read_metrics(torch_dpo) if m["kind"] == "train"]
    assert ours[0]["loss"] == pytest.approx(0.6931472, abs=1e-5)
    assert [m["loss"] for m in ours] == pytest.approx([m["loss"] for m in ref], rel=1e-4)
    assert [m["rewards/margin"] for m in ours] == pytest.approx([m["rewards/margin"] for m in ref], abs=1e-5)
    assert final_eval(tmp_path / "run") == pytest.approx(final_eval(torch_dpo), rel=1e-4)


def test_deepspeed_imports_without_its_autotuners_mlflow_and_mlflow_still_imports_after():
    """deepspeed.autotuning tries `import mlflow` at import (2 s); a rank never runs the autotuner, so it is skipped, and
    the mlflow tracker's own import afterwards still works."""
    code = ("import sys; from finetune.rank.dist import import_deepspeed; ds = import_deepspeed(); "
            "from deepspeed.autotuning import autotuner; print('mlflow' in sys.modules, autotuner.has_mlflow); "
            "import mlflow; print(type(mlflow.MlflowClient).__name__)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines()[-2:] == ["False False", "type"]  # (DeepSpeed prints its accelerator warning first)


def test_deepspeeds_runner_and_its_launch_skip_the_autotuners_mlflow():
    """finetune.rank.deepspeed_runner runs DeepSpeed's runner without importing mlflow, and starts the node's launch.py
    through itself (the same arguments); other commands (pdsh to other nodes) go out as DeepSpeed wrote them."""
    from finetune.rank.deepspeed_runner import _launch_through_us

    started = []
    start = _launch_through_us(lambda cmd, **kw: started.append(cmd))
    start(["/py", "-u", "-m", "deepspeed.launcher.launch", "--world_info=e30=", "--module", "finetune.train", "c.yaml"], env={})
    start(["pdsh", "-S", "-f", "1024", "-w", "a,b", "cd /r; /py -u -m deepspeed.launcher.launch --world_info=e30="])
    assert started == [["/py", "-u", "-m", "finetune.rank.deepspeed_runner", "--launch", "--world_info=e30=", "--module", "finetune.train",
                        "c.yaml"], ["pdsh", "-S", "-f", "1024", "-w", "a,b", "cd /r; /py -u -m deepspeed.launcher.launch --world_info=e30="]]
    code = ("import sys; from finetune.rank import deepspeed_runner as r; sys.argv = ['r', '--help']; code = r.main(); "
            "sys.argv = ['r', '--launch', '--help']; code += r.main(); from deepspeed.autotuning import autotuner; "
            "print(code, 'mlflow' in sys.modules, autotuner.has_mlflow)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines()[-1] == "0 False False"
