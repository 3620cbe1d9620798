"""A campaign of user mistakes, each through the launcher's command line.

Every case must end with a non-zero exit, no Python traceback anywhere in what the user sees
(stdout and stderr), and a last line `error: ...` that names the key, the file or the rank to look at.
Most are dry runs (everything the launcher can know before a rank starts): a few of them as a user runs them, in a
process of their own (THROUGH_THE_CLI), the others through the launcher's `main` in the test's process (the same code
and output, without a Python start-up each); the mistakes only a rank can see, and those about earlier runs'
directories, are short real launches. Of the mistakes only a rank can see, one
goes through the CLI here (RELAYED: the launcher repeats the rank's line as its last, as tests/test_errors.py's do on two
ranks); the others are the ranks' part (tests/ranks.py's launch_here: the same rank code, its error.txt as the last line).

The list comes from our own schema and from what users of the peers get wrong (their trackers):
- PEFT "Target modules ... not found in the base model" on families whose layers are named
  differently (peft#1206; LLaMA-Factory#181 Baichuan's W_pack; MPT's Wqkv)        -> peft_targets_*
- a base model's tokenizer without a chat template asked to apply one (TRL, unsloth#2096,
  OpenRLHF#613)                                                                     -> no_chat_template
- a dataset path that is relative to another directory than the one launched from
  (LLaMA-Factory#2222, #5341)                                                       -> data_relative_path
- a rank's traceback and torchrun's ChildFailedError report instead of a reason (LLaMA-Factory#6193)
                                                                                    -> every rank case
- rerunning into an output directory silently replacing a finished run, or `overwrite_output_dir`
  vs resume confusion (LLaMA-Factory#721, transformers#9776)                        -> rundir_*
- a resume path with a typo silently starting from scratch (open-instruct#1823)     -> resume_missing
- micro batch vs gradient accumulation vs global batch (axolotl#1100, #2262)        -> batch_*
- a partially downloaded model: an index naming shards that are not there, an adapter directory
  given as the model (axolotl, LLaMA-Factory "no file named pytorch_model.bin")     -> model_*
- flash-attn asked for on a machine without it, fp16 on hardware without it          -> device_*
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import last_line, launch_in_process, run_cli, tiny_model
from ranks import launch_here

QUICK = ["+recipe=quickstart_sft"]
DRY = ["launcher.dry_run=true"]
REAL = ["parallelism=single", "launcher.nproc_per_node=1", "train.max_steps=2", "optim.warmup_steps=0", "train.eval_every=0",
        "train.exact_match_samples=0", "train.progress_bar=false"]
"""A short real launch on one CPU rank."""

ROW = {"instruction": "reverse", "input": "abc", "output": "cba"}


def jsonl(*rows: object) -> str:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows)


@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> Path:
    """A workspace of broken things: model and tokenizer directories, data files, a hostfile-less
    world, and (for the run-directory cases) one finished 2-step run with a checkpoint."""
    ws = tmp_path_factory.mktemp("ws")
    net, tok = tiny_model()
    good = ws / "model"
    net.save_pretrained(good)
    tok.save_pretrained(good)

    def model_copy(name: str, drop: tuple[str, ...] = (), **config: object) -> Path:
        d = ws / name
        shutil.copytree(good, d)
        for f in drop:
            (d / f).unlink()
        if config:
            c = json.loads((d / "config.json").read_text())
            c.update(config)
            (d / "config.json").write_text(json.dumps(c))
        return d

    model_copy("no_config", drop=("config.json",))
    model_copy("no_weights", drop=("model.safetensors",))
    d = model_copy("missing_shard", drop=("model.safetensors",))
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}))
    d = model_copy("bad_json")
    (d / "config.json").write_text('{"model_type": "llama",\n "hidden_size": 64,,\n}')
    d = model_copy("no_model_type")
    c = json.loads((d / "config.json").read_text())
    c.pop("model_type"), c.pop("architectures", None)
    (d / "config.json").write_text(json.dumps(c))
    d = ws / "adapter"
    d.mkdir()
    (d / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "meta-llama/Llama-3.2-1B", "peft_type": "LORA"}))
    (d / "adapter_model.safetensors").write_bytes(b"")
    model_copy("short_context", max_position_embeddings=32)
    model_copy("tied", tie_word_embeddings=True)
    model_copy("three_heads", num_attention_heads=3, num_key_value_heads=3, hidden_size=96)  # 3 x head_dim 32
    model_copy("small_vocab", vocab_size=8)
    d = model_copy("truncated")
    (d / "model.safetensors").write_bytes((good / "model.safetensors").read_bytes()[:1000])
    d = ws / "tok_settings_only"
    d.mkdir()
    (d / "tokenizer_config.json").write_text((good / "tokenizer_config.json").read_text())
    d = model_copy("no_template")
    c = json.loads((d / "tokenizer_config.json").read_text())
    c.pop("chat_template", None)
    (d / "tokenizer_config.json").write_text(json.dumps(c))
    (d / "chat_template.jinja").unlink(missing_ok=True)
    (ws / "a_file").write_text("not a directory\n")

    data = ws / "data"
    data.mkdir()
    (data / "latin1.jsonl").write_bytes(jsonl(ROW).encode() + '{"instruction": "caf\xe9", "output": "x"}\n'.encode("latin-1"))
    (data / "bad.jsonl").write_text(jsonl(ROW, '{"instruction": "a", "output": '))
    (data / "wrong_form.jsonl").write_text(jsonl(ROW, {"q": "q", "a": "a"}))
    (data / "empty_response.jsonl").write_text(jsonl(ROW, {"instruction": "a", "output": "  "}))
    (data / "no_assistant.jsonl").write_text(jsonl({"messages": [{"role": "user", "content": "hi"}]}))
    (data / "no_user.jsonl").write_text(jsonl({"messages": [{"role": "system", "content": "s"}, {"role": "assistant", "content": "a"}]}))
    (data / "empty.jsonl").write_text("")
    (data / "rows.txt").write_text("reverse abc -> cba\n")
    (data / "same.jsonl").write_text(jsonl({"prompt": "p", "chosen": "a", "rejected": "a"}))
    (data / "not_a_list.json").write_text(json.dumps({"rows": [ROW]}))
    (data / "sft.jsonl").write_text(jsonl(*[ROW] * 8))
    (data / "role.jsonl").write_text(jsonl({"messages": [{"role": "human", "content": "hi"}, {"role": "assistant", "content": "a"}]}))
    (data / "dir_without_data").mkdir()

    run = ws / "finished"
    out = run_cli(*QUICK, *REAL, "train.save_every=2", f"data.train={data / 'sft.jsonl'}", "data=jsonl", f"hydra.run.dir={run}", cwd=ws)
    assert out.returncode == 0, out.stderr[-3000:]
    changed = ws / "changed"  # the same run, as if its data file had changed since (another sha256 in the checkpoint)
    shutil.copytree(run, changed)
    meta = changed / "checkpoints/step_2/meta.json"
    meta.write_text(meta.read_text().replace(json.loads(meta.read_text())["data"]["data.train"]["files"][str(data / "sft.jsonl")], "0" * 64))
    damaged = ws / "damaged"
    shutil.copytree(run, damaged)
    state = damaged / "checkpoints/step_2/state.pt"  # a copy cut short
    state.write_bytes(state.read_bytes()[:1000])
    return ws


def model_at(name: str) -> list[str]:
    return ["model=pretrained", f"model.path={{ws}}/{name}"]


def data_at(name: str, *more: str) -> list[str]:
    return ["data=jsonl", f"data.train={{ws}}/data/{name}", "train.exact_match_samples=0", *more]


# (id, overrides (`{ws}` is the workspace), what the last line must name, a real launch?)
CASES: list[tuple[str, list[str], str, bool]] = [
    # composition: Hydra's grammar and groups
    ("group_without_plus", ["recipe=quickstart_sft", *DRY], "+recipe=quickstart_sft", False),
    ("plus_on_existing_key", [*QUICK, "+optim.lr=1e-4", *DRY], "optim.lr", False),
    ("plus_on_chosen_group", [*QUICK, "+precision=bf16", *DRY], "precision", False),
    ("unknown_key", [*QUICK, "optim.lrr=1e-4", *DRY], "optim.lrr", False),
    ("unknown_nested_key", [*QUICK, "train.max_step=3", *DRY], "train.max_step", False),
    ("key_inside_a_null_node", [*QUICK, "model=pretrained", "model.path={ws}/model", "model.init.num_hidden_layers=4", *DRY],
     "'model.init' is null", False),
    ("unknown_option", [*QUICK, "parallelism=fsdpp", *DRY], "fsdpp", False),
    ("unknown_recipe", ["+recipe=quickstart", *DRY], "quickstart", False),
    ("no_recipe_and_no_data", ["data=jsonl", *DRY], "data.train", False),
    ("bad_grammar_bracket", [*QUICK, "optim.betas=[0.9,0.95", *DRY], "optim.betas", False),
    ("delete_a_key", [*QUICK, "~optim.lr", *DRY], "optim.lr", False),
    ("unknown_hydra_key", [*QUICK, "hydra.run.dirr=x", *DRY], "hydra.run.dirr", False),
    ("unknown_flag", [*QUICK, "--dry-run"], "--dry-run", False),
    ("missing_config_dir", ["--config-dir", "{ws}/nowhere", *QUICK, *DRY], "nowhere", False),
    ("sweep_value_out_of_range", ["-m", *QUICK, "optim.lr=1e-4,-1", *DRY], "optim.lr", False),
    # types
    ("number_as_word", [*QUICK, "optim.lr=fast", *DRY], "optim.lr", False),
    ("float_for_integer", [*QUICK, "train.max_steps=1.5", *DRY], "train.max_steps", False),
    ("word_for_bool", [*QUICK, "train.progress_bar=maybe", *DRY], "train.progress_bar", False),
    ("scalar_for_list", [*QUICK, "optim.betas=0.9", *DRY], "optim.betas", False),
    ("empty_number", [*QUICK, "optim.lr=", *DRY], "optim.lr", False),
    ("unknown_enum", [*QUICK, "parallelism.pp_schedule=zigzag", *DRY], "parallelism.pp_schedule", False),
    ("unknown_optimizer", [*QUICK, "optim.name=lion", *DRY], "optim.name", False),
    # values each field accepts
    ("negative_lr", [*QUICK, "optim.lr=-1", *DRY], "optim.lr", False),
    ("beta_of_one", [*QUICK, "optim.betas=[0.9,1.0]", *DRY], "optim.betas", False),
    ("zero_micro_batch", [*QUICK, "train.micro_batch_size=0", *DRY], "train.micro_batch_size", False),
    ("dropout_of_one", [*QUICK, "peft=lora", "peft.dropout=1.0", *DRY], "peft.dropout", False),
    ("port_out_of_range", [*QUICK, "launcher.master_port=70000", *DRY], "launcher.master_port", False),
    ("negative_weight_decay", [*QUICK, "optim.weight_decay=-0.1", *DRY], "optim.weight_decay", False),
    ("zero_max_length", [*QUICK, "data.max_length=0", *DRY], "data.max_length", False),
    ("zero_ranks", [*QUICK, "launcher.nproc_per_node=0", *DRY], "launcher.nproc_per_node", False),
    ("lora_rank_zero", [*QUICK, "peft=lora", "peft.r=0", *DRY], "peft.r", False),
    ("nvme_path_missing", [*QUICK, "zero=stage3_nvme", "zero.nvme_path={ws}/no_nvme", *DRY], "zero.nvme_path", False),
    ("hostfile_missing", [*QUICK, "zero=stage2", "launcher.nnodes=2", "launcher.hostfile={ws}/hosts", *DRY], "launcher.hostfile", False),
    ("rdzv_endpoint_without_host", [*QUICK, "launcher.nnodes=2", "launcher.nproc_per_node=1", "launcher.rdzv_endpoint=:29400", *DRY],
     "launcher.rdzv_endpoint", False),
    # rules across groups
    ("batch_not_divisible", [*QUICK, "train.global_batch_size=30", *DRY], "train.global_batch_size", False),
    ("batch_below_micro_times_ranks", [*QUICK, "train.global_batch_size=8", "train.micro_batch_size=8", *DRY], "train.global_batch_size", False),
    ("warmup_past_max_steps", [*QUICK, "train.max_steps=3", "optim.warmup_steps=5", *DRY], "optim.warmup_steps", False),
    ("momentum_with_adamw", [*QUICK, "optim.momentum=0.9", *DRY], "optim.momentum", False),
    ("tp_not_dividing_ranks", [*QUICK, "parallelism=tp2", "launcher.nproc_per_node=3", *DRY], "parallelism.tp", False),
    ("more_stages_than_blocks", [*QUICK, "parallelism=pp4", "launcher.nproc_per_node=4", "model.init.num_hidden_layers=2", *DRY],
     "parallelism.pp", False),
    ("tp_not_dividing_heads", [*QUICK, "parallelism=tp2", "model.init.num_attention_heads=3", "model.init.num_key_value_heads=3",
                               "model.init.hidden_size=96", *DRY], "parallelism.tp", False),
    ("dpo_on_sft_data", [*QUICK, "method=dpo", *DRY], "data.format", False),
    ("node_rank_past_nnodes", [*QUICK, "launcher.nnodes=2", "launcher.nproc_per_node=1", "launcher.node_rank=2", *DRY],
     "launcher.node_rank", False),
    ("deepspeed_two_nodes_no_hostfile", [*QUICK, "zero=stage2", "launcher.nnodes=2", "launcher.nproc_per_node=1", *DRY],
     "launcher.hostfile", False),
    ("context_past_model_positions", [*QUICK, "data.max_length=100000", *DRY], "data.max_length", False),
    ("more_ranks_than_gpus", [*QUICK, "hardware=h100_80g", "launcher.nproc_per_node=16", *DRY], "launcher.nproc_per_node", False),
    ("offload_checkpointing_with_pp", [*QUICK, "parallelism=pp2", "checkpointing=offload", *DRY], "checkpointing", False),
    ("rdzv_with_deepspeed", [*QUICK, "zero=stage2", "launcher.nnodes=2", "launcher.nproc_per_node=1",
                             "launcher.rdzv_endpoint=10.0.0.1:29400", *DRY], "launcher.rdzv_endpoint", False),
    ("overwrite_and_resume", [*QUICK, "train.overwrite=true", "train.resume=auto", *DRY], "train.overwrite", False),
    # devices
    ("cuda_without_gpu", [*QUICK, "train.device=cuda", *REAL], "train.device", False),
    ("flash_attention_on_cpu", [*QUICK, "model.attn_implementation=flash_attention_2", "train.device=cpu", *REAL],
     "model.attn_implementation", False),
    ("memory_plan_does_not_fit", [*QUICK, "hardware.cpu_memory_gib=0.5", *REAL], "hardware", False),
    # the model directory
    ("model_path_missing", [*model_at("nowhere"), *DRY], "model.path", False),
    ("model_path_is_a_file", [*model_at("a_file"), *DRY], "model.path", False),
    ("model_without_config", [*model_at("no_config"), *DRY], "model.path", False),
    ("model_is_an_adapter", [*model_at("adapter"), *DRY], "model.path", False),
    ("model_config_not_json", [*model_at("bad_json"), *DRY], "config.json", False),
    ("model_config_without_type", [*model_at("no_model_type"), *DRY], "config.json", False),
    ("model_without_weights", [*model_at("no_weights"), *DRY], "model.path", False),
    ("model_missing_shard", [*model_at("missing_shard"), *DRY], "model-00002-of-00002.safetensors", False),
    ("model_context_too_short", [*model_at("short_context"), *DRY], "data.max_length", False),
    ("model_tied_under_pp", [*model_at("tied"), "parallelism=pp2", *DRY], "parallelism", False),
    ("model_heads_vs_tp", [*model_at("three_heads"), "parallelism=tp2", *DRY], "parallelism.tp", False),
    ("tokenizer_bigger_than_vocab", [*model_at("small_vocab"), *DRY], "vocab_size", False),
    ("tokenizer_dir_without_tokenizer", [*QUICK, "model.tokenizer={ws}/tok_settings_only", *DRY], "model.tokenizer", False),
    ("tokenizer_dir_missing", [*QUICK, "model.tokenizer={ws}/nowhere", *DRY], "model.tokenizer", False),
    ("hub_id_offline", [*QUICK, "model=pretrained", "model.path=no-such-org/no-such-model", *REAL], "model.path", True),
    ("weights_truncated", [*QUICK, *model_at("truncated"), *DRY], "truncated/model.safetensors", False),
    # data files
    ("data_file_missing", [*QUICK, *data_at("nowhere.jsonl"), *DRY], "nowhere.jsonl", False),
    ("data_relative_path", [*QUICK, "data=jsonl", "data.train=data/train.jsonl", "train.exact_match_samples=0", *DRY], "data/train.jsonl", False),
    ("data_not_utf8", [*QUICK, *data_at("latin1.jsonl"), *DRY], "latin1.jsonl:2", False),
    ("data_bad_json", [*QUICK, *data_at("bad.jsonl"), *DRY], "bad.jsonl:2", False),
    ("data_wrong_form", [*QUICK, *data_at("wrong_form.jsonl"), *DRY], "wrong_form.jsonl:2", False),
    ("data_empty_response", [*QUICK, *data_at("empty_response.jsonl"), *DRY], "empty_response.jsonl:2", False),
    ("data_chat_ends_with_user", [*QUICK, *data_at("no_assistant.jsonl"), *DRY], "no_assistant.jsonl:1", False),
    ("data_chat_without_user", [*QUICK, *data_at("no_user.jsonl"), *DRY], "no_user.jsonl:1", False),
    ("data_unknown_role", [*QUICK, *data_at("role.jsonl"), *DRY], "role.jsonl:1", False),
    ("data_empty_file", [*QUICK, *data_at("empty.jsonl"), *DRY], "empty.jsonl", False),
    ("data_unsupported_suffix", [*QUICK, *data_at("rows.txt"), *DRY], "rows.txt", False),
    ("data_json_not_a_list", [*QUICK, *data_at("not_a_list.json"), *DRY], "not_a_list.json", False),
    ("data_dir_without_data", [*QUICK, *data_at("dir_without_data"), *DRY], "dir_without_data", False),
    ("data_chosen_equals_rejected", ["+recipe=quickstart_dpo", *data_at("same.jsonl"), *DRY], "same.jsonl:1", False),
    ("data_prompt_longer_than_max_length", [*QUICK, "data.max_length=8", "data.long_prompt=error", *REAL], "train.jsonl:1", True),
    # what only a rank can see
    ("peft_targets_not_in_model", [*QUICK, "peft=lora", "peft.target_modules=[W_pack]", *DRY], "peft.target_modules", False),
    ("peft_dotted_target_not_in_model", [*QUICK, "peft=lora", "peft.target_modules=[attn.W_pack]", *REAL], "peft.target_modules", True),
    ("peft_modules_to_save_not_in_model", [*QUICK, "peft=lora", "peft.modules_to_save=[embed]", *REAL], "peft.modules_to_save", True),
    ("no_chat_template", [*QUICK, *model_at("no_template"), "data.template=tokenizer", *REAL], "data.template", True),
    # earlier runs: nothing is lost
    ("rundir_holds_a_finished_run", [*QUICK, *REAL, "data=jsonl", "data.train={ws}/data/sft.jsonl", "hydra.run.dir={ws}/finished"],
     "train.overwrite", False),
    ("resume_missing", [*QUICK, *REAL, "train.resume={ws}/finished/checkpoints/step_9"], "train.resume", False),
    ("resume_nothing_left", [*QUICK, *REAL, "data=jsonl", "data.train={ws}/data/sft.jsonl",
                             "train.resume={ws}/finished/checkpoints/step_2"], "train.max_steps", True),
    ("resume_data_changed", [*QUICK, *REAL, "train.max_steps=4", "data=jsonl", "data.train={ws}/data/sft.jsonl",
                             "train.resume={ws}/changed/checkpoints/step_2"], "sft.jsonl", True),
    ("resume_damaged_checkpoint", [*QUICK, *REAL, "train.max_steps=4", "data=jsonl", "data.train={ws}/data/sft.jsonl",
                                   "train.resume={ws}/damaged/checkpoints/step_2"], "step_2", True),
]


RELAYED = ("peft_dotted_target_not_in_model",)
"""The rank-found mistake launched through the CLI here (the module's docstring says why only one)."""

THROUGH_THE_CLI = ("group_without_plus", "unknown_flag", "missing_config_dir", "sweep_value_out_of_range", "unknown_recipe",
                   "model_without_weights", "data_relative_path", "hostfile_missing")
"""Dry runs that run as a user runs them, `python -m finetune.launch` in a process of its own: the command line's own
flags and grammar, a sweep, one mistake of each kind. The other dry runs run the launcher's `main` in the test's process
(conftest.launch_in_process: the same code, its output and exit code, without a Python start-up each); a case that is
not a dry run always has a process of its own."""


def test_the_campaign_is_wide():
    """At least 60 distinct mistakes, across every group."""
    assert len(CASES) >= 60 and len({c[0] for c in CASES}) == len(CASES)
    assert len({tuple(c[1]) for c in CASES}) == len(CASES)


@pytest.mark.parametrize("args,names,real", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_mistake_is_one_line_naming_what_to_fix(ws, tmp_path, request, args, names, real):
    args = [a.replace("{ws}", str(ws)) for a in args]
    if not any(a.startswith("hydra.run.dir=") for a in args) and "-m" not in args:
        args.append(f"hydra.run.dir={tmp_path / 'run'}")
    if "-m" in args:
        args.append(f"hydra.sweep.dir={tmp_path / 'sweep'}")
    if real and request.node.callspec.id not in RELAYED:
        out = launch_here(*args, cwd=tmp_path, timeout=300)
    elif real or "launcher.dry_run=true" not in args or request.node.callspec.id in THROUGH_THE_CLI:
        out = run_cli(*args, cwd=tmp_path, timeout=300 if real else 60)
    else:  # a dry run: the launcher starts nothing, whatever it finds
        out = launch_in_process(*args, cwd=tmp_path)
    shown = out.stdout + out.stderr
    assert out.returncode != 0, shown[-3000:]
    assert "Traceback" not in shown, shown[-3000:]
    line = last_line(out.stderr)
    assert line.startswith("error: ") and names.replace("{ws}", str(ws)) in line, shown[-3000:]
