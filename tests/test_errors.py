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
         "error: unknown key 'optim.lrr' in 'optim' (did you mean 'optim.lr'?); known keys: name, lr, weight_decay, betas, eps, momentum, scheduler, warmup_steps, min_lr_ratio, loraplus_lr_ratio, max_grad_norm, state_dtype, kernel, in_backward"),
        (["+train.max_step=3"],
         "error: unknown key 'train.max_step' in 'train' (did you mean 'train.max_steps'?); known keys: max_steps, epochs, micro_batch_size, global_batch_size, seed, eval_every, eval_batch_size, exact_match_samples, max_new_tokens, sample_prompts, eval_tasks, log_every, progress_bar, loggers, group, tensorboard, compile, memory_report, count_host_reads, memory_snapshot, save_every, keep_checkpoints, save_hf, neftune_alpha, on_nonfinite, resume, overwrite, device, qat, qat_group_size, qat_after_steps"),
        (["optim.lr=fast"], "error: optim.lr=fast must be a number"),
        (["train.max_steps=1.5"], "error: train.max_steps=1.5 must be an integer"),
        (["data.format=xml"], "error: data.format=xml must be one of auto, alpaca, chat, sharegpt, completion, text, preference"),
        (["model=tinyy"], "error: unknown model option 'tinyy' (did you mean 'tiny'?); available: gemma2_9b, llama3_1_70b, llama3_1_8b, llama3_2_1b, mistral_7b_v0_3, mixtral_8x7b, olmo2_7b, phi3_5_mini, pretrained, qwen2_5_7b, qwen3_30b_a3b, qwen3_8b, tiny, tiny_vlm"),
        (["parallelism=dp"], "error: unknown parallelism option 'dp' (did you mean 'ddp'?); available: cp2, cp4, cp8, ddp, fsdp, fsdp_offload, pp2, pp2_interleaved, pp4, single, tp2, tp2_pp2, tp4, tp8, tp8_pp16"),
        (["+recipe=quickstart"], "error: unknown recipe 'quickstart' (did you mean 'quickstart_vlm'?); available: llama3_70b_qlora_80g, llama3_70b_qlora_fsdp_2x24g, llama3_8b_full_zero3_8x80g, llama3_8b_lora_80g, llama3_8b_qlora_24g, long_context, long_context_cpu, optuna_quickstart, quickstart_distill, quickstart_dpo, quickstart_grpo, quickstart_kto, quickstart_orpo, quickstart_qat, quickstart_reward, quickstart_rloo, quickstart_sft, quickstart_tools, quickstart_tools_sft, quickstart_vlm, qwen3_moe_lora_zero3_8x80g, zero3_offload_fp16 "
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
    path.write_text(json.dumps({"instruction": "a", "output": "b"}) + "\n" + json.dumps({"q": "q", "a": "a"}) + "\n")
    assert cli_error(tmp_path, "data=jsonl", f"data.train={path}") == (
        f"error: {path}:2: a row of no known form (keys present: a, q); the forms are alpaca (instruction, output), chat (messages), "
        "sharegpt (conversations), completion (prompt and completion, or question and answer), text (text): rename its keys, or fix the row"
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


LLAMA_LINEARS = "its linear layers are down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj (or use [all-linear])"


def test_peft_targets_that_match_nothing_name_the_layers_that_exist(tmp_path):
    """Before launch for a family finetune.families knows (read from its config as a file)..."""
    assert cli_error(tmp_path, "peft=lora", "peft.target_modules=[q_proj,qkv]") == \
        f"error: peft.target_modules: qkv matches no module of this llama model: {LLAMA_LINEARS}"


@pytest.mark.slow
def test_a_dotted_peft_target_that_matches_nothing_is_refused_by_the_rank(tmp_path):
    """...and a dotted path (which the launcher cannot place in the model) by the rank, in the same words."""
    line, _ = rank_error(tmp_path, "peft=lora", "peft.target_modules=[q_proj,self_attn.qkv]")
    assert line == f"error: peft: peft.target_modules: self_attn.qkv matches no module of this llama model: {LLAMA_LINEARS}"


def test_a_damaged_weight_file_is_named(tmp_path, model_dir):
    """Cut short: found before launch from the safetensors header and the file's size; and if a rank
    meets it anyway (a hub cache), its loader names the same file."""
    import torch

    from finetune.config import ConfigError, ModelConfig, PeftConfig
    from finetune.rank.model import load_model

    broken = tmp_path / "broken"
    shutil.copytree(model_dir, broken)
    weights = broken / "model.safetensors"
    need = weights.stat().st_size
    weights.write_bytes(weights.read_bytes()[:20000])
    out = run_cli("+recipe=quickstart_sft", "model=pretrained", f"model.path={broken}", "launcher.dry_run=true",
                  f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path, timeout=60)
    assert out.returncode == 2 and last_line(out.stderr) == (
        f"error: model.path: {weights} is damaged or incomplete (20000 bytes, its tensors need {need}: a download or copy was "
        "cut short): copy or download it again"), out.stderr
    with pytest.raises(ConfigError) as e:
        load_model(ModelConfig(path=str(broken)), None, attention="sdpa", peft=PeftConfig(), compute_dtype=torch.float32, zero3=False,
                   run_dir=tmp_path, is_main=True, barrier=lambda: None)
    assert str(e.value) == (f"model.path='{broken}': {weights} (20000 bytes, its tensors need {need}: a download or copy was cut short) "
                            "is damaged or incomplete: copy or download the model again")


def _asset(rel: str) -> str:
    from finetune.config import ASSETS

    return str(ASSETS / rel)


# ---------------------------------------------------------------------------------------------
# Data mistakes, named by file and line before any rank starts


def jsonl(tmp_path, *rows, name="train.jsonl") -> str:
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


OK = {"instruction": "a", "output": "b"}


def test_a_file_that_is_not_utf8_names_file_line_and_byte(tmp_path):
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(json.dumps(OK).encode() + b'\n{"instruction": "caf\xe9", "output": "b"}\n')
    assert cli_error(tmp_path, "data=jsonl", f"data.train={latin}") == (
        f"error: {latin}:2: not UTF-8 text (byte 0xe9 at column 21): save the file as UTF-8, "
        "e.g. iconv -f latin1 -t utf-8 latin.jsonl > latin.utf8.jsonl")
    utf16 = tmp_path / "utf16.json"
    utf16.write_text(json.dumps([OK]), encoding="utf-16")  # with a byte-order mark
    assert cli_error(tmp_path, "data=jsonl", f"data.train={utf16}") == (
        f"error: {utf16}:1: not UTF-8 text (it starts with a UTF-16 byte-order mark): save the file as UTF-8, "
        "e.g. iconv -f utf-16 -t utf-8 utf16.json > utf16.utf8.json")


@pytest.mark.parametrize(
    "row,message",
    [
        ({"instruction": "a", "output": " \n"}, "the response 'output' is empty (only whitespace): fix the row or remove it"),
        ({"instruction": " ", "input": "", "output": "b"},
         "the prompt is empty ('instruction' and 'input' hold no text): fix the row or remove it"),
        ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""}]},
         "the response the assistant's messages[1] is empty: fix the row or remove it"),
        ({"messages": [{"role": "system", "content": "s"}, {"role": "system", "content": "t"}, {"role": "assistant", "content": "a"}]},
         "no user message with text before the response (a response to nothing): fix the row or remove it"),
    ],
    ids=["blank-output", "blank-prompt", "empty-assistant", "no-user-turn"],
)
def test_degenerate_sft_rows_are_refused_naming_file_and_line(tmp_path, row, message):
    path = jsonl(tmp_path, OK, row)
    assert cli_error(tmp_path, "data=jsonl", f"data.train={path}") == f"error: {path}:2: {message}"


@pytest.mark.parametrize(
    "row,message",
    [
        ({"prompt": "p", "chosen": "", "rejected": "r"}, "the response 'chosen' is empty: fix the row or remove it"),
        ({"prompt": "p", "chosen": {"role": "assistant", "content": "c"}, "rejected": [{"role": "assistant", "content": "\t"}]},
         "the response 'rejected' is empty (only whitespace): fix the row or remove it"),
        ({"prompt": "p", "chosen": "same", "rejected": "same "},
         "'chosen' and 'rejected' are the same response, so the pair prefers nothing: fix the row or remove it"),
        ({"prompt": "", "chosen": "c", "rejected": "r"},
         "no user message with text before the response (a response to nothing): fix the row or remove it"),
    ],
    ids=["empty-chosen", "blank-rejected", "same-responses", "empty-prompt"],
)
def test_degenerate_preference_rows_are_refused_naming_file_and_line(tmp_path, row, message):
    path = jsonl(tmp_path, {"prompt": "p", "chosen": "c", "rejected": "r"}, row)
    assert cli_error(tmp_path, "method=dpo", "data=jsonl", f"data.train={path}") == f"error: {path}:2: {message}"


def test_a_file_without_rows_is_refused(tmp_path):
    empty, blank = tmp_path / "empty.jsonl", tmp_path / "blank.jsonl"
    empty.write_text("")
    blank.write_text("\n  \n\n")
    assert cli_error(tmp_path, "data=jsonl", f"data.train={empty}") == f"error: data.train: {empty} has no rows (the file is empty)"
    assert cli_error(tmp_path, "data=jsonl", f"data.train={jsonl(tmp_path, OK)}", f"data.eval={blank}") == (
        f"error: data.eval: {blank} has no rows (only blank lines)")


def test_a_source_that_cannot_be_loaded_says_what_was_tried(tmp_path):
    folder = tmp_path / "my_set"
    (folder / "notes").mkdir(parents=True)
    (folder / "README.md").write_text("no data here")
    assert cli_error(tmp_path, "data=jsonl", f"data.train={folder}") == (
        f"error: data.train: could not load the local dataset directory {folder}: as a saved dataset: no dataset_info.json; "
        "as a directory of data files: no .jsonl/.json/.csv/.parquet/.arrow/.txt files in it")
    csv = tmp_path / "train.csv"
    csv.write_text("instruction,output\na,b\n")
    assert cli_error(tmp_path, "data=jsonl", f"data.train={csv}") == (
        f"error: data.train: {csv} is a .csv file: data files are .jsonl (one JSON object per line) or .json (a list of objects); "
        "for other formats use a dataset directory")


def test_a_hub_id_that_cannot_be_loaded_says_what_was_tried():
    """A hub id is loaded by the ranks (it needs `datasets`); offline, as tests run, it is not in the cache."""
    from finetune.config import ConfigError
    from finetune.data.sources import load_rows

    with pytest.raises(ConfigError) as e:
        load_rows("nobody/no-such-set", "train", "data.train")
    assert str(e.value) == (
        "data.train: could not load 'nobody/no-such-set': as a local path: no such file or directory; as a hub dataset "
        "(split 'train'): offline (HF_HUB_OFFLINE/HF_DATASETS_OFFLINE is set) and not in the local cache: download it once "
        "online, or point the key at a local file or directory")
