"""Multi-node launches: torchrun's static and c10d rendezvous, their refusals, the Slurm script, and
real 2-"node" jobs on this machine (two launches on 127.0.0.1, gloo) against a 1-node 2-rank run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from finetune.config import ConfigError
from finetune.launcher.command import build

from conftest import REPO, read_metrics, run_cli

SLURM = REPO / "launch" / "slurm.sbatch"
TWO_NODES = ["+recipe=quickstart_sft", "launcher.nnodes=2", "launcher.nproc_per_node=1"]


# ---------------------------------------------------------------------------------------------
# The command each node runs


def test_static_two_node_golden(compose):
    cfg = compose([*TWO_NODES, "launcher.node_rank=1", "launcher.master_addr=10.0.0.1", "launcher.master_port=29500"])
    spec = build(cfg, "/runs/s", python="python", cpu_count=8)
    assert spec.argv == [
        "python", "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
        "--node_rank=1", "--master_addr=10.0.0.1", "--master_port=29500",
        "-m", "finetune.train", "/runs/s/config.yaml",
    ]
    assert spec.env == {"OMP_NUM_THREADS": "8", "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}


def test_c10d_rendezvous_golden(compose):
    cfg = compose([*TWO_NODES, "launcher.rdzv_endpoint=10.0.0.1:29400"])
    spec = build(cfg, "/runs/c", python="python", cpu_count=8, port=12345)
    assert spec.argv == [
        "python", "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
        "--rdzv_backend=c10d", "--rdzv_endpoint=10.0.0.1:29400", "--rdzv_id=finetune",
        "-m", "finetune.train", "/runs/c/config.yaml",
    ]
    assert spec.shell() == (
        "OMP_NUM_THREADS=8 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false python -m torch.distributed.run --nnodes=2 "
        "--nproc_per_node=1 --rdzv_backend=c10d --rdzv_endpoint=10.0.0.1:29400 --rdzv_id=finetune -m finetune.train /runs/c/config.yaml"
    )


def test_c10d_rendezvous_with_a_job_id_on_one_node_and_under_zero_with_torchrun(compose):
    one = build(compose(["launcher.rdzv_endpoint=node-a:29400", "launcher.rdzv_id=job42"]), "/r", python="python", cpu_count=2)
    assert one.argv[3:8] == ["--nnodes=1", "--nproc_per_node=1", "--rdzv_backend=c10d", "--rdzv_endpoint=node-a:29400", "--rdzv_id=job42"]
    assert "--standalone" not in one.argv
    zero = build(compose([*TWO_NODES, "zero=stage2", "launcher=torchrun", "launcher.rdzv_endpoint=node-a"]), "/r", python="python", cpu_count=2)
    assert zero.argv[2:8] == ["torch.distributed.run", "--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d",
                              "--rdzv_endpoint=node-a", "--rdzv_id=finetune"]


# ---------------------------------------------------------------------------------------------
# Refusals: one line naming the keys and what to change


@pytest.mark.parametrize("overrides,message", [
    ([*TWO_NODES, "zero=stage2", "launcher.rdzv_endpoint=10.0.0.1:29400"],
     "launcher.rdzv_endpoint=10.0.0.1:29400 is a torchrun (c10d rendezvous) setting, but this run uses the deepspeed launcher: "
     "unset launcher.rdzv_endpoint and use launcher.hostfile or launcher.no_ssh=true launcher.node_rank=R, or add launcher=torchrun"),
    ([*TWO_NODES, "zero=stage2", "launcher=deepspeed", "launcher.rdzv_endpoint=10.0.0.1:29400"],
     "launcher.rdzv_endpoint=10.0.0.1:29400 is a torchrun (c10d rendezvous) setting, but this run uses the deepspeed launcher: "
     "unset launcher.rdzv_endpoint and use launcher.hostfile or launcher.no_ssh=true launcher.node_rank=R, or add launcher=torchrun"),
    ([*TWO_NODES, "launcher.rdzv_endpoint=10.0.0.1:29400", "launcher.node_rank=1"],
     "launcher.node_rank=1 conflicts with launcher.rdzv_endpoint=10.0.0.1:29400 (the c10d rendezvous assigns node ranks): "
     "remove it, or unset launcher.rdzv_endpoint to use the static rendezvous"),
    ([*TWO_NODES, "launcher.rdzv_endpoint=10.0.0.1:29400", "launcher.master_port=29500"],
     "launcher.master_port=29500 conflicts with launcher.rdzv_endpoint=10.0.0.1:29400 (the c10d rendezvous assigns node ranks): "
     "remove it, or unset launcher.rdzv_endpoint to use the static rendezvous"),
    ([*TWO_NODES, "launcher.rdzv_endpoint=10.0.0.1:29400", "launcher.node_rank=1", "launcher.master_addr=10.0.0.1",
      "launcher.master_port=29500"],
     "launcher.node_rank=1 and launcher.master_addr=10.0.0.1 and launcher.master_port=29500 conflict with launcher.rdzv_endpoint="
     "10.0.0.1:29400 (the c10d rendezvous assigns node ranks): remove them, or unset launcher.rdzv_endpoint to use the static rendezvous"),
    ([*TWO_NODES, "launcher.rdzv_id=job42"],
     "launcher.rdzv_id=job42 has no effect without launcher.rdzv_endpoint (c10d rendezvous): "
     "set launcher.rdzv_endpoint=HOST:PORT or remove launcher.rdzv_id"),
    ([*TWO_NODES, "launcher.rdzv_endpoint=:29400"],
     "launcher.rdzv_endpoint=:29400 must be HOST or HOST:PORT (port in [1, 65535]): the same on every node, e.g. launcher.rdzv_endpoint=10.0.0.1:29400"),
    ([*TWO_NODES, "launcher.rdzv_endpoint=node-a:port"],
     "launcher.rdzv_endpoint=node-a:port must be HOST or HOST:PORT (port in [1, 65535]): the same on every node, e.g. launcher.rdzv_endpoint=10.0.0.1:29400"),
    ([*TWO_NODES, "launcher.rdzv_endpoint=node-a:29400", "launcher.rdzv_id=''"],
     "launcher.rdzv_id='' must be non-empty text: give every node of the job the same id, e.g. launcher.rdzv_id=job42"),
])
def test_rendezvous_refusals(compose, overrides, message):
    with pytest.raises(ConfigError) as e:
        compose(overrides)
    assert str(e.value) == message


def test_refusal_is_one_line_from_the_cli(tmp_path):
    out = run_cli("+recipe=quickstart_sft", "launcher.rdzv_id=job42", cwd=tmp_path, timeout=60)
    assert out.returncode == 2
    assert out.stderr == ("error: launcher.rdzv_id=job42 has no effect without launcher.rdzv_endpoint (c10d rendezvous): "
                          "set launcher.rdzv_endpoint=HOST:PORT or remove launcher.rdzv_id\n")
    assert not out.stdout


# ---------------------------------------------------------------------------------------------
# Slurm: launch/slurm.sbatch


def srun_command(script: str) -> str:
    """The srun command of the script, continuation lines joined."""
    joined = script.replace("\\\n", " ")
    return next(line for line in joined.splitlines() if line.lstrip().startswith("srun "))


def test_slurm_script_is_valid_bash_and_starts_one_launch_per_node():
    out = subprocess.run(["bash", "-n", str(SLURM)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    script = SLURM.read_text()
    assert script.startswith("#!/bin/bash\n") and "#SBATCH --ntasks-per-node=1" in script
    srun = srun_command(script)
    assert srun.split()[:2] == ["srun", "--ntasks-per-node=1"]
    for part in ("-m finetune.launch", "launcher.nnodes=\"$SLURM_NNODES\"", "'exec \"$@\" launcher.node_rank=$SLURM_NODEID'",
                 "launcher.master_addr=\"$MASTER_ADDR\"", "launcher.master_port=\"$MASTER_PORT\"",
                 "launcher.nproc_per_node=\"$NPROC_PER_NODE\"", "hydra.run.dir=\"$RUN_DIR\"", '"$@"'):
        assert part in srun, part
    assert 'scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p' in script


FAKE_SRUN = """#!/bin/bash
# fake srun: note the options, then run the command once per fake node (SLURM_NODEID=0, 1), in the background
echo "$@" > "$FAKE_SLURM/srun.args"
while [[ $1 == -* ]]; do shift; done
pids=()
for node in 0 1; do
    SLURM_NODEID=$node SLURM_PROCID=$node "$@" > "$FAKE_SLURM/node$node.out" 2>&1 &
    pids+=($!)
done
rc=0
for pid in "${pids[@]}"; do wait "$pid" || rc=$?; done
exit $rc
"""

FAKE_SCONTROL = """#!/bin/bash
# fake scontrol: only `scontrol show hostnames LIST`
[[ "$1 $2" == "show hostnames" ]] || exit 1
printf 'gpu-node-a\\ngpu-node-b\\n'
"""


@pytest.mark.parametrize("deepspeed", [False, True], ids=["torchrun", "deepspeed"])
def test_slurm_script_dry_run_with_fake_srun_gives_each_node_its_rank(deepspeed, tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_", "NPROC_PER_NODE", "RUN_DIR", "DEEPSPEED"))}
    env |= {"PATH": f"{bin_dir}{os.pathsep}{env['PATH']}", "PYTHON": sys.executable, "FAKE_SLURM": str(tmp_path),
            "SLURM_JOB_ID": "777", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "gpu-node-[a-b]", "SLURM_SUBMIT_DIR": str(tmp_path)}
    args = ["+recipe=quickstart_sft", "launcher.dry_run=true"]
    if deepspeed:
        env["DEEPSPEED"] = "1"
        args.append("zero=stage2")
    out = subprocess.run(["bash", str(SLURM), *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    nodes = [(tmp_path / f"node{r}.out").read_text() if (tmp_path / f"node{r}.out").exists() else "" for r in (0, 1)]
    assert out.returncode == 0, out.stdout + out.stderr + nodes[0][-2000:] + nodes[1][-2000:]
    run_dir = tmp_path / "outputs" / "slurm-777"
    assert f"run directory {run_dir}" in out.stdout
    assert (tmp_path / "srun.args").read_text().startswith("--ntasks-per-node=1 --nodes=2 ")
    for rank, text in enumerate(nodes):
        assert f"# run directory: {run_dir}" in text
        if deepspeed:
            command = (f"-m finetune.rank.deepspeed_runner --num_nodes=2 --num_gpus=1 --hostfile={run_dir}/hostfile --no_ssh "
                       f"--node_rank={rank} --master_addr=gpu-node-a --master_port=29500 --module finetune.train {run_dir}/config.yaml")
        else:
            command = (f"-m torch.distributed.run --nnodes=2 --nproc_per_node=1 --node_rank={rank} --master_addr=gpu-node-a "
                       f"--master_port=29500 -m finetune.train {run_dir}/config.yaml")
        assert text.strip().splitlines()[-1].endswith(command)
    if deepspeed:
        assert (run_dir / "hostfile").read_text() == "gpu-node-a slots=1\ngpu-node-b slots=1\n"
    assert (run_dir / "config.yaml").is_file() and not (run_dir / "metrics.jsonl").exists()  # nothing ran


# ---------------------------------------------------------------------------------------------
# Real 2-node jobs on this machine (two launches on 127.0.0.1)

STEPS = ["+recipe=quickstart_sft", "train.max_steps=4", "optim.warmup_steps=1", "train.exact_match_samples=0",
         "train.progress_bar=false", "train.eval_every=0"]


def train_losses(run_dir: Path) -> list[float]:
    return [m["loss"] for m in read_metrics(run_dir) if m["kind"] == "train"]


@pytest.fixture(scope="module")
def one_node_two_ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("one_node")
    out = run_cli(*STEPS, "launcher.nproc_per_node=2", f"hydra.run.dir={tmp / 'run'}", cwd=tmp)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return tmp / "run"


def two_launches(tmp_path: Path, per_node: list[list[str]]) -> list[str]:
    """Start one `python -m finetune.launch` per node at once; both must finish cleanly."""
    procs = [
        subprocess.Popen([sys.executable, "-m", "finetune.launch", *STEPS, "launcher.nnodes=2", "launcher.nproc_per_node=1", *args,
                          f"hydra.run.dir={tmp_path / f'node{rank}'}"],
                         cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for rank, args in enumerate(per_node)
    ]
    try:
        outs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], outs[0][-2000:] + outs[1][-2000:]
    return outs


@pytest.mark.slow
def test_two_nodes_static_rendezvous_train_together(one_node_two_ranks, tmp_path):
    from finetune.launcher.launch import free_port

    port = free_port()
    outs = two_launches(tmp_path, [[f"launcher.node_rank={rank}", "launcher.master_addr=127.0.0.1", f"launcher.master_port={port}"]
                                   for rank in (0, 1)])
    for rank, out in enumerate(outs):
        assert f"--nnodes=2 --nproc_per_node=1 --node_rank={rank} --master_addr=127.0.0.1 --master_port={port}" in out
    assert not (tmp_path / "node1" / "metrics.jsonl").exists()  # node 1's rank is global rank 1: one job, not two
    losses = train_losses(tmp_path / "node0")
    assert len(losses) == 4
    assert losses == pytest.approx(train_losses(one_node_two_ranks), rel=1e-4)


@pytest.mark.slow
def test_two_nodes_c10d_rendezvous_train_together(one_node_two_ranks, tmp_path):
    from finetune.launcher.launch import free_port

    endpoint = f"127.0.0.1:{free_port()}"
    outs = two_launches(tmp_path, [[f"launcher.rdzv_endpoint={endpoint}"]] * 2)
    for out in outs:
        assert f"--nnodes=2 --nproc_per_node=1 --rdzv_backend=c10d --rdzv_endpoint={endpoint} --rdzv_id=finetune" in out
    # The rendezvous picks which node is node 0: exactly one run directory has rank 0's metrics.
    first = [tmp_path / f"node{r}" for r in (0, 1) if (tmp_path / f"node{r}" / "metrics.jsonl").exists()]
    assert len(first) == 1
    losses = train_losses(first[0])
    assert len(losses) == 4
    assert losses == pytest.approx(train_losses(one_node_two_ranks), rel=1e-4)
