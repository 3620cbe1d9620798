"""Every user mistake ends in one clear line on stderr and a non-zero exit, through the real CLI."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import last_line, run_cli


def cli_error(tmp_path, *args: str) -> str:
    out = run_cli(*args, "launcher.dry_run=true", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path, timeout=60)
    assert out.returncode == 2, (out.returncode, out.stdout, out.stderr)
    assert out.stderr.count("\n") == 1, out.stderr  # one line, no traceback
    assert "Traceback" not in out.stderr
    return out.stderr.strip()


@pytest.mark.parametrize(
    "args,message",
    [
        (["optim.lrr=1e-4"],
         "error: unknown key 'optim.lrr' in 'optim' (did you mean 'optim.lr'?); known keys: name, lr, weight_decay, betas, eps, momentum, scheduler, warmup_steps, min_lr_ratio, max_grad_norm"),
        (["+train.max_step=3"],
         "error: unknown key 'train.max_step' in 'train' (did you mean 'train.max_steps'?); known keys: max_steps, micro_batch_size, global_batch_size, seed, eval_every, eval_batch_size, exact_match_samples, max_new_tokens, log_every, progress_bar, tensorboard, memory_report, memory_snapshot, save_every, keep_checkpoints, on_nonfinite, resume, device"),
        (["optim.lr=fast"], "error: optim.lr=fast must be a number"),
        (["train.max_steps=1.5"], "error: train.max_steps=1.5 must be an integer"),
        (["data.format=xml"], "error: data.format=xml must be one of auto, alpaca, chat, preference"),
        (["model=tinyy"], "error: unknown model option 'tinyy' (did you mean 'tiny'?); available: pretrained, tiny"),
        (["parallelism=dp"], "error: unknown parallelism option 'dp' (did you mean 'ddp'?); available: ddp, fsdp, fsdp_offload, pp2, pp2_interleaved, pp4, single, tp2, tp2_pp2, tp4, tp8, tp8_pp16"),
        (["+recipe=quickstart"], "error: unknown recipe 'quickstart' (did you mean 'quickstart_sft'?); available: optuna_quickstart, quickstart_dpo, quickstart_sft, zero3_offload_fp16 "
                                   "(a recipe of your own: --config-dir DIR with DIR/recipe/quickstart.yaml)"),
        (["data=jsonl"], "error: 'data.train' has no value and needs one: set it in the recipe or on the command line (data.train=...)"),
        (["data.train=/nowhere/train.jsonl"], "error: data.train: no such file or directory: /nowhere/train.jsonl"),
    ],
)
def test_config_mistakes(tmp_path, args, message):
    assert cli_error(tmp_path, *args) == message


def test_malformed_jsonl_row_names_file_and_line(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text('{"instruction": "a", "output": "b"}\n\n{"instruction": "c", "output": \n')
    assert cli_error(tmp_path, "data=jsonl", f"data.train={path}") == f"error: {path}:3: not valid JSON (Expecting value at column 1)"


def test_row_of_unknown_shape_names_file_line_and_keys(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps({"instruction": "a", "output": "b"}) + "\n" + json.dumps({"question": "q", "answer": "a"}) + "\n")
    assert cli_error(tmp_path, "data=jsonl", f"data.train={path}") == (
        f"error: {path}:2: alpaca rows need string 'instruction' and 'output' (missing or not text: instruction, output; keys present: answer, question)"
    )


def test_chat_row_must_end_with_assistant(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    assert cli_error(tmp_path, "data=jsonl", f"data.train={path}") == (
        f"error: {path}:1: the last message must be the assistant's response, got role 'user'"
    )


@pytest.mark.slow
def test_rank_found_mistakes_end_with_one_clear_line(tmp_path):
    """Errors only a rank can find (they need the tokenizer) are repeated as the launcher's last line."""
    out = run_cli("data.max_length=8", "train.max_steps=1", f"hydra.run.dir={tmp_path / 'a'}", cwd=tmp_path)
    assert out.returncode != 0
    assert "Traceback" not in out.stderr
    assert last_line(out.stderr) == (
        "error: data: data.train=" + _asset("data/quickstart/train.jsonl")
        + ": the dataset is empty after filtering: all 4000 prompts are longer than data.max_length=8 (the shortest is 12 tokens): raise data.max_length"
    )
    out = run_cli("data.max_length=8", "data.long_prompt=error", "train.max_steps=1", f"hydra.run.dir={tmp_path / 'b'}", cwd=tmp_path)
    assert out.returncode != 0
    assert last_line(out.stderr) == (
        "error: data: " + _asset("data/quickstart/train.jsonl")
        + ":1: the prompt is 16 tokens, data.max_length=8 leaves no room for the response: raise data.max_length or set data.long_prompt=drop"
    )


ONE_RANK = ["launcher.nproc_per_node=1", "parallelism=single", "train.max_steps=1", "optim.warmup_steps=0", "train.progress_bar=false",
            "train.tensorboard=false", "train.memory_report=false"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Llama saved as a hub-style directory (config.json, safetensors, tokenizer)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("model")
    tok = AutoTokenizer.from_pretrained(_asset("tokenizer"))
    LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                 num_key_value_heads=1, vocab_size=len(tok))).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def rank_error(tmp_path, *args: str) -> tuple[str, Path]:
    run = tmp_path / "run"
    out = run_cli("+recipe=quickstart_sft", *ONE_RANK, *args, f"hydra.run.dir={run}", cwd=tmp_path)
    assert out.returncode != 0 and "Traceback" not in out.stderr + out.stdout, out.stderr[-3000:]
    return last_line(out.stderr), run


@pytest.mark.slow
def test_unexpected_rank_failure_is_one_line_naming_the_phase_with_the_traceback_in_the_rank_log(tmp_path, model_dir):
    broken = tmp_path / "broken"
    shutil.copytree(model_dir, broken)
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "model_type": "llama", "hidden_act": "no_such_activation"}))
    line, run = rank_error(tmp_path, "model=pretrained", f"model.path={broken}")
    log = run / "ranks" / "0.log"
    assert line == f"error: model: rank 0: KeyError: \"Could not find activation function no_such_activation\" (traceback in {log})" or \
        (line.startswith("error: model: rank 0: KeyError: ") and line.endswith(f"(traceback in {log})")), line
    assert log.read_text().startswith("Traceback (most recent call last):")
    assert json.loads((run / "ranks" / "0.json").read_text())["status"] == "exited 1"


@pytest.mark.slow
def test_peft_targets_that_match_nothing_name_the_layers_that_exist(tmp_path):
    line, _ = rank_error(tmp_path, "peft=lora", "peft.target_modules=[q_proj,qkv]")
    assert line == ("error: peft: peft.target_modules: qkv matches no module of this llama model: its linear layers are "
                    "down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj (or use [all-linear])")


@pytest.mark.slow
def test_a_damaged_weight_file_is_named(tmp_path, model_dir):
    broken = tmp_path / "broken"
    shutil.copytree(model_dir, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:20000])
    line, _ = rank_error(tmp_path, "model=pretrained", f"model.path={broken}")
    assert line.startswith(f"error: model: model.path='{broken}': a weight file is damaged or incomplete (") and \
        line.endswith("): copy or download the model again"), line


def _asset(rel: str) -> str:
    from finetune.config import ASSETS

    return str(ASSETS / rel)
