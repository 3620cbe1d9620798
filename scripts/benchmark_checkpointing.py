"""Activation checkpointing's policies side by side on one model: activation memory measured and planned, and the
step time, one Markdown table.

    python scripts/benchmark_checkpointing.py                      # a 4-block Llama (h 256), 4 x 512 tokens, fp32, CPU
    python scripts/benchmark_checkpointing.py --device cuda --precision bf16 --hidden 1024 --seq 2048
    python scripts/benchmark_checkpointing.py --only none full ops

Each row is the rank's own pieces in this process (model.apply_strategies, TorchEngine, the SFT objective): memory is
MemoryProbe's (MemTracker: activations and temporaries at the start or the worst moment of the model's backward, what
the planner's activations predict; on CUDA also the allocator's peak), the plan is finetune.planner's for the same
config (hardware=cpu on CPU, where offloading moves nothing and counts as its recompute; h200_141g on CUDA); the step
time is the median of --steps steps without the probe, after one warm-up step.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

POLICIES = ["none", "selective", "ops", "full", "full_offload", "offload"]


def config(args: argparse.Namespace, policy: str):
    from finetune.launcher.compose import preflight

    return preflight([
        f"model.init.hidden_size={args.hidden}", f"model.init.intermediate_size={args.hidden * 11 // 4}",
        f"model.init.num_hidden_layers={args.layers}", f"model.init.max_position_embeddings={args.seq}",
        f"model.init.num_attention_heads={args.hidden // 64}", f"model.init.num_key_value_heads={max(1, args.hidden // 128)}",
        f"data.max_length={args.seq}", f"train.micro_batch_size={args.batch}", f"train.global_batch_size={args.batch}",
        f"checkpointing={policy}", f"precision={args.precision}", "optim.warmup_steps=0",
        "hardware=h200_141g" if args.device == "cuda" else "hardware=cpu", f"train.device={args.device}",
    ])


def measure(args: argparse.Namespace, policy: str) -> dict[str, float]:
    import torch

    from finetune.data.lengths import Longest
    from finetune.methods.sft import SFT
    from finetune.planner.peak import plan
    from finetune.planner.records import MIB
    from finetune.rank import model
    from finetune.rank.dist import Dist
    from finetune.rank.engine.torch_engine import TorchEngine
    from finetune.rank.memory import MemoryProbe

    cfg, device = config(args, policy), torch.device(args.device)
    torch.manual_seed(0)
    tok = model.load_tokenizer(cfg.model)
    with tempfile.TemporaryDirectory() as run_dir:
        net = model.load_model(cfg.model, tok, attention="sdpa", peft=cfg.peft, compute_dtype=torch.float32, zero3=False,
                               run_dir=Path(run_dir), is_main=True, barrier=lambda: None)
    net = model.apply_strategies(net.to(device), checkpointing=cfg.checkpointing, peft=cfg.peft)
    dist = Dist(rank=0, local_rank=0, world_size=1, device=device)
    engine = TorchEngine(net, optim=cfg.optim, precision=cfg.precision, max_steps=args.steps + 3,
                         strategy=cfg.parallelism.strategy, dist=dist)
    ids = torch.randint(3, len(tok), (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids.to(device), "labels": ids.to(device), "attention_mask": torch.ones_like(ids).to(device)}
    sft = SFT()
    probe = MemoryProbe(*engine.memory_targets(), device)
    with probe.track():
        norm = engine.train_step([batch], sft, sft.count(batch)).grad_norm  # the same gradients: the same norm
    measured = probe.report()
    del probe
    times = []
    for _ in range(args.steps + 1):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        engine.train_step([batch], sft, sft.count(batch))
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    planned = plan(cfg, Longest(args.seq, "the benchmark's rows"))
    row = {"grad_norm": float(norm), "measured_mib": measured["mem_backward_activations_mib"],
           "planned_mib": planned.measured_activations / MIB, "host_mib": planned.cpu_bytes / MIB,
           "step_s": statistics.median(times[1:])}
    if device.type == "cuda":
        row["cuda_peak_mib"] = measured.get("mem_cuda_max_allocated_mib", 0.0)
    return row


def table(rows: dict[str, dict[str, float]]) -> str:
    base = rows.get("none")
    lines = ["| checkpointing | activations measured (MiB) | planned (MiB) | planned host (MiB) | step (s) | vs none | grad norm |",
             "|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        slower = f"{r['step_s'] / base['step_s']:.2f}x" if base else ""
        cuda = f" (CUDA peak {r['cuda_peak_mib']:.1f})" if "cuda_peak_mib" in r else ""
        lines.append(f"| {name} | {r['measured_mib']:.1f}{cuda} | {r['planned_mib']:.1f} | {r['host_mib']:.1f} | "
                     f"{r['step_s']:.3f} | {slower} | {r['grad_norm']:.6f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=POLICIES, default=POLICIES)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    args = parser.parse_args(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    rows = {policy: measure(args, policy) for policy in args.only}
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
