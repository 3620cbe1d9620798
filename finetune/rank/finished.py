"""A finished run's model, for what comes after training (`finetune.export`, `finetune.generate`).

A run directory holds `config.yaml` (what trained it) and `final/`: a Hugging Face model, or with `peft=` a PEFT
adapter over the base its adapter_config.json names (RUN_DIR/base for a random-init model). `locate` finds
them, or takes a model directory or hub id alone (no run config); `load` returns one plain transformers model
with any adapter merged into its base. A QLoRA adapter trained against the 4-bit base, so it is merged into
that base dequantized (bitsandbytes' 4-bit weights as the run quantized them), not into the original weights.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from finetune.config import Config, PeftMethod, load as load_config
from finetune.methods.base import CAUSAL_LM, GENERATIVE, IMAGE_TEXT, SCORED, built_as, saved_class
from finetune.rundir import FINAL

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
"""--dtype choices -> torch dtype names."""


class Refusal(Exception):
    """A one-line reason the command cannot run (missing run directory, no final/, ...): exit code 2."""


@dataclass
class Finished:
    """What trained a model and where it is."""

    model: str
    """final/ (or the model directory / hub id given)."""
    run_dir: Path | None = None
    """The run directory, when one was given (it has config.yaml)."""
    config: Config | None = None
    """The run's resolved config (None for a bare model)."""

    @property
    def adapter(self) -> dict[str, Any] | None:
        """final/'s adapter_config.json, or None when it is a whole model."""
        file = Path(self.model) / "adapter_config.json"
        return json.loads(file.read_text()) if file.is_file() else None

    @property
    def base(self) -> str | None:
        """The base model an adapter applies to (None: a whole model)."""
        return self.adapter["base_model_name_or_path"] if self.adapter else None

    @property
    def model_class(self) -> str:
        """The transformers Auto class the model loads as: the run's method's (method=reward: a sequence classifier),
        else what the adapter's task type or the model's config.json says (a causal LM unless it is a classifier)."""
        file = Path(self.base or self.model) / "config.json"
        saved = saved_class(json.loads(file.read_text())) if file.is_file() else CAUSAL_LM
        if self.config is not None:
            from finetune import methods

            return built_as(methods.get(self.config.method.name).model_class, saved == IMAGE_TEXT)
        if self.adapter is not None and self.adapter.get("task_type") == "SEQ_CLS":
            return SCORED
        return saved

    def pictures(self) -> Any:
        """A vision-language model's processor (finetune.data.images.Pictures): final/'s (the run saves it with the
        tokenizer), else its base model's."""
        from finetune.data.images import Pictures
        from finetune.data.processors import has_processor
        from finetune.families.vision import vision_of

        source = next((s for s in (self.model, self.base) if s and has_processor(s)), self.base or self.model)
        vision = vision_of(json.loads((Path(self.base or self.model) / "config.json").read_text()))
        assert vision is not None
        return Pictures(source, None, False, vision.image_token_id, vision.model_type)

    def generative(self, command: str) -> None:
        """Refuse a model that scores rather than generates (a reward model) for `command`."""
        if self.model_class not in GENERATIVE:
            raise Refusal(f"{self.run_dir or self.model} is a reward model (a sequence classifier: one score per text), which "
                          f"{command} cannot use: it needs a causal language model (method=sft, dpo, kto or orpo)")


def locate(where: str, *, need_run: bool = False) -> Finished:
    """A run directory (config.yaml + final/), a model directory, or (without `need_run`) a hub id.

    Raises:
        Refusal: the directory does not exist, or holds no final/ (a run not finished), or no config.yaml with `need_run`.
    """
    path = Path(where).expanduser()
    if (path / "config.yaml").is_file():
        final = path / FINAL
        if not final.is_dir():
            raise Refusal(f"{where} holds no {FINAL}/: the run has not finished (its last checkpoint is in "
                          f"{where}/checkpoints; resume it with train.resume=auto)")
        return Finished(str(final), path, load_config(path / "config.yaml"))
    if need_run:
        what = "no such directory" if not path.exists() else "not a run directory (it has no config.yaml)"
        raise Refusal(f"{where}: {what}: give the directory a launch wrote (hydra.run.dir, or outputs/DATE/TIME)")
    if path.is_dir():
        if not any((path / f).is_file() for f in ("config.json", "adapter_config.json")):
            raise Refusal(f"{where} is neither a run directory (config.yaml) nor a model (config.json or adapter_config.json)")
        return Finished(str(path))
    if path.exists() or where.startswith((".", "/", "~")) or where.count("/") != 1:
        raise Refusal(f"{where}: no such directory (give a run directory, a model directory or a hub id)")
    return Finished(where)  # a hub id: transformers says what is wrong with it


def load(run: Finished, dtype: str = "fp32", attention: str | None = None) -> tuple[Any, Any]:
    """(model, tokenizer): the whole model in `dtype` (fp32, bf16, fp16), an adapter merged into its base, in eval mode,
    as its `model_class` (a reward model's sequence classifier keeps its score head and the pad id it pools by), with
    `attention` (transformers' attn_implementation; None: its default)."""
    import torch
    import transformers
    from transformers import AutoTokenizer

    from finetune.data.images import attach
    from finetune.rank.model import head_config

    torch_dtype = getattr(torch, DTYPES[dtype])
    tokenizer = AutoTokenizer.from_pretrained(run.model)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if run.model_class == IMAGE_TEXT:  # its processor travels with the tokenizer (saved beside it: save_tokenizer)
        attach(tokenizer, run.pictures())
    auto = getattr(transformers, run.model_class)
    kernel = {"attn_implementation": attention} if attention else {}
    if run.adapter is None:
        return auto.from_pretrained(run.model, dtype=torch_dtype, **kernel).eval(), tokenizer
    from peft import PeftModel

    qlora = run.config is not None and run.config.peft.name == PeftMethod.qlora
    head = head_config(run.model_class, tokenizer)
    base = quantized_base(run, head) if qlora else auto.from_pretrained(run.base, dtype=torch.float32, **head, **kernel)
    merged = PeftModel.from_pretrained(base, run.model).merge_and_unload()  # merged in fp32, then cast
    return merged.to(torch_dtype).eval(), tokenizer


def quantized_base(run: Finished, head: dict[str, Any]) -> Any:
    """A QLoRA run's base as it trained: quantized to 4 bits as the run did, then dequantized to fp32 (`head`: the config
    keys its model class needs, finetune.rank.model.head_config)."""
    import torch
    import transformers
    from transformers import BitsAndBytesConfig

    assert run.config is not None
    peft = run.config.peft
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=peft.quant_type.value,
                               bnb_4bit_use_double_quant=peft.double_quant, bnb_4bit_compute_dtype=torch.float32)
    device = {"": torch.cuda.current_device()} if torch.cuda.is_available() else "cpu"
    model = getattr(transformers, run.model_class).from_pretrained(run.base, quantization_config=quant, dtype=torch.float32,
                                                                   device_map=device, **head)
    return model.dequantize().to("cpu", torch.float32)
