"""What loading a pretrained model takes from each rank's host memory, per layout: a seeded Llama saved in bf16 (read in
it, memory-mapped, cast on the device) beside its mixed twin (the same weights, its norms stored in fp32: a checkpoint
that mixes dtypes is read as every checkpoint was read before, the whole fp32 model private to each rank), each trained
for one step on N CPU ranks through the real command line. Prints, per layout and checkpoint, rank 0's private MiB after the model read and at the peak of the engine
build (on a CPU device the training weights are host memory too), and whether the first loss equals the twin's.

    python scripts/benchmark_loading.py                      # 181M parameters, ddp fsdp tp pp zero2 zero3
    python scripts/benchmark_loading.py --hidden 512 --layers 4 --layouts fsdp tp
    python scripts/benchmark_loading.py --hidden 2048 --layers 16 --dcp    # FSDP2: this read against DCP's

--dcp measures the alternative for FSDP2: the model built on the meta device, sharded, and each rank's shards read by
torch.distributed.checkpoint's HuggingFaceStorageReader, beside the read used (transformers' memory-mapped read in bf16,
fully_shard, each shard cast): each rank's private peak, seconds, and a checksum of the shards (the same weights).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LAYOUTS = {"ddp": ["parallelism=ddp"], "fsdp": ["parallelism=fsdp"], "tp": ["parallelism=tp2"], "pp": ["parallelism=pp2"],
           "zero2": ["parallelism=ddp", "zero=stage2"], "zero3": ["parallelism=ddp", "zero=stage3"]}


def save(where: Path, hidden: int, layers: int) -> int:
    """A seeded Llama of `layers` x `hidden` over the shipped compact tokenizer, saved in bf16; its parameter count."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(REPO / "finetune" / "assets" / "tokenizers" / "compact")
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_hidden_layers=layers,
                      num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 256), max_position_embeddings=512,
                      tie_word_embeddings=False, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    net = LlamaForCausalLM(cfg).to(torch.bfloat16)
    net.save_pretrained(where)
    tok.save_pretrained(where)
    return sum(p.numel() for p in net.parameters())


def mixed(src: Path, dst: Path) -> None:
    """`src`'s files with its norms' weights stored in fp32 (the same values): a checkpoint that mixes dtypes."""
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    for file in src.iterdir():
        if file.suffix != ".safetensors":
            (dst / file.name).write_bytes(file.read_bytes())
    weights = load_file(src / "model.safetensors")
    save_file({k: v.float() if "norm" in k else v for k, v in weights.items()}, dst / "model.safetensors", metadata={"format": "pt"})


def run(where: Path, layout: list[str], run_dir: Path, ranks: int) -> dict:
    cmd = [sys.executable, "-m", "finetune.launch", "+recipe=quickstart_sft", "model=pretrained", f"model.path={where}",
           f"model.tokenizer={where}", "train.max_steps=1", "optim.warmup_steps=0", "train.micro_batch_size=2",
           "train.global_batch_size=4", "train.eval_every=0", "data.eval=null", "data.eval_size=8", "train.exact_match_samples=0", f"launcher.nproc_per_node={ranks}",
           f"run_dir={run_dir}", *layout]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if out.returncode:
        sys.exit(f"error: {' '.join(layout)} on {where.name} failed: {(out.stderr or out.stdout).strip().splitlines()[-1]}")
    loading = json.loads((run_dir / "ranks" / "0.json").read_text())["loading"]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {**loading, "loss": next(r["loss"] for r in rows if r.get("kind") == "train")}


def fsdp_rank(path: str, how: str) -> None:
    """One rank of --dcp (started by torchrun): the model loaded into FSDP2 fp32 shards `how` ("mmap" or "dcp")."""
    import time

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM

    from finetune.rank.memory import LoadWatch

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    watch, start = LoadWatch(), time.perf_counter()
    if how == "dcp":
        config = AutoConfig.from_pretrained(path)
        with torch.device("meta"):
            net = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    else:
        net = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    for layer in net.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    if how == "dcp":
        net.to_empty(device="cpu")
        net.model.rotary_emb.__init__(config)  # a buffer no checkpoint holds
        dcp.load(net.state_dict(), storage_reader=dcp.HuggingFaceStorageReader(path))
    else:
        own = {id(p) for p in net.parameters()}
        with torch.no_grad():
            net._apply(lambda t: t.float() if id(t) in own else t)
    seconds, got = time.perf_counter() - start, watch.stop()
    total = torch.tensor([sum(float(p.to_local().double().sum()) for p in net.parameters())], dtype=torch.float64)
    dist.all_reduce(total)
    if dist.get_rank() == 0:
        print(json.dumps({"seconds": round(seconds, 2), "private_peak_mib": got["private_peak_mib"], "checksum": float(total)}))
    dist.destroy_process_group()


def compare_dcp(where: Path, ranks: int, params: int) -> None:
    print(f"FSDP2 on {ranks} ranks: each rank's fp32 shard {4 * params / ranks / 2**20:.0f} MiB")
    for how in ("mmap", "dcp"):
        out = subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}", __file__, "--rank",
                              str(where), how], capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        got = next((json.loads(x) for x in out.stdout.splitlines() if x.startswith("{")), None)
        if got is None:
            sys.exit(f"error: --dcp {how} failed: {out.stderr.strip().splitlines()[-1]}")
        print(f"  {how:5} private peak {got['private_peak_mib']:7.0f} MiB  {got['seconds']:5.2f} s  checksum {got['checksum']:.6f}")


def main() -> None:
    if sys.argv[1:2] == ["--rank"]:
        return fsdp_rank(sys.argv[2], sys.argv[3])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    ap.add_argument("--dcp", action="store_true", help="FSDP2 only: this read against a meta-device build read by DCP")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        params = save(root / "bf16", args.hidden, args.layers)
        if args.dcp:
            return compare_dcp(root / "bf16", args.ranks, params)
        mixed(root / "bf16", root / "mixed")
        print(f"{params / 1e6:.1f}M parameters: {4 * params / 2**20:.0f} MiB in fp32, {args.ranks} CPU ranks; "
              "rank 0's private host MiB over what it held before the model")
        print(f"{'layout':8} {'read bf16':>10} {'read mixed':>10} {'built bf16':>11} {'built mixed':>11}  same loss")
        for name in args.layouts:
            got = {ckpt: run(root / ckpt, LAYOUTS[name], root / f"{name}_{ckpt}", args.ranks) for ckpt in ("bf16", "mixed")}
            b, f = got["bf16"], got["mixed"]
            print(f"{name:8} {b['read_private_mib']:10.0f} {f['read_private_mib']:10.0f} {b['private_peak_mib']:11.0f} "
                  f"{f['private_peak_mib']:11.0f}  {b['loss'] == f['loss']}", flush=True)


if __name__ == "__main__":
    main()
