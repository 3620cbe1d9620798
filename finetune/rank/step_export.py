"""A checkpoint in transformers' form: RUN_DIR/checkpoints/step_N/hf/, the same form final/ has (the whole model, or
the adapter with peft), from any engine's native checkpoint, on one process, no launcher.

`python -m finetune.export RUN_DIR --step N` calls `converted`: step_N/hf/ as train.save_hf wrote it, or else made
here from the engine's own files, which meta.json's layout names:
- torch (single, DDP): state.pt's "model", the module's state_dict, loaded with torch.load;
- mesh (FSDP2, TP, PP): the torch.distributed.checkpoint shards, read whole with DCP's format utility
  `dcp_to_torch_save`; under pipeline parallel each stage's keys lose their stage index, as the export of final/ does;
- deepspeed (ZeRO 0-3): the fp32 weights from DeepSpeed's partitions (`get_fp32_state_dict_from_zero_checkpoint`).
The model is then built as the run built it (its config.yaml: model, peft, method's model class), the trained
weights loaded into it (with peft: the adapters and modules_to_save, the rest is the base it started from), and
written by save_pretrained as the engines write final/ (a pissa/olora adapter converted to the original base).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from finetune.data.images import save_tokenizer
from finetune.rank import checkpoint
from finetune.config import CheckpointingConfig, Config, PeftMethod
from finetune.rank.finished import Refusal


def step_dir(run_dir: Path, step: int) -> Path:
    """RUN_DIR/checkpoints/step_N, complete; Refusal listing the steps there when it is not one of them."""
    root = run_dir / "checkpoints"
    found = checkpoint.complete(root)
    wanted = root / checkpoint.tag(step)
    if wanted not in found:
        steps = ", ".join(p.name.split("_")[1] for p in found) or "none"
        raise Refusal(f"--step {step}: {run_dir} has no complete checkpoint of step {step} (steps saved there: {steps}; "
                      "train.save_every sets how often a run saves)")
    return wanted


def converted(run_dir: Path, cfg: Config, step: int) -> Path:
    """step_N/hf/ (train.save_hf's, or written now from the native checkpoint): a directory final/ would equal."""
    where = step_dir(run_dir, step)
    out = where / checkpoint.HF
    if (out / "config.json").is_file() or (out / "adapter_config.json").is_file():
        return out
    meta = json.loads((where / checkpoint.META).read_text())
    state = native_state(where, meta["layout"])
    net, tokenizer = built(run_dir, cfg)
    load_trained(net, state, trained_only=cfg.peft.name != PeftMethod.none, where=where)
    from finetune.rank.model import adapter_save_kwargs

    with adapter_save_kwargs(net) as kwargs:
        net.save_pretrained(out, **kwargs)
    save_tokenizer(tokenizer, out)
    return out


def native_state(where: Path, layout: dict[str, Any]) -> dict[str, Any]:
    """The trained module's state_dict (its parameter names) from the engine's own checkpoint files."""
    import torch

    if layout["engine"] == "torch":
        from finetune.rank.engine.torch_engine import STATE_FILE

        return torch.load(where / STATE_FILE, map_location="cpu", weights_only=False)["model"]
    if layout["engine"] == "deepspeed":
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        return get_fp32_state_dict_from_zero_checkpoint(str(where.parent), tag=where.name)
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(where, Path(tmp, "whole.pt"))
        model = torch.load(Path(tmp, "whole.pt"), map_location="cpu", weights_only=False)["model"]
    if layout["pp"] > 1:  # the stages' ModuleList: "<stage>.<the whole model's name>"
        model = {k.split(".", 1)[1]: v for k, v in model.items()}
    return model


def built(run_dir: Path, cfg: Config) -> tuple[Any, Any]:
    """The model as the run built it before training (its adapters at their initial values), on CPU in fp32."""
    import torch

    from finetune import methods
    from finetune.config import PeftMethod
    from finetune.rank import model, vision
    from finetune.rank.engine.common import place

    from finetune.data.images import pictures_of
    from finetune.methods.base import built_as

    tokenizer = model.load_tokenizer(cfg.model, cfg.data)  # with the template the run trained with
    model_class = built_as(methods.get(cfg.method.name).model_class, pictures_of(tokenizer) is not None)
    net = model.load_model(cfg.model, tokenizer, attention="sdpa", peft=cfg.peft, compute_dtype=torch.float32, zero3=False,
                           run_dir=run_dir, is_main=False, barrier=lambda: None, model_class=model_class)
    place(net.parameters(), None, torch.float32)  # read in the checkpoint's dtype: the trained fp32 weights go into fp32
    _, kept = vision.freeze(net, cfg.model.freeze, adapters=cfg.peft.name != PeftMethod.none)  # as the run froze it
    return model.apply_strategies(net, checkpointing=CheckpointingConfig(), peft=cfg.peft, model_class=model_class, kept=kept), tokenizer


def load_trained(net: Any, state: dict[str, Any], *, trained_only: bool, where: Path) -> None:
    """Copy the checkpoint's weights into `net`: every one (full fine-tuning), or the trained ones (peft: the base is
    the one the run started from). Refusal naming what the checkpoint lacks."""
    import torch

    wanted = {n for n, p in net.named_parameters() if p.requires_grad} if trained_only else set(net.state_dict())
    missing = sorted(wanted - set(state))
    if missing:
        raise Refusal(f"{where}: the checkpoint holds no {missing[0]} (and {len(missing) - 1} more) that this run's model "
                      "has: was it written by another config?")
    with torch.no_grad():
        own = net.state_dict(keep_vars=True)
        for name in wanted:
            own[name].copy_(state[name].to(own[name].dtype))
