"""Generate the table of job recipes (recipes/recipe/*.yaml) on the site's Memory planning page
(docs/memory-planning.md): what each runs, on what hardware, and the memory planner's verdict for it.

    python scripts/recipe_table.py                    # print the table
    python scripts/recipe_table.py --write docs/memory-planning.md  # replace it between the marker comments
    python scripts/recipe_table.py --check docs/memory-planning.md  # exit 1 when the page's table is not the generated one

Each recipe is composed exactly as `python -m finetune.plan +recipe=NAME` composes it (offline: a
hub model's recipe declares its `model.architecture`), and planned with `finetune.planner.peak.plan` at
`data.max_length` (the upper bound: the recipe's data is the user's, not read here).
Needs no torch and no GPU.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from finetune.planner.peak import plan
from finetune.launcher.compose import RECIPES, preflight
from finetune.config import Config, ConfigError, Logits, Offload, PeftMethod
from finetune.layouts import engine_kind

START = "<!-- recipe-table:start -->"
END = "<!-- recipe-table:end -->"
GIB = 2**30


def strategies(cfg: Config) -> str:
    """The strategies of a config in words: precision, adapters, sharding/layout, checkpointing."""
    words = [cfg.precision.name.value]
    if cfg.peft.name != PeftMethod.none:
        words.append(f"{cfg.peft.name.value} r={cfg.peft.r}")
    if cfg.zero.enabled:
        words.append(f"ZeRO-{cfg.zero.stage}" + "".join(f" + {what} offload to {where.value}" for what, where in
                                                (("optimizer", cfg.zero.offload_optimizer), ("parameter", cfg.zero.offload_param))
                                                if where != Offload.none))
    elif engine_kind(cfg) == "mesh":
        p = cfg.parallelism
        words.append((" x ".join(f"{k}{v}" for k, v in (("tp", p.tp), ("pp", p.pp), ("cp", p.cp)) if v > 1) or p.strategy.value)
                     + (" + offload to cpu" if p.fsdp_offload else ""))
    words.append(f"checkpointing {cfg.checkpointing.name.value}")
    if cfg.logits.name != Logits.full:
        words.append(f"{cfg.logits.name.value} logits")
    words.append(f"{cfg.data.max_length} tokens x {cfg.train.micro_batch_size}")
    return ", ".join(words)


def row(name: str) -> str:
    cfg = preflight([f"+recipe={name}"])
    hw = cfg.hardware
    where = f"{cfg.world_size} x {hw.name}" if hw.name != "cpu" else f"{cfg.world_size} CPU rank{'s' if cfg.world_size > 1 else ''}"
    from finetune.config.fields import ASSETS

    model = cfg.model.path or "tiny random-init (model.init)"
    if Path(model).resolve().is_relative_to(ASSETS):  # shipped: named as the package holds it, not by this checkout's path
        model = str(Path(model).resolve().relative_to(ASSETS.parent.parent))
    if cfg.model.from_scratch:
        model = f"random-init from {model} (model.from_scratch)"
    try:
        pl = plan(cfg)
    except ConfigError:  # what it learns from is made by another recipe first: the model, or (method=distill) its teacher
        made, what = ((cfg.model.recipe_if_missing, "the model") if cfg.model.recipe_if_missing is not None
                      else (getattr(cfg.method, "teacher_recipe_if_missing", None), "the teacher"))
        if made is None:
            raise
        return f"| `{name}` | {model} | {strategies(cfg)} | {where} | after +recipe={made} makes {what} | |"
    if hw.name == "cpu":  # the budget is this machine's RAM: the planned bytes alone are the recipe's
        return f"| `{name}` | {model} | {strategies(cfg)} | {where} | in RAM (this machine's is the budget) | {pl.total / GIB:.2f} |"
    verdict = "fits" if pl.fits else "does not fit"
    return (f"| `{name}` | {model} | {strategies(cfg)} | {where} | {verdict} | "
            f"{pl.total / GIB:.2f} of {pl.budget / GIB:.2f} |")


def render() -> str:
    names = sorted(p.stem for p in (RECIPES / "recipe").glob("*.yaml"))
    head = ("| recipe | model | strategies (precision, adapters, sharding, checkpointing, tokens x micro batch) | hardware | "
            "plan | planned GiB per rank |\n|---|---|---|---|---|---:|")
    return "\n".join([head, *(row(n) for n in names)]) + "\n"


def section_of(text: str) -> str | None:
    if START not in text or END not in text:
        return None
    return text[text.find(START) + len(START):text.find(END)].strip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", type=Path, metavar="PAGE", help="replace the table between the markers (docs/memory-planning.md)")
    mode.add_argument("--check", type=Path, metavar="PAGE", help="exit 1 if the table is not the generated one")
    args = parser.parse_args(argv)
    table = render()
    if args.write:
        text = args.write.read_text()
        if section_of(text) is None:
            print(f"error: {args.write} has no {START} ... {END} markers: add them where the table goes", file=sys.stderr)
            return 2
        args.write.write_text(text[:text.find(START)] + f"{START}\n{table}{END}" + text[text.find(END) + len(END):])
        print(f"{args.write}: recipe table written ({table.count(chr(10)) - 2} recipes)")
    elif args.check:
        have = section_of(args.check.read_text())
        if have != table:
            print(f"{args.check}: the recipe table differs from the recipes and the planner: regenerate with "
                  f"python scripts/recipe_table.py --write {args.check}", file=sys.stderr)
            return 1
    else:
        print(table, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
