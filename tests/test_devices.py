"""launcher.devices_per_trial: a node's devices shared among the launches on it (finetune/launcher/devices.py), what the ranks are
given (finetune.launcher.command.build), and the rules. Trials side by side through Hydra's launchers: tests/test_sweep.py and
tests/test_sweep_slurm.py."""

from __future__ import annotations

import multiprocessing
import threading
import time

import pytest

from finetune.launcher import devices
from finetune.launcher.command import build
from finetune.config import ConfigError


@pytest.fixture
def locks(tmp_path, monkeypatch):
    monkeypatch.setenv(devices.LOCKS_ENV, str(tmp_path / "locks"))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    return tmp_path / "locks"


def test_launches_take_devices_of_their_own_all_or_none_and_wait_for_them(locks):
    a = devices.take(2, gpu=True)
    b = devices.take(1, gpu=True)
    assert (a.kind, a.ids, b.ids) == ("GPU", ["0", "1"], ["2"])
    said, got = [], []
    waiter = threading.Thread(target=lambda: got.append(devices.take(2, gpu=True, said=said.append, poll_s=0.05)))
    waiter.start()  # one GPU free: it takes none and waits
    time.sleep(0.3)
    assert got == [] and said == [f"waiting for 2 free GPUs of 4 (other launches hold them: {locks})"]
    assert devices.take(1, gpu=True, wait=False).ids == ["3"]  # a dry run's view: free now, not kept
    a.release()
    waiter.join(timeout=10)
    assert got[0].ids == ["0", "1"]
    assert devices.take(3, gpu=True, wait=False).ids == ["0", "1", "2"]  # none free: the first ones
    with pytest.raises(ConfigError) as refused:
        devices.take(5, gpu=True)
    assert str(refused.value) == "launcher.devices_per_trial=5, but this node has 4 GPUs (0, 1, 2, 3): lower launcher.devices_per_trial"


def _hold_and_die(directory: str, ready) -> None:
    import os

    os.environ[devices.LOCKS_ENV] = directory
    os.environ["CUDA_VISIBLE_DEVICES"] = "0,1,2,3"
    devices.take(4, gpu=True)
    ready.set()
    time.sleep(60)


def test_a_killed_launch_frees_its_devices(locks):
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Event()
    holder = ctx.Process(target=_hold_and_die, args=(str(locks), ready))
    holder.start()
    assert ready.wait(60)
    assert devices.take(1, gpu=True, wait=False).ids == ["0"] and len(list(locks.iterdir())) == 4
    holder.kill()
    holder.join()
    assert devices.take(4, gpu=True, wait=True, poll_s=0.05).ids == ["0", "1", "2", "3"]  # flock went with the process


def test_the_ranks_see_only_the_devices_taken(compose, locks):
    gpus = devices.Devices("GPU", ["2", "3"])
    cfg = compose(["launcher.devices_per_trial=2", "launcher.nproc_per_node=2", "parallelism=ddp"])
    spec = build(cfg, "/r", python="python", cpu_count=8, devices=gpus)
    assert spec.env["CUDA_VISIBLE_DEVICES"] == "2,3" and spec.argv[:3] == ["python", "-m", "torch.distributed.run"]
    spec = build(compose(["launcher.devices_per_trial=2", "launcher.nproc_per_node=2", "parallelism=ddp", "zero=stage2"]), "/r", python="python",
                 cpu_count=8, devices=gpus)
    assert "--include=localhost:2,3" in spec.argv and not any(a.startswith("--num_gpus") for a in spec.argv)
    cores = devices.Devices("CPU core", ["4", "5", "6", "7"])
    spec = build(cfg, "/r", python="python", cpu_count=8, env_threads=1, devices=cores)
    assert spec.argv[:3] == ["taskset", "-c", "4,5,6,7"] and spec.env["OMP_NUM_THREADS"] == "2"  # its 4 cores over 2 ranks
    assert "CUDA_VISIBLE_DEVICES" not in spec.env


def test_devices_per_trial_against_the_ranks_and_the_nodes(compose):
    with pytest.raises(ConfigError) as refused:
        compose(["launcher.devices_per_trial=1", "launcher.nproc_per_node=2", "parallelism=ddp"])
    assert str(refused.value) == ("launcher.devices_per_trial=1 is fewer devices than the launch's launcher.nproc_per_node=2 ranks: "
                                  "set launcher.devices_per_trial=2 (or more), or fewer ranks")
    with pytest.raises(ConfigError) as refused:
        compose(["launcher.devices_per_trial=2", "launcher.nproc_per_node=2", "launcher.nnodes=2", "parallelism=ddp"])
    assert str(refused.value) == ("launcher.devices_per_trial=2 shares one node's devices among the launches on it, but this job "
                                  "spans launcher.nnodes=2 nodes: leave launcher.devices_per_trial unset (null)")
    with pytest.raises(ConfigError, match=r"^launcher.devices_per_trial=0 must be"):
        compose(["launcher.devices_per_trial=0"])
