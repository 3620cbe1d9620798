"""`finetune COMMAND ARGS`: the console entry point (pyproject's [project.scripts]) beside the `python -m` forms, which stay.

    finetune train +recipe=quickstart_sft [key=value ...]     python -m finetune.launch ...
    finetune plan +recipe=...                                 python -m finetune.plan ...
    finetune prepare +recipe=...                              python -m finetune.prepare ...
    finetune export RUN_DIR [--gguf q8_0 ...]                 python -m finetune.export ...
    finetune generate RUN_DIR --prompt TEXT                   python -m finetune.generate ...
    finetune evaluate RUN_DIR tasks=a,b                       python -m finetune.evaluate ...
    finetune --version

Each command is its module's own `main`, with the same arguments; this file only dispatches (and imports no torch).
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "train": ("finetune.launch", "compose a recipe and overrides, check them, plan the memory, launch the ranks (or -m: a sweep)"),
    "plan": ("finetune.plan", "the memory a recipe needs per rank, and what would make it fit"),
    "prepare": ("finetune.prepare", "tokenize a recipe's data into the token cache, before any launch"),
    "export": ("finetune.export", "a run's final/ (or a step) merged, in a dtype, and as GGUF"),
    "generate": ("finetune.generate", "talk to a trained run: prompts, a file of them, or stdin"),
    "evaluate": ("finetune.evaluate", "lm-evaluation-harness tasks on a run's final/"),
}


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("finetune")
    except PackageNotFoundError:  # a checkout on sys.path, not installed
        return "unknown (not installed: pip install -e .)"


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {text} (python -m {module})" for name, (module, text) in COMMANDS.items()]
    return "usage: finetune COMMAND [ARGS ...]   (finetune COMMAND --help: its own arguments)\n\ncommands:\n" + "\n".join(lines) + \
        "\n  --version  the installed version"


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(usage(), file=sys.stdout if args else sys.stderr)
        return 0 if args else 2
    if args[0] in ("--version", "-V", "version"):
        print(f"finetune {version()}")
        return 0
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        from finetune.errors import did_you_mean

        print(f"error: finetune {name}: no such command{did_you_mean(name, list(COMMANDS))}; the commands: {', '.join(COMMANDS)} "
              "(finetune --help)", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    if name == "train":  # Hydra reads sys.argv itself
        sys.argv = [f"finetune {name}", *rest]
        module.main()
        return 0
    return module.main(rest)


if __name__ == "__main__":
    sys.exit(main())
