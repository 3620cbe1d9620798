"""The scripts a user runs: scripts/install.sh into a fresh virtual environment, and
scripts/benchmark.py's table on its smallest setting."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import venv

import pytest

from conftest import REPO, read_metrics, train_here
from finetune.config import ConfigError


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("FINETUNE_TEST_INSTALL") != "1",
                    reason="CI itself runs scripts/install.sh on a fresh machine; FINETUNE_TEST_INSTALL=1 repeats it in a fresh venv")
def test_install_script_into_a_fresh_venv(tmp_path):
    """A copy of the tracked tree (so the editable install writes nothing into this checkout), a new
    venv without system site-packages, then `PYTHON=venv/bin/python bash scripts/install.sh`: the
    venv gets torch's CPU build, the package and its test extra, and the CLI runs from it."""
    src = tmp_path / "src"
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, files):
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_bytes((REPO / name).read_bytes())
    venv.create(tmp_path / "venv", with_pip=True, system_site_packages=False)
    python = tmp_path / "venv/bin/python"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")} | {"PYTHON": str(python)}
    out = subprocess.run(["bash", str(src / "scripts/install.sh")], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    probe = ("import finetune, torch, pytest, hydra_plugins.hydra_optuna_sweeper; "
             "print(finetune.__file__); print(torch.__version__)")
    found = subprocess.run([str(python), "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert found.returncode == 0, found.stderr[-3000:]
    assert found.stdout.splitlines() == [str(src / "finetune/__init__.py"), "2.13.0+cpu"]  # editable, CPU torch
    dry = subprocess.run([str(python), "-m", "finetune.launch", "+recipe=quickstart_sft", "launcher.dry_run=true",
                          f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert dry.returncode == 0, dry.stderr[-3000:]
    assert dry.stdout.strip().splitlines()[-1].endswith(
        f"{python} -m torch.distributed.run --nnodes=1 --nproc_per_node=2 --standalone -m finetune.train {tmp_path / 'run'}/config.yaml")


def test_benchmark_table_on_its_smallest_setting(tmp_path):
    """One strategy, 2 steps: the Markdown table has its header and one row of numbers, and the numbers
    are the run's: fp32 AdamW holds 4 + 4 + 8 bytes per parameter, the loss and the planned peak are
    those of the same config trained here."""
    from conftest import tiny_model

    out = subprocess.run([sys.executable, str(REPO / "scripts/benchmark.py"), "--steps", "2", "--only", "fp32 baseline",
                          "--out", str(tmp_path / "bench.md")], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    text = (tmp_path / "bench.md").read_text()
    assert out.stdout == "running fp32 baseline ...\n" + text + "\n"
    table = [line for line in text.splitlines() if line.startswith("|")]
    assert table[:2] == ["| strategy | peak MiB | planned peak | params | grads | optimizer | activations | tokens/s | step ms "
                         "| loss after 2 steps |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    assert len(table) == 3
    name, *cells = [c.strip() for c in table[2].strip("|").split("|")]
    assert name == "fp32 baseline" and len(cells) == 9
    assert all(re.fullmatch(r"[0-9,]+(\.[0-9]+)?", c) for c in cells), cells
    peak, planned, params, grads, optimizer, activations, tokens_per_s, step_ms, loss = (float(c.replace(",", "")) for c in cells)
    n = sum(p.numel() for p in tiny_model()[0].parameters())
    assert params == pytest.approx(4 * n / 2**20, abs=0.005)
    assert grads == pytest.approx(4 * n / 2**20, abs=0.005) and optimizer == pytest.approx(8 * n / 2**20, abs=0.005)
    assert activations > 0 and peak > params + grads + optimizer and tokens_per_s > 0 and step_ms > 0
    train_here(["+recipe=quickstart_sft", "parallelism=single", "launcher.nproc_per_node=1", "train.max_steps=2", "optim.warmup_steps=0",
                "train.exact_match_samples=0", "train.eval_every=0"], tmp_path / "ref")
    rows = read_metrics(tmp_path / "ref")
    assert loss == pytest.approx([r["loss"] for r in rows if r["kind"] == "train"][-1], abs=5e-4)
    assert planned == pytest.approx(next(r for r in rows if r["kind"] == "plan")["plan_peak_mib"], abs=0.05)
    dry = re.fullmatch(r"Dry run \(python -m finetune.launch \+recipe=quickstart_sft launcher.dry_run=true\), median of 5: "
                       r"([0-9.]+) s wall, ([0-9.]+) s CPU", text.strip().splitlines()[-1])
    assert dry and 0 < float(dry[2]) < 60 and 0 < float(dry[1]) < 60, text  # measured, not asserted fast: shared machines


def test_gpu_check_composes_every_run_it_would_make(compose):
    """scripts/gpu_check.sh runs only on a GPU machine (none here); what it would launch is checked here: each benchmark
    row it names exists, and each row with its 1B-class overrides composes and validates; without a GPU it says so."""
    import shlex

    sys.path.insert(0, str(REPO / "scripts"))
    import benchmark

    text = (REPO / "scripts/gpu_check.sh").read_text()
    overrides = shlex.split(re.search(r"LLAMA_1B=\((.*?)\)", text, re.S).group(1))
    rows = shlex.split(re.search(r'--only (.*?) --extra', text).group(1))
    assert rows and all(row in benchmark.STRATEGIES for row in rows)
    assert "bf16 + compile + Liger" in rows
    for row in rows:
        if "model.kernels=liger" in benchmark.STRATEGIES[row] and importlib.util.find_spec("liger_kernel") is None:
            with pytest.raises(ConfigError, match=r'^model.kernels=liger needs the liger-kernel package .*: pip install -e ".\[gpu\]"'):
                compose(["+recipe=quickstart_sft", *benchmark.STRATEGIES[row], *overrides])  # the gpu extra: none here
            continue
        cfg = compose(["+recipe=quickstart_sft", *benchmark.STRATEGIES[row], *overrides])
        assert (cfg.model.init.hidden_size, cfg.model.init.vocab_size, cfg.data.max_length) == (2048, 128256, 2048)
    if not shutil.which("nvidia-smi"):
        out = subprocess.run(["bash", str(REPO / "scripts/gpu_check.sh"), "unused"], capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and out.stderr.strip() == ("error: scripts/gpu_check.sh needs an NVIDIA GPU (nvidia-smi found none); "
                                                               "on CPU run bash scripts/test.sh")
