"""`logits=chunked`: the loss without the full `[tokens, vocab]` logits.

`logits.kernel=cce` (or auto, where it can run) replaces the chunks with cut-cross-entropy's fused kernel
(CUDA, the `gpu` extra): the same patch point, the same row sums, no chunk's logits at all. `logits.kernel=liger`
does the same with Liger-Kernel's fused linear cross-entropy (CUDA, the `gpu` extra): per-token losses
(reduction="none") of the labelled tokens only, summed per row here as the chunks' are.

The causal LM's own forward still runs (so every engine's hooks, FSDP's root, DeepSpeed's ZeRO-3
gathers, PEFT and the family's code apply as usual), but its output layer is patched: while the
objective has handed it the batch's labels, it takes the final hidden states of the positions that
have a label, applies itself to `chunk_tokens` of them at a time, each chunk's logits in fp32 only
inside a non-reentrant checkpoint (recomputed in backward), and leaves per-row sums of the label
log-probs in `ChunkedHead.result`; the model's `.logits` is then an empty tensor. Without labels
(generation, a reference model) the output layer is itself.

What a family does to its logits after its output layer must be done per chunk too: Gemma-2's soft
capping, Granite's logits_scaling, Cohere's logit_scale (`post_ops`). A family that does something
else is caught by `ChunkedHead.check` (the model's own logits of a probe batch against what the output
layer and the known post-processing make of the same hidden states) before training and refused in
one line, never trained on a wrong loss.
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from finetune.config import ConfigError, LogitsKernel
from finetune.data.tokenize import IGNORE
from finetune.methods.losses import forward, sample_count

PROBE_TOKENS = 64
"""Tokens of the first training row that `ChunkedHead.probe` runs both ways before training."""

PostOp = Callable[[torch.Tensor], torch.Tensor]
Chunk = Callable[["ChunkedHead", torch.Tensor, torch.Tensor, int], torch.Tensor]
"""A loss's own per-chunk values (method=distill's divergence): (the head, the hidden states of labelled positions
[start, start + n), their labels, start) -> [n] or [n, k] values, summed per row like the label log-probs."""


def scale_and_cap(config: Any) -> tuple[float, float | None]:
    """What a family does to `lm_head`'s output before returning it as logits: a soft cap (Gemma-2), then a
    factor (Granite divides by logits_scaling, Cohere multiplies by logit_scale)."""
    cap = getattr(config, "final_logit_softcapping", None) or None
    factor = 1.0
    scaling = getattr(config, "logits_scaling", None)
    if scaling and config.model_type.startswith("granite"):
        factor = 1.0 / scaling
    scale = getattr(config, "logit_scale", None)
    if scale and config.model_type.startswith("cohere"):
        factor = float(scale)
    return factor, cap


def post_ops(model: Any) -> list[PostOp]:
    """`scale_and_cap` as the ops applied to `lm_head`'s output, in the family's order."""
    factor, cap = scale_and_cap(model.config)
    ops: list[PostOp] = []
    if cap:
        ops.append(lambda x: torch.tanh(x / cap) * cap)
    if factor != 1.0:
        ops.append(lambda x: x * factor)
    return ops


FUSED = {LogitsKernel.cce: ("cut_cross_entropy", "cut-cross-entropy"), LogitsKernel.liger: ("liger_kernel", "Liger")}
"""The fused kernels of logits=chunked: (module, the words a reason names it by)."""


def fused_blocker(model: Any, device: torch.device, kernel: LogitsKernel = LogitsKernel.cce) -> str | None:
    """Why `kernel` (cce or liger) cannot compute this model's loss on `device`, or None."""
    module, words = FUSED[kernel]
    if device.type != "cuda":
        return f"this rank runs on {device.type}, and {words}'s kernels are Triton, CUDA only"
    try:
        importlib.import_module(module)
    except ImportError as e:
        package = "cut-cross-entropy" if kernel == LogitsKernel.cce else "liger-kernel"
        return f"{package} is not installed ({e}): pip install 'finetune[gpu]'"
    head = model.get_output_embeddings()
    if getattr(head, "bias", None) is not None and kernel == LogitsKernel.cce:  # Liger's takes the bias
        return f"{model.config.model_type}'s output layer has a bias, which the kernel does not add"
    factor, cap = scale_and_cap(model.config)
    if cap and factor != 1.0:
        return f"{model.config.model_type} both soft-caps and scales its logits, and the kernel takes the cap after the matmul only"
    return None


def choose_kernel(kernel: LogitsKernel, model: Any, device: torch.device) -> tuple[LogitsKernel, str]:
    """(the kernel logits=chunked runs here, why): logits.kernel=auto takes cce where it can run; cce and liger are
    refused where they cannot, with the reason."""
    if kernel == LogitsKernel.torch:
        return kernel, "logits.kernel=torch"
    if kernel == LogitsKernel.liger:
        blocker = fused_blocker(model, device, kernel)
        if blocker is not None:
            raise ConfigError(f"logits.kernel=liger: {blocker}: use logits.kernel=torch (or auto)")
        return kernel, "logits.kernel=liger: Liger's fused linear cross-entropy"
    blocker = fused_blocker(model, device)
    if blocker is None:
        return LogitsKernel.cce, f"logits.kernel={kernel.value}: cut-cross-entropy's fused kernel"
    if kernel == LogitsKernel.cce:
        raise ConfigError(f"logits.kernel=cce: {blocker}: use logits.kernel=torch (or auto)")
    return LogitsKernel.torch, f"logits.kernel=auto: chunks in torch ({blocker})"


class ChunkedHead:
    """The patch on one causal LM's output layer (see the module docstring)."""

    def __init__(self, model: Any, chunk_tokens: int, kernel: LogitsKernel = LogitsKernel.torch,
                 device: torch.device = torch.device("cpu")) -> None:
        head = model.get_output_embeddings()
        if head is None:
            raise ConfigError(f"logits=chunked: {model.config.model_type} has no output layer (get_output_embeddings() is "
                              "None) to apply per chunk: use logits=full")
        self.head, self.chunk_tokens, self.ops = head, chunk_tokens, post_ops(model)
        self.kernel, self.why = choose_kernel(kernel, model, device)
        self.factor, self.cap = scale_and_cap(model.config)
        self.family = model.config.model_type
        self.labels: torch.Tensor | None = None
        self.result: tuple[torch.Tensor, torch.Tensor] | None = None
        self.capture: list[torch.Tensor] | None = None
        self.chunk: Chunk | None = None
        self.samples: torch.Tensor | None = None
        # a ZeRO-3 partition: each call of the layer gathers it (and so may reading its weight once the engine holds it)
        self.zero3 = hasattr(head.weight, "ds_id")
        self._forward = head.forward
        head.forward = self._patched
        head.chunked_head = self  # found again by `of` (a pipeline's last stage)

    @staticmethod
    def of(model: Any) -> ChunkedHead | None:
        """The patch on `model`'s output layer (a copy of the model carries a copy of it), or None."""
        head = model.get_output_embeddings()
        return getattr(head, "chunked_head", None)

    def _patched(self, hidden: torch.Tensor) -> torch.Tensor:
        labels, self.labels = self.labels, None  # the chunks below call the head again: as itself
        if labels is None:
            out = self._forward(hidden)
            capture, self.capture = self.capture, None  # probe: what a chunk makes of the same hidden states
            if capture is not None:
                capture.append(self.logits(hidden))
            return out
        self.result = self.row_logps(hidden, labels)
        return hidden[..., :0]

    @contextlib.contextmanager
    def labelled(self, labels: torch.Tensor, chunk: Chunk | None = None, samples: torch.Tensor | None = None) -> Iterator[None]:
        """Within: the model's next forward leaves the row log-probs of `labels` in `result`; with `chunk`, the row sums
        of what it makes of each chunk instead (in torch chunks: the fused kernels compute label log-probs only); with
        `samples` (a padding-free batch's finetune.data.batches.SAMPLES), the sums per sample rather than per row."""
        self.labels, self.result, self.chunk, self.samples = labels, None, chunk, samples
        try:
            yield
        finally:
            self.labels = None

    def take(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(per-row summed log-probs [B] in fp32, labelled positions per row [B]) of the last forward."""
        if self.result is None:
            raise RuntimeError("logits=chunked: the model's forward did not call its output layer (get_output_embeddings())")
        result, self.result = self.result, None
        return result

    def row_logps(self, hidden: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Position t predicts label t+1: only positions with a label go through the head, in chunks."""
        targets = labels[:, 1:]
        keep = targets != IGNORE
        samples, self.samples = self.samples, None
        rows = keep.nonzero()[:, 0] if samples is None else samples[:, 1:][keep]
        count = labels.shape[0] if samples is None else sample_count(samples)
        selected, wanted = hidden[:, : labels.shape[1] - 1][keep], targets[keep]  # (objectives.predicting)
        chunk, self.chunk = self.chunk or ChunkedHead._labels_chunk, None
        starts = range(0, selected.shape[0], self.chunk_tokens)
        # ZeRO-3 gathers the output layer at each call, a collective: as many calls on every rank, whatever its labels
        # (agreed before the first)
        behind = self._behind(len(starts), hidden.device)
        if self.kernel in FUSED and chunk is ChunkedHead._labels_chunk:
            logps = [self._fused(selected, wanted)] if selected.shape[0] else []
        else:
            logps = [checkpoint(chunk, self, selected[i:i + self.chunk_tokens], wanted[i:i + self.chunk_tokens], i, use_reentrant=False)
                     for i in starts]
        zero = hidden.sum().float() * 0  # a zero that reaches the model's graph
        for _ in range(behind):
            pad = hidden.reshape(-1, hidden.shape[-1])[:1] * 0
            zero = zero + checkpoint(ChunkedHead._labels_chunk, self, pad, torch.zeros(1, dtype=torch.long, device=hidden.device), 0,
                                     use_reentrant=False).sum() * 0
        lengths = keep.sum(-1) if samples is None else torch.zeros(count, dtype=torch.long, device=hidden.device).index_add(
            0, rows, torch.ones_like(rows))
        if not logps:  # no label in this micro-batch
            return torch.zeros(count, dtype=torch.float32, device=hidden.device) + zero, lengths
        values = torch.cat(logps) + zero
        sums = torch.zeros((count, *values.shape[1:]), dtype=torch.float32, device=hidden.device)
        return sums.index_add(0, rows, values.float()), lengths

    def _behind(self, calls: int, device: torch.device) -> int:
        """How many fewer output-layer calls this rank makes than the rank making most, where the layer's weight is a
        ZeRO-3 partition (each call gathers it); 0 elsewhere."""
        if not self.zero3 or not torch.distributed.is_initialized():
            return 0
        most = torch.tensor([calls], device=device)
        torch.distributed.all_reduce(most, op=torch.distributed.ReduceOp.MAX)
        return int(most.item()) - calls

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """What the family's forward returns as logits for these hidden states: the output layer, then its post_ops."""
        logits = self.head(hidden)
        for op in self.ops:
            logits = op(logits)
        return logits

    def _chunk(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return -F.cross_entropy(self.logits(hidden).float(), targets, reduction="none")

    @staticmethod
    def _labels_chunk(head: ChunkedHead, hidden: torch.Tensor, targets: torch.Tensor, _start: int) -> torch.Tensor:
        return head._chunk(hidden, targets)

    def _fused(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Every labelled token's log-prob from the fused kernel: the output layer's matmul and the log-softmax in
        one, blockwise, never the whole logits. Both operands in the autocast dtype, as the head would compute in;
        a logit factor folds into W (and the bias), the soft cap goes to the kernel."""
        weight, bias = self.head.weight, getattr(self.head, "bias", None)
        dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else weight.dtype
        if self.factor != 1.0:
            weight, bias = weight * self.factor, None if bias is None else bias * self.factor
        weight, hidden = weight.to(dtype), hidden.to(dtype)
        if self.kernel == LogitsKernel.liger:
            from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

            # reduction="none": per-token losses, whose backward folds each token's incoming gradient in (liger-kernel
            # 0.8.2 and later); the weight's gradient summed over the token chunks in fp32
            nll = liger_fused_linear_cross_entropy(hidden, weight, targets, bias=None if bias is None else bias.to(dtype),
                                                   reduction="none", softcap=self.cap, accum_dtype=torch.float32)
            return -nll.float()
        from cut_cross_entropy import linear_cross_entropy

        # no gradient filtering (filter_eps=None: the same gradients as the unfused loss)
        nll = linear_cross_entropy(hidden, weight, targets, softcap=self.cap, reduction="none", filter_eps=None)
        return -nll.float()

    def probe(self, model: Any, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's own logits for `batch` and this patch's for the same hidden states (an engine's
        `inference` fn: every rank runs it)."""
        captured: list[torch.Tensor] = []
        self.capture = captured  # taken by the output layer's next call
        try:
            full = forward(model, batch)
            mine = captured[0]
        finally:
            self.capture = None
        return full.float(), mine.float()

    def prober(self) -> Prober:
        """`probe` as an engine's `inference` fn that also works under pipeline parallel (see Prober)."""
        return Prober(self)

    def check(self, full: torch.Tensor, mine: torch.Tensor) -> None:
        """Refuse the family when this patch's logits of a probe batch are not the model's own."""
        tolerance = 1e-3 * float(full.abs().max())
        if full.shape == mine.shape and float((full - mine).abs().max()) <= tolerance:
            return
        raise ConfigError(f"logits=chunked: {self.family}'s forward changes the logits after its output layer in a way finetune "
                          f"does not repeat per chunk (largest logit {float(full.abs().max()):.3g} from the model, "
                          f"{float(mine.abs().max()):.3g} from its output layer and the known post-processing): use logits=full")


class Prober:
    """`ChunkedHead.probe` for `engine.inference`: called with the whole model, or, under pipeline parallel,
    `loss` of the last stage's logits, whose output layer has just run with the capture armed here."""

    def __init__(self, head: ChunkedHead) -> None:
        self.head, self.captured = head, []
        head.capture = self.captured  # armed now: a pipeline's last stage calls its output layer before `loss`

    def __call__(self, model: Any, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return self.head.probe(model, batch)

    def loss(self, logits: torch.Tensor, _batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        self.head.capture = None
        return logits.float(), self.captured[0].float()
