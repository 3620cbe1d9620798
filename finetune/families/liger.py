"""`model.kernels=liger` and `logits.kernel=liger`: Liger-Kernel's Triton kernels (the `gpu` extra; CUDA only).

Launcher side (no torch, and liger_kernel is never imported: a dry run stays instant): whether the package
is installed (`installed`) and which model families it patches (`families`: the keys of the installed
package's own table, `liger_kernel.transformers.monkey_patch.MODEL_TYPE_TO_APPLY_LIGER_FN`, read from its
source text), for the refusals in finetune/launcher/rules/.

Rank side (`apply`): Liger's own function for the family on the loaded model, before PEFT and the layout
wrap it: its RMSNorm, RoPE and SwiGLU (GeGLU on Gemma) take the place of the family's, the weights and their
names unchanged. Never its cross-entropy nor its patched forward: the loss is ours (finetune/rank/head.py), and
Liger's fused linear cross-entropy is one of its implementations there (logits.kernel=liger).
"""

from __future__ import annotations

import ast
import importlib.util
from collections import Counter
from pathlib import Path
from typing import Any

from finetune.config import ConfigError

TABLE = "MODEL_TYPE_TO_APPLY_LIGER_FN"
"""Liger's model_type -> apply_liger_kernel_to_<family> table, in liger_kernel/transformers/monkey_patch.py."""
INSTALL = 'pip install -e ".[gpu]"'
CUDA_ONLY = "Liger's kernels are Triton, CUDA only"
SWAPS = dict(rms_norm=True, rope=True, swiglu=True, geglu=True, cross_entropy=False, fused_linear_cross_entropy=False)
"""What Liger's per-family functions are asked for (each takes the keywords it has): the norms, RoPE and the
gated MLP; not its losses, which would replace the causal LM's forward."""


def installed() -> bool:
    """Whether liger_kernel can be imported here (found, not imported)."""
    return importlib.util.find_spec("liger_kernel") is not None


def families() -> list[str] | None:
    """The model_types the installed Liger patches (its TABLE's keys, read without importing it: importing
    pulls torch, Triton and transformers); None where it is not installed or the table cannot be read
    (the ranks check then, against the imported table)."""
    spec = importlib.util.find_spec("liger_kernel")
    if spec is None or not spec.submodule_search_locations:
        return None
    source = Path(list(spec.submodule_search_locations)[0]) / "transformers" / "monkey_patch.py"
    try:
        tree = ast.parse(source.read_text())
    except (OSError, SyntaxError, ValueError):
        return None
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        if any(isinstance(t, ast.Name) and t.id == TABLE for t in targets) and isinstance(node.value, ast.Dict):
            return sorted(k.value for k in node.value.keys if isinstance(k, ast.Constant) and isinstance(k.value, str))
    return None


def not_installed(key: str, instead: str) -> str:
    return f"{key} needs the liger-kernel package (the `gpu` extra), which is not installed here: {INSTALL}, or use {instead}"


def unsupported(model_type: str, supported: Any) -> str:
    return (f"model.kernels=liger: Liger has no kernels for model_type={model_type} (it patches {', '.join(sorted(supported))}): "
            "use model.kernels=none")


def apply(model: Any, device: Any) -> None:
    """Liger's kernels swapped into `model` on this rank (see `swap`); ConfigError off CUDA."""
    if device.type != "cuda":
        raise ConfigError(f"model.kernels=liger: this rank runs on {device.type}, and {CUDA_ONLY}: use model.kernels=none")
    swap(model)


def swap(model: Any) -> None:
    """Liger's function for the model's family, on the instance (`_apply_liger_kernel_to_instance`, the entry
    Liger's own AutoLigerKernelForCausalLM uses): each RMSNorm's and gated MLP's forward becomes Liger's (bound
    to the module, which keeps its class, parameters and names), and the family module's apply_rotary_pos_emb
    Liger's (for every model of the family this process builds: DPO's reference too). Runs nothing: the
    kernels run at the first forward, on CUDA. ConfigError for a family Liger has no function for."""
    try:
        from liger_kernel.transformers import _apply_liger_kernel_to_instance
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except ImportError as e:
        raise ConfigError(f"{not_installed('model.kernels=liger', 'model.kernels=none')} ({e})") from None
    model_type = model.config.model_type
    if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        raise ConfigError(unsupported(model_type, MODEL_TYPE_TO_APPLY_LIGER_FN))
    _apply_liger_kernel_to_instance(model=model, **SWAPS)


def describe(model: Any) -> str:
    """The line a run prints: which of the model's modules run Liger's forward (Liger names them by its class)."""
    swapped = Counter(m._get_name() for m in model.modules() if m._get_name().startswith("Liger"))
    modules = ", ".join(f"{n} {name}" for name, n in sorted(swapped.items()))
    return f"kernels: liger ({modules}, and its RoPE) in place of {model.config.model_type}'s own"
