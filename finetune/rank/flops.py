"""Model FLOPs utilisation on GPU: achieved training FLOPs over the device's dense peak."""

from __future__ import annotations

import torch

# Dense (no sparsity) peak FLOP/s of common training GPUs, by compute dtype.
PEAK = {
    "H200": {torch.bfloat16: 989e12, torch.float16: 989e12, torch.float32: 67e12},
    "H100": {torch.bfloat16: 989e12, torch.float16: 989e12, torch.float32: 67e12},
    "A100": {torch.bfloat16: 312e12, torch.float16: 312e12, torch.float32: 19.5e12},
    "L40S": {torch.bfloat16: 362e12, torch.float16: 362e12, torch.float32: 91.6e12},
    "A10": {torch.bfloat16: 125e12, torch.float16: 125e12, torch.float32: 31.2e12},
    "L4": {torch.bfloat16: 121e12, torch.float16: 121e12, torch.float32: 30.3e12},
}


def peak_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    """Peak FLOP/s per GPU, or None on CPU or an unlisted GPU (then no MFU is reported)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((table[dtype] for gpu, table in PEAK.items() if gpu in name), None)


def train_flops_per_token(n_params: int, n_layers: int, hidden: int, seq_len: int) -> float:
    """6N for the weights (forward + backward) plus attention's 12 * L * h * s (PaLM's convention)."""
    return 6 * n_params + 12 * n_layers * hidden * seq_len
