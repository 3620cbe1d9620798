"""Checkpoints in transformers' form: train.save_hf writes step_N/hf/ as final/ is written, and
`finetune.export RUN_DIR --step N` converts an engine's native checkpoint into the same: at the last step both equal
final/ (torch engine in process; ZeRO-3 over 2 ranks); a step not saved is refused with the steps there."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from finetune.rank import export, step_export
from finetune.config import ASSETS, load as load_config

from conftest import last_line, reload_and_evaluate, tiny_model, train_here
from ranks import launch_here

TWO = ["train.max_steps=2", "train.save_every=1", "optim.lr=3e-3", "train.eval_every=0", "train.exact_match_samples=0"]


def weights(directory):
    name = "adapter_model.safetensors" if (directory / "adapter_model.safetensors").is_file() else "model.safetensors"
    return load_file(directory / name)


def assert_same(a, b):
    wa, wb = weights(a), weights(b)
    assert set(wa) == set(wb) and wa
    assert all(torch.equal(wa[k], wb[k]) for k in wa), [k for k in wa if not torch.equal(wa[k], wb[k])][:3]


def test_full_model_step_export_equals_final_and_a_missing_step_lists_the_steps(tmp_path, capsys):
    run = tmp_path / "run"
    train_here([*TWO, "data.chat_template=compact"], run)
    hf = step_export.converted(run, load_config(run / "config.yaml"), 2)  # from state.pt: no save_hf here
    assert hf == run / "checkpoints/step_2/hf"
    assert_same(hf, run / "final")
    template = (ASSETS / "templates" / "compact.jinja").read_text()  # the template the run trained with, as final/ has it
    assert (hf / "chat_template.jinja").read_text() == (run / "final" / "chat_template.jinja").read_text() == template
    assert not torch.equal(weights(step_export.converted(run, load_config(run / "config.yaml"), 1))["lm_head.weight"],
                           weights(hf)["lm_head.weight"])  # step 1 is step 1's weights
    with pytest.raises(SystemExit) as e:
        export.main([str(run), "--step", "5"])
    assert e.value.code == 2
    assert last_line(capsys.readouterr().err) == (f"error: --step 5: {run} has no complete checkpoint of step 5 (steps saved "
                                               "there: 1, 2; train.save_every sets how often a run saves)")


def test_save_hf_and_step_export_of_a_pissa_adapter_equal_final(tmp_path):
    """peft=lora with every variant: step_2/hf/ (save_hf) == final/ == the conversion of state.pt; final/ (a plain LoRA
    adapter of the original base, converted from PiSSA) scores the eval set as the trained model did."""
    run = tmp_path / "run"
    summary = train_here([*TWO, "peft=lora", "peft.init=pissa", "peft.use_rslora=true", "optim.loraplus_lr_ratio=4",
                          "train.neftune_alpha=5", "train.save_hf=true"], run)
    assert_same(run / "checkpoints/step_2/hf", run / "final")
    saved = run / "saved_hf"
    shutil.move(run / "checkpoints/step_2/hf", saved)
    export.main([str(run), "--step", "2", "--dtype", "fp32"])
    assert_same(run / "checkpoints/step_2/hf", saved)
    assert (run / "export_step_2/model.safetensors").is_file()  # merged, as the export of final/
    adapter = json.loads((run / "final/adapter_config.json").read_text())  # a plain LoRA of the original base, rank 2r
    assert (adapter["r"], adapter["init_lora_weights"], adapter["lora_alpha"]) == (32, True, pytest.approx(32 * 2 ** 0.5))
    loss, *_ = reload_and_evaluate(run / "final", run)
    assert loss == pytest.approx(summary["after"]["eval_loss"], rel=1e-5)


@pytest.fixture(scope="module")
def start_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("start") / "model"
    net, tok = tiny_model()
    net.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.mark.slow
def test_zero3_step_export_equals_final(start_model, tmp_path):
    """DeepSpeed ZeRO-3 over 2 ranks, LoRA with LoRA+'s groups: zero_to_fp32's adapter of the last step == final/'s
    gathered one (an fp32 run)."""
    run = tmp_path / "run"
    out = launch_here("+recipe=quickstart_sft", *TWO, "optim.warmup_steps=0", "zero=stage3", "peft=lora", "optim.loraplus_lr_ratio=4",
                  "train.progress_bar=false", "model=pretrained", f"model.path={start_model}",
                  f"hydra.run.dir={run}", cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert_same(step_export.converted(run, load_config(run / "config.yaml"), 2), run / "final")
    # LoRA+ under DeepSpeed: B starts at zero and Adam moves an element at most ~lr a step (3e-3, then 1.5e-3 on the
    # 2-step cosine), so without the ratio no |B| passes 4.5e-3; at 4x the group's rate the largest come near 1.8e-2
    largest = max(float(v.abs().max()) for k, v in weights(run / "final").items() if "lora_B" in k)
    assert 1.5 * 4.5e-3 < largest <= 4 * 4.5e-3 * 1.01, largest


@pytest.mark.parametrize("pp", [1, 2])
def test_a_dcp_checkpoint_reads_whole_with_the_models_names(tmp_path, pp):
    """The mesh engine's layout (torch.distributed.checkpoint, {"model", "optim"}), read by dcp_to_torch_save; under
    pipeline parallel the stages' ModuleList index leaves the names, as the export of final/ does."""
    import torch.distributed.checkpoint as dcp

    net, _ = tiny_model()
    state = {k: v.clone() for k, v in net.state_dict().items()}
    saved = {f"{i % 2}.{k}": v for i, (k, v) in enumerate(state.items())} if pp > 1 else state
    dcp.save({"model": saved, "optim": {"state": {}}}, checkpoint_id=str(tmp_path / "step_1"))
    read = step_export.native_state(tmp_path / "step_1", {"engine": "mesh", "pp": pp})
    assert set(read) == set(state) and all(torch.equal(read[k], state[k]) for k in state)
