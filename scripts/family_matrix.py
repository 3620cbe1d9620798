"""The family matrix: tiny random-init models of each family crossed with each strategy, through
the real CLI (2 optimizer steps per cell), recorded in scripts/family_matrix.json and shown as
the family table of the site's Model families page (docs/families.md).

    python scripts/family_matrix.py                               # run every cell (~20 min on 2 cores)
    python scripts/family_matrix.py --only gemma2 --strategies tp2 pp2
    python scripts/family_matrix.py --write docs/families.md      # the page's table from the recorded results
    python scripts/family_matrix.py --check docs/families.md      # exit 1 when the page's table is stale

A cell is `ok` (trained, finite loss), `refused` (the launcher refused it before any rank started:
its one line is the reason) or `failed` (a rank failed: a defect). Each model is built with
`AutoConfig.for_model(family, ...)` (no download) at a tiny size with the keys a family needs to
stay tiny (experts, head_dim), saved with the shipped tokenizer.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "scripts" / "family_matrix.json"
START = "<!-- family-matrix:start -->"
END = "<!-- family-matrix:end -->"

TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256)
FAMILIES: dict[str, dict] = {
    "llama": {}, "qwen2": {}, "qwen3": dict(head_dim=16), "mistral": {}, "gemma2": dict(head_dim=16), "phi3": {},
    "olmo2": {}, "granite": {},
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16),
    "gpt2": dict(n_inner=96),
}
"""Family -> the config keys (beyond TINY) that keep it tiny; the rest are transformers' defaults."""

ONE = ["parallelism=single", "launcher.nproc_per_node=1"]
STRATEGIES: dict[str, list[str]] = {
    "full": ONE,
    "lora": [*ONE, "peft=lora"],
    "qlora": [*ONE, "peft=qlora"],
    "checkpointing+bf16": [*ONE, "checkpointing=full", "precision=bf16"],
    "tp2": ["parallelism=tp2"],
    "fsdp": ["parallelism=fsdp"],
    "zero3": ["zero=stage3", "launcher.nproc_per_node=2"],
    "pp2": ["parallelism=pp2"],
    "dpo": [*ONE, "method=dpo", "data=quickstart_dpo"],
}
COMMON = ["+recipe=quickstart_sft", "model=pretrained", "train.max_steps=2", "optim.warmup_steps=0", "train.eval_every=0",
          "train.exact_match_samples=0", "train.progress_bar=false", "train.memory_report=false", "train.tensorboard=false",
          "train.micro_batch_size=4", "train.global_batch_size=8", "data.max_length=64", "data.eval=null", "data.eval_size=16"]


def build_models(root: Path, families: list[str]) -> dict[str, Path]:
    """Save a tiny random-init model of each family (with the shipped tokenizer) under root."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from finetune.config import ASSETS

    tok = AutoTokenizer.from_pretrained(ASSETS / "tokenizer")
    out = {}
    for family in families:
        out[family] = root / family
        if (out[family] / "config.json").is_file():
            continue
        config = AutoConfig.for_model(family, **TINY, **FAMILIES[family], vocab_size=len(tok), pad_token_id=tok.pad_token_id,
                                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(out[family])
        tok.save_pretrained(out[family])
    return out


def run_cell(model: Path, strategy: str, run_dir: Path, timeout: int = 600, launch: Callable[..., Any] | None = None) -> dict:
    """One cell through the real CLI: {"status": ok|refused|failed, "detail": loss or the one-line reason}. `launch(*args,
    cwd=, timeout=)`, where given, runs the launch instead (a test's in-process stand-in for the CLI; same result)."""
    args = [*COMMON, f"model.path={model}", *STRATEGIES[strategy], f"hydra.run.dir={run_dir}"]
    if launch is not None:
        out = launch(*args, cwd=run_dir.parent, timeout=timeout)
    else:
        out = subprocess.run([sys.executable, "-m", "finetune.launch", *args], capture_output=True, text=True, timeout=timeout,
                             cwd=run_dir.parent, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    last = (out.stderr.strip().splitlines() or ["(no output)"])[-1]
    if out.returncode == 0:
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        loss = [r["loss"] for r in rows if r["kind"] == "train"][-1]
        return {"status": "ok" if math.isfinite(loss) else "failed", "detail": loss}
    if out.returncode == 2:
        return {"status": "refused", "detail": last.removeprefix("error: ")}
    return {"status": "failed", "detail": last.removeprefix("error: "), "output": out.stderr[-4000:]}


def run_matrix(families: list[str], strategies: list[str], root: Path) -> dict[str, dict[str, dict]]:
    models = build_models(root / "models", families)
    results: dict[str, dict[str, dict]] = {}
    for family in families:
        for strategy in strategies:
            run_dir = root / "runs" / f"{family}-{strategy.replace('+', '_')}"
            run_dir.parent.mkdir(parents=True, exist_ok=True)
            cell = run_cell(models[family], strategy, run_dir)
            print(f"{family:10} {strategy:20} {cell['status']:8} {cell['detail']}", flush=True)
            if "output" in cell:
                print(cell.pop("output"), flush=True)
            results.setdefault(family, {})[strategy] = cell
    return results


def render(results: dict[str, dict[str, dict]]) -> str:
    """The family table: a row per family, a column per strategy; refusals and failures numbered, their lines below."""
    notes: list[str] = []
    lines = ["| family | " + " | ".join(STRATEGIES) + " |", "|---|" + "---|" * len(STRATEGIES)]
    for family in FAMILIES:
        cells = []
        for strategy in STRATEGIES:
            cell = results.get(family, {}).get(strategy)
            if cell is None:
                cells.append("not run")
            elif cell["status"] == "ok":
                cells.append("ok")
            else:
                line = cell["detail"]
                if line not in notes:
                    notes.append(line)
                cells.append(f"{cell['status']} ({notes.index(line) + 1})")
        lines.append(f"| {family} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n" + "".join(f"\n{i}. {line}" for i, line in enumerate(notes, 1)) + ("\n" if notes else "")


def section_of(text: str) -> str | None:
    if START not in text or END not in text:
        return None
    return text[text.find(START) + len(START):text.find(END)].strip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", choices=list(FAMILIES), help="families to run (default: all)")
    parser.add_argument("--strategies", nargs="+", choices=list(STRATEGIES), help="strategies to run (default: all)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", type=Path, metavar="PAGE", help="write the table of the recorded results between the markers (docs/families.md)")
    mode.add_argument("--check", type=Path, metavar="PAGE", help="exit 1 if the page's table is not that of the recorded results")
    args = parser.parse_args(argv)
    recorded = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {}
    if args.write or args.check:
        path = args.write or args.check
        text, table = path.read_text(), render(recorded)
        if section_of(text) is None:
            print(f"error: {path} has no {START} ... {END} markers: add them where the table goes", file=sys.stderr)
            return 2
        if args.check:
            if section_of(text) != table:
                print(f"{path}: the family table differs from {RESULTS.relative_to(REPO)}: regenerate with "
                      f"python scripts/family_matrix.py --write {path}", file=sys.stderr)
                return 1
            return 0
        path.write_text(text[:text.find(START)] + f"{START}\n{table}{END}" + text[text.find(END) + len(END):])
        print(f"{path}: family table written")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        fresh = run_matrix(args.only or list(FAMILIES), args.strategies or list(STRATEGIES), Path(tmp))
    for family, cells in fresh.items():
        recorded.setdefault(family, {}).update(cells)
    RESULTS.write_text(json.dumps(recorded, indent=1, sort_keys=True) + "\n")
    print(f"recorded in {RESULTS.relative_to(REPO)}; the site's table: python scripts/family_matrix.py --write docs/families.md")
    print(render(recorded))
    return 1 if any(c["status"] == "failed" for cells in fresh.values() for c in cells.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
