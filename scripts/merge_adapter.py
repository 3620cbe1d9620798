"""Merge a PEFT adapter (a run's `final/` with peft=lora|dora|qlora) into its base model and
write plain Hugging Face weights that load without peft.

    python scripts/merge_adapter.py RUN_DIR/final MERGED_DIR [--base PATH_OR_HUB_ID] [--dtype bf16]

For a run's `final/` (its config.yaml beside it) this is `finetune.rank.finished.load`, what `python -m finetune.export
RUN_DIR` also writes (with a model card): a QLoRA adapter merges into the base as the run quantized it to 4 bits, the
weights it trained against. For an adapter alone, or with --base, the base defaults to the one recorded in the adapter
(`base_model_name_or_path`) and is loaded unquantized, as the class the adapter's task type names: a causal LM, or for a
reward model (method=reward, task_type SEQ_CLS) a sequence classifier with one label whose trained score head the
adapter carries; the merged model loads with that Auto class.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch


def merge(adapter: Path, out: Path, base: str | None = None, dtype: str = "fp32") -> Path:
    import transformers
    from peft import PeftModel
    from transformers import AutoTokenizer

    config_file = adapter / "adapter_config.json"
    if not config_file.is_file():
        raise SystemExit(f"error: {adapter} holds no adapter_config.json: is it the final/ of a run with peft=lora|dora|qlora?")
    adapter_config = json.loads(config_file.read_text())
    if base is None and (adapter.parent / "config.yaml").is_file():
        from finetune.rank.finished import locate, load

        run = locate(str(adapter.parent))
        if Path(run.model).resolve() == adapter.resolve():
            model, tokenizer = load(run, dtype)
            model.save_pretrained(out)
            tokenizer.save_pretrained(out)
            return out
    base = base or adapter_config["base_model_name_or_path"]
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    tokenizer = AutoTokenizer.from_pretrained(adapter)
    model_class, head = model_of(adapter_config.get("task_type"), tokenizer)
    model = getattr(transformers, model_class).from_pretrained(base, dtype=torch_dtype, **head)
    merged = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    merged.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def model_of(task_type: str | None, tokenizer: object) -> tuple[str, dict[str, object]]:
    """(transformers Auto class, config keys) the adapter's base is loaded as: finetune.rank.model's table read backwards."""
    from finetune.rank.model import CAUSAL_LM, PEFT_TASKS, head_config

    model_class = next((cls for cls, task in PEFT_TASKS.items() if task == task_type), CAUSAL_LM)
    return model_class, head_config(model_class, tokenizer)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("adapter", type=Path, help="the adapter directory (RUN_DIR/final)")
    parser.add_argument("out", type=Path, help="where to write the merged model")
    parser.add_argument("--base", help="base model path or hub id (default: the one the adapter records)")
    parser.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32")
    args = parser.parse_args(argv)
    print(f"merged into {merge(args.adapter, args.out, args.base, args.dtype)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
