"""The launcher is a pure function config -> argv/env/files: golden outputs, and the dry run."""

from __future__ import annotations

import subprocess
import sys

import yaml

from finetune import config
from finetune.launcher.command import build

from conftest import REPO, run_cli


def test_single_node_two_ranks_golden(compose):
    cfg = compose(["+recipe=quickstart_sft"])
    spec = build(cfg, "/runs/a", python="python", cpu_count=8)
    assert spec.argv == [
        "python", "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2", "--standalone",
        "-m", "finetune.train", "/runs/a/config.yaml",
    ]
    assert spec.env == {"OMP_NUM_THREADS": "4", "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    assert list(spec.files) == ["config.yaml"]


def test_multi_node_golden(compose):
    cfg = compose(["parallelism=ddp", "launcher.nnodes=2", "launcher.node_rank=1", "launcher.nproc_per_node=4",
                   "launcher.master_addr=10.0.0.7", "launcher.master_port=29600", "launcher.omp_num_threads=6",
                   "+launcher.env.NCCL_DEBUG=INFO", "train.global_batch_size=64"])
    spec = build(cfg, "/runs/b", python="/usr/bin/python3", cpu_count=64)
    assert spec.argv == [
        "/usr/bin/python3", "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=4",
        "--node_rank=1", "--master_addr=10.0.0.7", "--master_port=29600",
        "-m", "finetune.train", "/runs/b/config.yaml",
    ]
    assert spec.env == {"OMP_NUM_THREADS": "6", "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", "NCCL_DEBUG": "INFO"}
    assert spec.shell() == (
        "OMP_NUM_THREADS=6 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false NCCL_DEBUG=INFO /usr/bin/python3 -m torch.distributed.run "
        "--nnodes=2 --nproc_per_node=4 --node_rank=1 --master_addr=10.0.0.7 --master_port=29600 -m finetune.train /runs/b/config.yaml"
    )


def test_single_node_with_fixed_port_uses_static_rendezvous(compose):
    spec = build(compose(["launcher.master_port=29555", "launcher.nproc_per_node=2", "parallelism=ddp"]), "/r", python="python", cpu_count=2)
    assert "--standalone" not in spec.argv
    assert spec.argv[3:8] == ["--nnodes=1", "--nproc_per_node=2", "--node_rank=0", "--master_addr=127.0.0.1", "--master_port=29555"]


def test_one_process_runs_the_rank_itself_with_torchruns_environment(compose):
    """No torchrun hop for one process (its start cost ~2 s of a short run): the rank gets the variables torchrun
    would set, and a port for a process group of one (a device mesh needs it)."""
    spec = build(compose(["parallelism=single", "launcher.nproc_per_node=1"]), "/r", python="python", cpu_count=2, port=29999)
    assert spec.argv == ["python", "-m", "finetune.train", "/r/config.yaml"]
    assert spec.env == {"OMP_NUM_THREADS": "2", "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", "RANK": "0", "LOCAL_RANK": "0",
                        "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}
    zero = build(compose(["zero=stage2", "launcher.nproc_per_node=1", "parallelism=single"]), "/r", python="python", cpu_count=2)
    assert zero.argv[2] == "finetune.rank.deepspeed_runner"  # DeepSpeed sets up its own ranks
    asked = build(compose(["parallelism=single", "launcher.nproc_per_node=1", "launcher=torchrun"]), "/r", python="python", cpu_count=2)
    assert asked.argv[2] == "torch.distributed.run"  # launcher=torchrun, said in so many words
    nodes = build(compose(["launcher.nnodes=2", "launcher.nproc_per_node=1", "launcher.master_addr=10.0.0.7", "launcher.master_port=29600",
                           "parallelism=ddp"]), "/r", python="python", cpu_count=2)
    assert nodes.argv[2] == "torch.distributed.run"  # one process per node, two nodes: torchrun's rendezvous


def test_written_config_round_trips_to_the_same_typed_config(compose, tmp_path):
    cfg = compose(["+recipe=quickstart_sft", "optim.lr=2e-4"])
    spec = build(cfg, tmp_path, python="python", cpu_count=2)
    path = tmp_path / "config.yaml"
    path.write_text(spec.files["config.yaml"])
    loaded = config.load(path)
    assert loaded.run_dir == str(tmp_path)
    assert loaded.optim == cfg.optim and loaded.train == cfg.train and loaded.model == cfg.model and loaded.data == cfg.data


def test_launch_imports_no_torch():
    code = "import sys, finetune.launch; bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'deepspeed')]; print(bad); sys.exit(bool(bad))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_dry_run_prints_config_and_command_and_starts_nothing(tmp_path):
    run_dir = tmp_path / "run"
    out = run_cli("+recipe=quickstart_sft", "launcher.dry_run=true", f"hydra.run.dir={run_dir}", cwd=tmp_path, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert lines[-1].startswith("OMP_NUM_THREADS=")
    assert f"-m torch.distributed.run --nnodes=1 --nproc_per_node=2 --standalone -m finetune.train {run_dir}/config.yaml" in lines[-1]
    assert f"# run directory: {run_dir}" in lines
    printed = yaml.safe_load("\n".join(line for line in lines if not line.startswith(("#", "OMP_NUM_THREADS="))))
    assert printed["train"]["max_steps"] == 500 and printed["parallelism"]["strategy"] == "ddp"
    assert (run_dir / "config.yaml").is_file()
    assert not (run_dir / "metrics.jsonl").exists()  # nothing ran


def test_hydra_cfg_job_prints_composed_config(tmp_path):
    out = run_cli("+recipe=quickstart_sft", "--cfg", "job", cwd=tmp_path, timeout=60)
    assert out.returncode == 0, out.stderr
    printed = yaml.safe_load(out.stdout)
    assert printed["launcher"]["nproc_per_node"] == 2 and printed["optim"]["lr"] == 1e-3


def test_repo_layout():
    for path in ("pyproject.toml", "README.md", "mkdocs.yml", "docs/index.md", "recipes/config.yaml", "finetune/launcher/launch.py", "launch", "scripts",
                 "tests", ".ci/run"):
        assert (REPO / path).exists(), path


def test_threads_per_rank_honour_the_environment_then_the_cores(compose, tmp_path):
    """launcher.omp_num_threads, else OMP_NUM_THREADS as the launch's environment sets it (torchrun honours it too),
    else the node's cores over its ranks; a value that is no whole number is one line."""
    cfg = compose(["+recipe=quickstart_sft"])
    assert build(cfg, "/r", python="p", cpu_count=8).env["OMP_NUM_THREADS"] == "4"
    assert build(cfg, "/r", python="p", cpu_count=8, env_threads=1).env["OMP_NUM_THREADS"] == "1"
    chosen = compose(["+recipe=quickstart_sft", "launcher.omp_num_threads=3"])
    assert build(chosen, "/r", python="p", cpu_count=8, env_threads=1).env["OMP_NUM_THREADS"] == "3"
    dry = ["+recipe=quickstart_sft", "launcher.dry_run=true", f"hydra.run.dir={tmp_path / 'run'}"]
    import os

    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    out = subprocess.run([sys.executable, "-m", "finetune.launch", *dry], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip().splitlines()[-1].startswith("OMP_NUM_THREADS=2 "), out.stderr
    env["OMP_NUM_THREADS"] = "two"
    out = subprocess.run([sys.executable, "-m", "finetune.launch", *dry], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stderr == ("error: OMP_NUM_THREADS='two' in the environment is not a whole number of threads: "
                                                  "unset it, or set launcher.omp_num_threads\n")
