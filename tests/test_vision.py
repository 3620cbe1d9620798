"""Vision-language models: read from their own config (finetune/families/vision.py), their parts found in the built model
by one code path (finetune/rank/vision.py), model.freeze applied to them, and what the launcher refuses before launch.
Tiny random-init models of eight classes (tests/vision_models.py)."""

from __future__ import annotations

import json
import re

import pytest

import vision_models
from conftest import run_cli, train_here
from finetune.config import ConfigError
from finetune.families.vision import vision_of

torch = pytest.importorskip("torch")

SHORT = ["+recipe=quickstart_sft", "model=pretrained", "launcher.nproc_per_node=1", "parallelism=single", "train.max_steps=2",
         "optim.warmup_steps=0", "train.micro_batch_size=4", "train.global_batch_size=4", "train.eval_every=0"]


@pytest.fixture(scope="module")
def vlm_dirs(tmp_path_factory):
    """Model directories of the tiny gemma3 (AutoModelForCausalLM builds it) and llava (it does not)."""
    root = tmp_path_factory.mktemp("vlm")
    return {name: vision_models.save(name, root / name) for name in ("gemma3", "llava")}


@pytest.mark.parametrize("name", vision_models.NAMES)
def test_the_config_says_what_it_is(name):
    """vision_of reads each class's config.json: the image token (under either key), the language model's config,
    cross-attention (mllama only), and the tokens per image where the config fixes them (Gemma 3's 4)."""
    config, tok = vision_models.config(name)
    v = vision_of(config.to_dict())
    assert v is not None and v.model_type == name
    token = {"gemma3": "<image_soft_token>", "llava": "<image>", "llava_next": "<image>", "mllama": "<|image|>",
             "mistral3": "[IMG]", "idefics3": "<image>", "smolvlm": "<image>", "internvl": "<IMG_CONTEXT>"}.get(name, "<|image_pad|>")
    assert v.image_token_id == tok.convert_tokens_to_ids(token)
    assert v.text["hidden_size"] == 64 and v.vision
    assert v.cross_attention == (name == "mllama")
    assert v.tokens_per_image == (4 if name == "gemma3" else None)
    assert vision_of(config.get_text_config().to_dict()) is None  # the language model alone is a text model


@pytest.mark.parametrize("name", vision_models.NAMES)
def test_one_code_path_finds_the_parts_of_every_class(name):
    """The vision tower, the projector and the language model are found in each class (none named in the code but by
    transformers' own lookups and the projector's names); with the output head they hold every parameter once."""
    from finetune.rank.vision import freeze, parts

    model = vision_models.build(name)
    found = parts(model)
    assert found.vision is not None and found.projector is not None and found.language is not None
    ids = [{id(p) for p in found.named(part)} for part in ("vision", "projector", "language")]
    assert all(ids) and not (ids[0] & ids[1] or ids[0] & ids[2] or ids[1] & ids[2])
    head = {id(p) for p in model.get_output_embeddings().parameters()}
    every = {id(p) for p in model.parameters()}
    assert set().union(*ids) | head == every
    frozen, kept = freeze(model, None, adapters=False)  # model.freeze=null, full fine-tuning: the vision tower
    assert list(frozen) == ["vision"] and frozen["vision"] == sum(p.numel() for p in found.named("vision"))
    assert all(not p.requires_grad for p in found.named("vision")) and all(p.requires_grad for p in found.named("projector"))
    assert kept and all(name.startswith(_path(model, found.vision)) for name in kept)


def _path(model, module) -> str:
    return next(n for n, m in model.named_modules() if m is module)


def test_a_text_model_has_no_parts_to_freeze():
    from finetune.rank.vision import freeze, parts

    model = vision_models.build("llava").model.language_model
    assert parts(model).vision is None and freeze(model, None, adapters=False) == ({}, set())


def test_model_freeze_chooses_what_trains(vlm_dirs, tmp_path, capsys):
    """model.freeze=null keeps the vision tower frozen, [] trains it too, [vision,projector] with LoRA puts adapters in the
    language model only: the counts of trainable parameters say what runs."""
    path = f"model.path={vlm_dirs['gemma3']}"
    counts = {}
    for label, extra in (("default", []), ("none", ["model.freeze=[]"]), ("lora", ["peft=lora"])):
        train_here([*SHORT, path, *extra], tmp_path / label)
        out = capsys.readouterr().out
        total, trainable = map(lambda s: int(s.replace(",", "")), re.search(r"model: ([\d,]+) parameters, ([\d,]+) trainable", out).groups())
        counts[label] = (total, trainable, out)
    model = vision_models.build("gemma3")
    from finetune.rank.vision import parts

    found = parts(model)
    vision = sum(p.numel() for p in found.named("vision"))
    assert counts["none"][1] == counts["none"][0] == sum(p.numel() for p in model.parameters())
    from finetune.launcher.compose import preflight
    from finetune.planner.peak import plan

    for label, extra in (("default", []), ("none", ["model.freeze=[]"])):  # the planner counts what the rank trains
        assert plan(preflight([*SHORT, path, *extra])).trainable == counts[label][1]
    assert counts["default"][1] == counts["none"][1] - vision
    assert f"vision-language model: frozen vision ({vision:,} parameters) (model.freeze)" in counts["default"][2]
    adapters = json.loads((tmp_path / "lora" / "final" / "adapter_config.json").read_text())["target_modules"]
    assert adapters and all(t.startswith("model.language_model.") for t in adapters)


def test_a_vision_language_model_trains_its_language_through_the_cli_with_the_vision_tower_kept(vlm_dirs, tmp_path):
    """The real command line on gemma3's checkpoint: text rows train the language model; the exported vision tower is
    the one loaded, byte for byte."""
    from safetensors.torch import load_file

    out = run_cli(*SHORT, f"model.path={vlm_dirs['gemma3']}", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    before, after = load_file(vlm_dirs["gemma3"] / "model.safetensors"), load_file(tmp_path / "run" / "final" / "model.safetensors")
    assert set(before) == set(after)
    vision = [k for k in before if k.startswith("vision_tower.")]
    language = [k for k in before if k.startswith("language_model.")]
    assert vision and all(torch.equal(before[k], after[k]) for k in vision)
    assert any(not torch.equal(before[k], after[k]) for k in language)


def test_a_class_the_method_cannot_build_is_refused_before_launch(vlm_dirs, tmp_path):
    """A reward model (a sequence classifier) of LLaVA: transformers has none; the line names the image-text models it
    has one for. (SFT builds LLaVA as its image-text class: methods.base.built_as.)"""
    from finetune.config import ASSETS

    out = run_cli("+recipe=quickstart_sft", "method=reward", f"data.train={ASSETS / 'data/quickstart_dpo/train.jsonl'}",
                  "model=pretrained", f"model.path={vlm_dirs['llava']}", "launcher.dry_run=true", cwd=tmp_path)
    assert out.returncode != 0
    line = out.stderr.strip().splitlines()[-1]
    assert line == (f"error: model.path={vlm_dirs['llava']} is a vision-language model (model_type=llava: a vision tower, "
                    "a projector and a llama language model) that transformers' AutoModelForSequenceClassification, the class "
                    "method=reward trains, cannot build: of the image-text models, AutoModelForSequenceClassification builds "
                    "gemma3, mistral4, qwen3_5, t5gemma2"), line
    ok = run_cli("+recipe=quickstart_sft", "model=pretrained", f"model.path={vlm_dirs['llava']}", "launcher.dry_run=true", cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr[-1500:]


def test_model_freeze_on_a_text_model_is_refused(compose):
    with pytest.raises(ConfigError, match=r"^model.freeze=\[vision\] names parts of a vision-language model, but model.init is "
                                          r"a text model \(no vision_config\): remove model.freeze$"):
        compose(["+recipe=quickstart_sft", "model.freeze=[vision]"])


def test_qlora_quantizes_the_language_model_only(vlm_dirs, tmp_path):
    """bitsandbytes 4-bit on the language model's linear layers; the vision tower, the projector and the head stay as
    they were (finetune.rank.vision.NOT_QUANTIZED)."""
    pytest.importorskip("bitsandbytes")
    from bitsandbytes.nn import Linear4bit

    from finetune.config import ModelConfig, PeftConfig, PeftMethod
    from finetune.rank.model import load_model, load_tokenizer

    cfg = ModelConfig(path=str(vlm_dirs["gemma3"]))
    net = load_model(cfg, load_tokenizer(cfg), attention="sdpa", peft=PeftConfig(name=PeftMethod.qlora), compute_dtype=torch.float32,
                     zero3=False, run_dir=tmp_path, is_main=True, barrier=lambda: None)
    kinds = {name: type(m) for name, m in net.named_modules() if isinstance(m, torch.nn.Linear)}
    language = [n for n in kinds if n.startswith("model.language_model.")]
    others = [n for n in kinds if not n.startswith("model.language_model.")]
    assert language and all(issubclass(kinds[n], Linear4bit) for n in language)
    assert any(n.startswith("model.vision_tower.") for n in others) and not any(issubclass(kinds[n], Linear4bit) for n in others)


@pytest.mark.parametrize("layout,spelled", [(["parallelism=tp2"], "parallelism.tp=2"), (["parallelism=cp2"], "parallelism.cp=2"),
                                            (["parallelism=pp2"], "parallelism.pp=2")])
def test_model_parallel_layouts_are_refused_for_a_vision_language_model(vlm_dirs, compose, layout, spelled, tmp_path):
    """tp, pp and cp follow the language model's plans: refused before launch, naming the layout and the model (its
    config untied, which pipeline parallel needs first)."""
    import shutil

    untied = shutil.copytree(vlm_dirs["gemma3"], tmp_path / "gemma3")
    config = json.loads((untied / "config.json").read_text())
    config["tie_word_embeddings"] = config["text_config"]["tie_word_embeddings"] = False
    (untied / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=rf"^{re.escape(spelled)} is not supported for a vision-language model "
                                          r"\(model_type=gemma3\): its tensor-parallel, pipeline and context-parallel plans"):
        compose(["+recipe=quickstart_sft", "model=pretrained", f"model.path={untied}", "launcher.nproc_per_node=2",
                 "train.micro_batch_size=1", "train.global_batch_size=8", *layout])


@pytest.mark.parametrize("layout", [["parallelism=ddp"], ["parallelism=fsdp"], ["zero=stage3", "parallelism=ddp"]],
                         ids=["ddp", "fsdp", "zero3"])
def test_a_vision_language_model_trains_on_two_ranks_as_on_one(vlm_dirs, tmp_path, layout):
    """DDP (the vision tower and projector take no part in a text row's forward: unused parameters), FSDP2 (its check
    reads the language model's config) and ZeRO-3 (the planner's meta build on rank 0 stays out of zero.Init's
    collectives) each train Gemma 3's language model to the eval loss one process reaches."""
    from ranks import launch_here

    common = [*SHORT[:2], f"model.path={vlm_dirs['gemma3']}", *SHORT[4:6], "train.global_batch_size=4", "train.eval_every=0"]
    one = train_here([*common, "launcher.nproc_per_node=1", "parallelism=single", "train.micro_batch_size=4"], tmp_path / "one")
    out = launch_here(*common, "launcher.nproc_per_node=2", "train.micro_batch_size=2", *layout, f"hydra.run.dir={tmp_path / 'two'}",
                      cwd=tmp_path)
    assert out.returncode == 0, (out.stdout[-1500:], out.stderr[-1500:])
    two = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert two["after"]["eval_loss"] == pytest.approx(one["after"]["eval_loss"], abs=2e-3)
    assert two["after"]["eval_loss"] < two["before"]["eval_loss"] - 0.3
    assert "vision-language model: frozen vision (80,448 parameters) (model.freeze)" in out.stdout
