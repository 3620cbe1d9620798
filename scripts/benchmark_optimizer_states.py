"""Low-bit optimizer states: what this project runs against torchao's maintained optimizers (issue 46's question: keep
ours only where torchao cannot do what they do).

    python scripts/benchmark_optimizer_states.py                 # 3 x 2048 x 2048 fp32 weights on CPU
    python scripts/benchmark_optimizer_states.py --size 4096 --device cuda

For each optimizer: the first step's seconds (torchao compiles its step), the median of --steps more, and the state's
bytes per parameter (tensor subclasses counted by their inner tensors). Then whether torchao's 8-bit AdamW steps a
DTensor shard (FSDP2, TP) and equals its whole-tensor update: run it under torchrun with --shards (2 processes, gloo).
torchao is not a dependency of the package: `pip install torchao` to run its rows (they are skipped without it).
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from typing import Any, Callable


def state_bytes(opt: Any) -> int:
    import torch

    total = 0
    for state in opt.state.values():
        for v in state.values():
            if not torch.is_tensor(v):
                continue
            if hasattr(v, "__tensor_flatten__"):  # torchao's quantized states: their inner tensors
                names, _ = v.__tensor_flatten__()
                total += sum(getattr(v, n).numel() * getattr(v, n).element_size() for n in names)
            else:
                total += v.numel() * v.element_size()
    return total


def candidates() -> dict[str, Callable[[list[Any]], Any]]:
    import torch

    from finetune.config import OptimConfig, StateDtype
    from finetune.rank.engine.common import build_optimizer

    out: dict[str, Callable[[list[Any]], Any]] = {
        "torch AdamW (optim=adamw)": lambda ps: torch.optim.AdamW(ps, lr=1e-3),
        "LowPrecisionAdam (optim.state_dtype=bf16)": lambda ps: build_optimizer(ps, OptimConfig(state_dtype=StateDtype.bf16)),
    }
    try:
        import bitsandbytes as bnb

        out["bitsandbytes AdamW8bit (optim=adamw_8bit)"] = lambda ps: bnb.optim.AdamW8bit(ps, lr=1e-3)
    except ImportError:
        pass
    try:
        from torchao.optim import AdamW4bit, AdamW8bit, _AdamW

        out["torchao AdamW8bit"] = lambda ps: AdamW8bit(ps, lr=1e-3)
        out["torchao AdamW4bit"] = lambda ps: AdamW4bit(ps, lr=1e-3)
        out["torchao _AdamW (states in the weights' dtype)"] = lambda ps: _AdamW(ps, lr=1e-3, bf16_stochastic_round=False)
    except ImportError:
        print("torchao is not installed: its rows are left out (pip install torchao)")
    return out


def bench(size: int, steps: int, device: str) -> None:
    import torch

    for name, make in candidates().items():
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(size, size, device=device)) for _ in range(3)]
        opt = make(params)
        for p in params:
            p.grad = torch.randn_like(p)
        tic = time.perf_counter()
        opt.step()
        first = time.perf_counter() - tic
        times = []
        for _ in range(steps):
            tic = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - tic)
        n = sum(p.numel() for p in params)
        print(f"{name:48s} first step {first:6.2f} s, then {statistics.median(times) * 1000:7.1f} ms/step, "
              f"state {state_bytes(opt) / n:.2f} bytes/param", flush=True)


def shards() -> None:
    """torchao's low-bit AdamW on a Shard(0) DTensor against the same update of the whole tensor (torchrun, 2 ranks)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torchao.optim import AdamW4bit, AdamW8bit

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    full, grad = torch.randn(512, 512), torch.randn(512, 512)
    for cls in (AdamW8bit, AdamW4bit):
        p = torch.nn.Parameter(distribute_tensor(full.clone(), mesh, [Shard(0)]))
        whole = torch.nn.Parameter(full.clone())
        try:
            for param, g in ((p, distribute_tensor(grad.clone(), mesh, [Shard(0)])), (whole, grad.clone())):
                opt = cls([param], lr=1e-2)
                param.grad = g
                opt.step()
                opt.step()
            said = f"steps a DTensor shard; max |difference| from the whole tensor's update {(p.full_tensor() - whole.detach()).abs().max().item():.2e}"
        except Exception as e:  # noqa: BLE001 - what torchao raises is the answer
            said = f"cannot step a DTensor shard ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
        if dist.get_rank() == 0:
            print(f"torchao {cls.__name__}: {said}", flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=2048, help="each of the 3 weights is size x size")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--shards", action="store_true", help="the DTensor check (under torchrun --nproc_per_node=2)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    if args.shards:
        shards()
    else:
        bench(args.size, args.steps, args.device)


if __name__ == "__main__":
    main()
