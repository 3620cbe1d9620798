"""Supervised fine-tuning (method=sft): cross-entropy of next-token prediction on the response tokens.

Data: alpaca, chat, sharegpt or completion rows (a conversation whose assistant responses carry the labels),
or text rows (continued pre-training: every token a label, split into data.max_length pieces). One row per
example; rows may be packed and laid end to end (padding-free). No reference model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from finetune.config import METHOD_NAME, Config, ConfigError, DataConfig, DataFormat, MethodConfig, Reference, checked
from finetune.data.forms import form_of, images_of, text_of, to_messages
from finetune.data.images import check_image
from finetune.data.tools import tools_of
from finetune.data.tokenize import IGNORE, Encoded, Example, encode, encode_text, fit
from finetune.methods.base import CAUSAL_LM, Output

if TYPE_CHECKING:
    import torch


@dataclass
class SftConfig(MethodConfig):
    """method=sft: cross-entropy on the response tokens only. No keys of its own."""

    name: str = checked(METHOD_NAME, "sft")


class Sft:
    """The SFT record (finetune.methods.base.Method)."""

    name = "sft"
    config = SftConfig
    forms = (DataFormat.alpaca, DataFormat.chat, DataFormat.sharegpt, DataFormat.completion, DataFormat.text)
    unit = "example"
    columns = ("",)
    rows_per_example = 1
    no_grad_rows = 0
    unpacked = None
    padded = None
    split_tokens = None
    scalars = ()
    attached = False
    images = None
    model_class = CAUSAL_LM

    def check_row(self, row: dict[str, Any], data: DataConfig, where: str) -> None:
        if form_of(row, data.format, where) == DataFormat.text:
            text_of(row, where)
        else:
            for image in images_of(row, to_messages(row, data.format, data.system_prompt, where), where):
                check_image(image, where)

    def encode(self, row: dict[str, Any], where: str, tokenizer: Any, data: DataConfig, chat: bool) -> Encoded:
        if form_of(row, data.format, where) == DataFormat.text:
            pieces = encode_text(text_of(row, where), tokenizer, data.max_length)
            return Encoded(pieces, split=len(pieces) > 1)
        messages = to_messages(row, data.format, data.system_prompt, where)
        return fit(encode(messages, tokenizer, chat, tools=tools_of(row, where), data=data, where=where,
                          images=images_of(row, messages, where)), data, where)

    def join(self, rows: list[Example], scalars: dict[str, float]) -> Example:
        return rows[0]

    def settle(self, examples: list[Any], data: DataConfig, key: str) -> list[Any]:
        return examples

    def sampling(self, cfg: MethodConfig) -> None:
        return None

    def teacher(self, cfg: MethodConfig) -> None:
        return None

    def make_first(self, cfg: MethodConfig, make: Any) -> None:
        return None

    def reference(self, cfg: MethodConfig) -> Reference | None:
        return None

    def validate(self, cfg: Config) -> None:
        if cfg.data.format == DataFormat.preference:
            raise ConfigError("data.format=preference holds (prompt, chosen, rejected) pairs for method=dpo; "
                              f"method={self.name} needs alpaca or chat rows")

    def objective(self, cfg: MethodConfig, reference: Any, router: Any, head: Any) -> SFT:
        return SFT(router, head)


METHOD = Sft()


class SFT:
    """Cross-entropy of next-token prediction on response tokens (prompt and padding masked).

    torch and finetune.methods.losses are imported where they are used: the launcher reads this module's record."""

    def __init__(self, router: Any = None, head: Any = None) -> None:
        self.router, self.head = router, head
        self.metrics: tuple[str, ...] = (router.metric,) if router else ()  # names of its metric sums (the same on every rank)

    def count(self, batch: dict[str, torch.Tensor]) -> int:
        """Units the loss is averaged over: labelled tokens that some position predicts."""
        return int((batch["labels"][:, 1:] != IGNORE).sum())

    def __call__(self, model: Any, batch: dict[str, torch.Tensor]) -> Output:
        """Summed token loss of the batch (not averaged: the loop normalises)."""
        from finetune.methods.losses import forward_aux, tie

        if self.head is not None:  # logits=chunked: the output layer leaves the label log-probs
            with self.head.labelled(batch["labels"]):
                logits, aux = forward_aux(model, batch, self.router is not None)
            loss, metrics = -self.head.take()[0].sum() + tie(logits), {}
        else:
            logits, aux = forward_aux(model, batch, self.router is not None)
            loss, metrics = self.loss(logits, batch)
        return self.router.apply(loss, metrics, aux, self.count(batch)) if self.router else (loss, metrics)

    def loss(self, logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> Output:
        """The loss from logits (what a pipeline's last stage computes)."""
        from finetune.methods.losses import token_loss_sum

        return token_loss_sum(logits, batch["labels"]), {}

    def rows_loss(self, logps: torch.Tensor, batch: dict[str, torch.Tensor]) -> Output:
        """The loss from each row's summed label log-probs (a pipeline's last stage under logits=chunked)."""
        return -logps.sum(), {}
