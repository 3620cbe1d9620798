"""Rows of several samples: transformers' block-diagonal mask against attention per sample (finetune.rank.varlen).

    python scripts/benchmark_varlen.py                       # 1k, 4k and 8k-token rows, sdpa and eager, on CPU
    python scripts/benchmark_varlen.py --rows 4096 --kernels sdpa --device cuda --dtype bf16

A forward and backward of a tiny Llama (--hidden 256, --layers 4, 4 heads; random init) over one row of
--rows tokens made of samples of 34 to 470 tokens (the peer benchmark's alpaca rows), each with its position ids
restarting at 0: the way packed rows (data.packing) and padding-free micro-batches (data.padding_free) reach
the model. "mask" is transformers' own reading of such a row (an [S, S] causal mask within each sample: memory
and work quadratic in the row); "per sample" is finetune.rank.varlen (the same kernel once per sample: no mask);
on CUDA with flash-attn, flash_attention_2 is transformers' variable-length path. Each case runs in a fresh
process: the median step over --steps after one warm-up step, and the process's peak RSS (on CUDA, the
allocator's peak). The outputs of both paths are checked equal first (max |difference| of the logits).
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import subprocess
import sys
import time


def sample_lengths(total: int, seed: int = 0) -> list[int]:
    rng, out = random.Random(seed), []
    while sum(out) < total:
        out.append(min(rng.randint(34, 470), total - sum(out)))
    return out


def child(args: argparse.Namespace) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from finetune.rank import varlen

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    kernel, mode = args.child.split(":")
    rows = args.rows[0]
    config = AutoConfig.for_model("llama", hidden_size=args.hidden, intermediate_size=3 * args.hidden, num_hidden_layers=args.layers,
                                  num_attention_heads=4, num_key_value_heads=4, vocab_size=128, max_position_embeddings=rows)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=kernel, dtype=dtype).to(device)
    if mode == "per sample":
        varlen.Varlen(model)
    lengths = sample_lengths(rows)
    ids = torch.randint(0, 128, (1, rows), generator=torch.Generator().manual_seed(1)).to(device)
    pos = torch.cat([torch.arange(n) for n in lengths])[None].to(device)
    times = []
    for _ in range(args.steps + 1):
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        sync()
        start = time.perf_counter()
        logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits
        logits.float().square().mean().backward()
        sync()
        times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    with torch.no_grad():
        first = model(input_ids=ids, position_ids=pos, use_cache=False).logits[0, :64].float().cpu().tolist()
    peak = torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else \
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"ms": 1000 * statistics.median(times[1:]), "peak_mib": peak, "samples": len(lengths), "logits": first}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1024, 4096, 8192], help="tokens per row")
    parser.add_argument("--kernels", nargs="+", default=["sdpa", "eager"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    cases = [(k, m) for k in args.kernels for m in (("varlen",) if k.startswith("flash") else ("mask", "per sample"))]
    lines = [f"| row tokens | samples | kernel | attention | step ms (fwd+bwd) | peak {'GPU MiB' if args.device != 'cpu' else 'RSS MiB'} | speed-up |",
             "|---|---|---|---|---|---|---|"]
    for rows in args.rows:
        results = {}
        for kernel, mode in cases:
            common = [f"--{k}={getattr(args, k)}" for k in ("device", "dtype", "hidden", "layers", "steps", "threads")]
            out = subprocess.run([sys.executable, __file__, f"--child={kernel}:{mode}", "--rows", str(rows), *common],
                                 capture_output=True, text=True)
            if out.returncode:
                sys.exit(f"error: {kernel} {mode} at {rows} tokens failed:\n{out.stderr[-2000:]}")
            results[kernel, mode] = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"{rows} tokens, {kernel}, {mode}: {results[kernel, mode]['ms']:.0f} ms", file=sys.stderr, flush=True)
        for kernel, mode in cases:
            r = results[kernel, mode]
            base = results.get((kernel, "mask")) or results.get(("sdpa", "mask"), r)  # flash-attn: against sdpa's mask
            diff = max(abs(a - b) for ra, rb in zip(r["logits"], base["logits"]) for a, b in zip(ra, rb))
            if diff > (1e-3 if args.dtype == "fp32" else 5e-2):
                sys.exit(f"error: {kernel} {mode} differs from the mask by {diff:.2e} at {rows} tokens")
            lines.append(f"| {rows:,} | {r['samples']} | {kernel} | {mode} | {r['ms']:,.0f} | {r['peak_mib']:,.0f} | "
                         f"{base['ms'] / r['ms']:.2f}x |")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
