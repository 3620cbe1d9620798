"""Per-rank worker: `python -m finetune.train RUN_DIR/config.yaml` (started by torchrun).

Reads the resolved config the launcher wrote (ranks never re-run Hydra), builds data, model and
engine, runs the shared loop, exports a Hugging Face checkpoint and reports.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from finetune import checkpoint, config, data, dist, engine, logs, loop, model, objectives
from finetune.config import Config, ConfigError, uses_deepspeed
from finetune.launcher import ERROR_FILE, deepspeed_config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("config", help="RUN_DIR/config.yaml written by finetune.launch")
    parser.add_argument("--local_rank", type=int, default=None, help="set by the deepspeed launcher (LOCAL_RANK is used)")
    args = parser.parse_args(argv)
    cfg = config.load(args.config)
    d = dist.init(cfg.train.device, deepspeed=uses_deepspeed(cfg))
    try:
        run(cfg, d)
    except ConfigError as e:  # a user mistake found on the rank (data vs. tokenizer): one line, no traceback
        if d.is_main:
            print(f"error: {e}", file=sys.stderr)
            (Path(cfg.run_dir) / ERROR_FILE).write_text(f"{e}\n")
        return 2
    finally:
        dist.shutdown()
    return 0


def run(cfg: Config, d: dist.Dist) -> None:
    run_dir = Path(cfg.run_dir)
    torch.manual_seed(cfg.train.seed)
    tokenizer = model.load_tokenizer(cfg.model)
    train_examples, eval_examples, stats = data.load_split(cfg.data, tokenizer, cfg.train.seed)
    if d.is_main:
        for name, s in stats.items():
            print(s.line(name, cfg.data.max_length))
    zero3 = model.zero3_context(deepspeed_config(cfg) if uses_deepspeed(cfg) else None)  # noqa: F841 - kept alive
    eng = engine.build(cfg, model.load_model(cfg.model, tokenizer), d)
    objective = objectives.build(cfg.method)
    batches = data.TrainBatches(train_examples, global_batch=cfg.train.global_batch_size, micro_batch=cfg.train.micro_batch_size,
                                dp_rank=d.rank, dp_size=d.world_size, seed=cfg.train.seed, pad_id=tokenizer.pad_token_id)
    log = logs.MetricsLog(run_dir, enabled=d.is_main, tensorboard=cfg.train.tensorboard)
    try:
        result = loop.train(cfg.train, engine=eng, objective=objective, batches=batches, evals=eval_examples,
                            tokenizer=tokenizer, dist=d, log=log, checkpoints=run_dir / "checkpoints",
                            resume_from=checkpoint.resolve(cfg.train.resume, run_dir))
    finally:
        log.close()
    final = run_dir / "final"
    eng.export(final, tokenizer)
    if d.is_main:
        report(run_dir, final, result, {k: vars(s) for k, s in stats.items()})


def report(run_dir: Path, final: Path, result: dict[str, dict[str, float]], stats: dict) -> None:
    """summary.json, the loss-curve PNG, and the before/after lines a user reads first."""
    (run_dir / "summary.json").write_text(json.dumps({**result, "checkpoint": str(final), "data": stats}, indent=2) + "\n")
    logs.plot_loss(run_dir, run_dir / "loss.png")
    before, after = result["before"], result["after"]
    print()
    for key, fmt in (("eval_loss", "{:.4f}"), ("exact_match", "{:.1%}")):
        if key in after:
            print(f"{key:<12} {fmt.format(before[key])} -> {fmt.format(after[key])}")
    print(f"checkpoint   {final}  (AutoModelForCausalLM.from_pretrained / AutoTokenizer.from_pretrained)")
    print(f"metrics      {run_dir / logs.METRICS}, {run_dir / 'tensorboard'}, loss curve {run_dir / 'loss.png'}")


if __name__ == "__main__":
    sys.exit(main())
