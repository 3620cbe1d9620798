"""The interface every training method implements: what the data, the loop, the planner and the rules ask
of it. One module per method (finetune/methods/sft.py, dpo.py, reward.py) holds one record, `METHOD`, listed in the
registry (finetune/methods/__init__.py); nothing outside finetune/methods/ branches on the method's name.

The record is read on both sides of the launch. The launcher side (rules, planner, data checks, the
token cache) reads its plain fields and calls `check_row`, `encode`, `reference` and `validate`, with no
torch; a rank calls `objective` for the loss, whose module imports torch where it is used (inside the
functions), so that importing a method costs the launcher nothing.

An *example* is what one data row becomes and what a batch is made of: a `finetune.data.tokenize.Example`
(one row of tokens, SFT), or an `Item`: rows and the values they carry (a preference `Pair`'s chosen and
rejected rows, with their reference log-probs). A batch lays out row k of every example, k = 0, 1, ...
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol, runtime_checkable

from finetune.config import Config, DataConfig, DataFormat, MethodConfig, Reference

if TYPE_CHECKING:
    import torch

    from finetune.data.tokenize import Encoded, Example

Output = tuple["torch.Tensor", dict[str, "torch.Tensor"]]  # (summed loss, summed metrics): what an objective returns

CAUSAL_LM, SCORED = "AutoModelForCausalLM", "AutoModelForSequenceClassification"
"""The `model_class` values: token logits (lm_head), or one score per row (a score head of hidden x 1)."""
IMAGE_TEXT = "AutoModelForImageTextToText"
"""What a causal LM is built as when the checkpoint is a vision-language model (`built_as`): the same token logits, from
text and images (transformers' image-text-to-text classes: LLaVA, Qwen-VL, Gemma 3, Mllama, ...)."""
GENERATIVE = (CAUSAL_LM, IMAGE_TEXT)


def built_as(model_class: str, vision: bool) -> str:
    """The Auto class a method's `model_class` builds for a checkpoint: a causal LM of a vision-language model
    (finetune.families.vision.vision_of) is its image-text-to-text class."""
    return IMAGE_TEXT if vision and model_class == CAUSAL_LM else model_class


def saved_class(config_json: dict[str, Any]) -> str:
    """The `model_class` a saved model loads as, from its config.json: a sequence classifier, an image-text model, or a
    causal LM."""
    architectures = config_json.get("architectures") or []
    if any(a.endswith("ForSequenceClassification") for a in architectures):
        return SCORED
    return built_as(CAUSAL_LM, isinstance(config_json.get("vision_config"), dict))


class Item(Protocol):
    """An example other than one plain row: its rows (a preference pair's two; a KTO row with its label) and the
    values it carries, as collate (finetune.data.batches) lays them out."""

    @property
    def rows(self) -> tuple[Example, ...]:
        """Its rows in batch order (a pair: chosen, rejected)."""

    @property
    def target(self) -> Example | None:
        """The row exact match generates from and compares with (a pair's chosen), or None (KTO's undesirable rows)."""

    def values(self) -> dict[str, tuple[float, ...]]:
        """Numbers that travel in the batch beside its rows, one per row, as float64 tensors in row order (DPO's
        precomputed `reference_logps`); {} when none."""


class Objective(Protocol):
    """The loss one method trains with (finetune.rank.loop calls it; finetune.rank.engine runs it)."""

    metrics: tuple[str, ...]
    """Names of its own metric sums (DPO: rewards/accuracy...), the same on every rank; the loop averages them
    over the loss units like the loss."""

    def count(self, batch: dict[str, torch.Tensor]) -> int:
        """Units the loss is a sum over, in this batch (SFT: labelled tokens; DPO: pairs)."""

    def __call__(self, model: Any, batch: dict[str, torch.Tensor]) -> Output:
        """(summed loss, summed metrics) of the batch; the loop divides by the step's global count."""

    def loss(self, logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> Output:
        """The same from logits: what a pipeline's last stage computes."""

    def rows_loss(self, logps: torch.Tensor, batch: dict[str, torch.Tensor]) -> Output:
        """The same from each row's summed label log-probs (a pipeline's last stage under logits=chunked)."""



@runtime_checkable
class OnlineObjective(Objective, Protocol):
    """The objective of a method that samples its own rows (its record's `sampling` is not None: GRPO)."""

    rollout_every: int
    """Optimizer steps on each rollout: the loop stops on a signal only after a rollout's last one."""

    prompt_tokens: int | None
    """The longest prompt it samples after (data.max_length; a rank sets it before training): a sampler's context."""

    def rollout(self, engine: Any, micro_batches: list[dict[str, Any]], *, step: int, tokenizer: Any,
                seed: int, refill: Callable[[int], list[dict[str, Any]]] | None = None,
                ahead: Callable[[], list[dict[str, Any]]] | None = None) -> tuple[list[dict[str, Any]], float]:
        """The rows this step trains on, made from the data's micro-batches, which hold its prompts (finetune.rank.loop
        calls it before each step); and the seconds generation took. `refill(round)`: more micro-batches of prompts,
        drawn anew for this step (`TrainBatches.refill`; None for a stream); `ahead()`: the next step's (None at the last
        step, or for a stream)."""

    def save_ahead(self, directory: Any, rank: int) -> None:
        """A checkpoint's: what it sampled for the next step, if anything (method.async_generation)."""

    def restore_ahead(self, engine: Any, directory: Any, rank: int) -> None:
        """A resumed run's: what the checkpoint kept for the next step."""

    def close(self) -> None:
        """The end of training: a background sampler's thread stops."""


@dataclass(frozen=True)
class Sampling:
    """What an online method samples before each step, as the planner counts it."""

    completions: int
    """Completions sampled per prompt, each a row with gradients."""
    completion_tokens: int
    """The most tokens one completion has."""
    sampler: str = "generate"
    """What samples: transformers' generate (a KV cache freed before the step), vllm (an engine beside training),
    vllm_server (engines on devices of their own: method.vllm_servers), or background (generate by a copy of the policy,
    during the step: method.async_generation)."""
    reserved: float = 0.0
    """The share of the GPU a sampler beside training holds through the run (vLLM's gpu_memory_utilization)."""
    turns: int = 1
    """The assistant turns one completion may take (method.tools: 1 + method.max_turns), each up to completion_tokens."""
    servers: tuple[str, ...] = ()
    """Where samplers on devices of their own answer (method.vllm_servers: HOST:PORT each): a launch checks they do first."""
    copy: bool = False
    """A copy of the policy is held through the run and samples or scores during the step (method.async_generation)."""
    completion_logits: bool = False
    """Its loss's forward computes the output layer at the completion tokens only where the batch is padding-free
    (transformers' logits_to_keep: finetune.methods.losses.labelled_logps), not at the prompts'."""


@dataclass(frozen=True)
class TeacherModel:
    """A model a method's loss learns from (method=distill's teacher)."""

    where: str
    """A model directory, a run directory (its final/) or a hub id."""
    precision: str | None = None
    """Its weights' dtype on the ranks: fp32, bf16 or fp16; None: the run's weight precision (bf16 under bf16_pure, else
    fp32)."""
    topk: int | None = None
    """K: it scores the data once before training, its top-K log-probs per response token kept (finetune.rank.topk),
    and is freed; None: it runs beside the trained model at every step."""


class Method(Protocol):
    """One training method: the data forms it reads, how a row becomes examples, how many rows an example puts
    in a batch, whether it needs a reference model and how it is computed, its loss and metrics, its rules
    across config groups, and what the planner counts for it."""

    name: str
    """Its `method.name`, as typed on the command line (method=NAME)."""

    config: type[MethodConfig]
    """Its settings: a dataclass subclassing finetune.config.MethodConfig, in its own module, each field's constraint
    beside it and its docstring under it. method=NAME composes it (recipes/method/NAME.yaml: defaults: [base_NAME]), so
    a key of another method is an unknown key; defaults that differ per method live here."""

    forms: tuple[DataFormat, ...]
    """The data.format values it accepts besides auto (which tells a row's form by its keys)."""

    unit: str
    """What one example is called in messages ("pair"): "reference: log-probs of 4 train pairs"."""

    columns: tuple[str, ...]
    """The token cache's column prefix of each of an example's rows it keeps, in batch order: ("",) for an example of
    one row (columns input_ids, labels...); DPO ("chosen_", "rejected_"). The first `len(columns)` of its rows."""

    rows_per_example: int
    """Rows one example puts in a batch (its cached rows and those `settle` adds: KTO's mismatched row): the planner
    counts micro_batch_size x this many rows of activations, less `no_grad_rows`."""

    def sampling(self, cfg: MethodConfig) -> Sampling | None:
        """None: it trains on the data's rows. Else it samples its own rows at each step (GRPO: method.generations
        completions of each prompt, rows with gradients): its objective is an `OnlineObjective`, and the planner counts
        what this says."""

    no_grad_rows: int
    """Of those, rows forwarded without gradients outside a pipeline (KTO's mismatched row): no activations kept for
    backward, so the planner does not count them (a pipeline's stages keep every row of the micro-batch)."""

    unpacked: str | None
    """None: its examples may be packed (data.packing) and laid end to end (data.padding_free). Else why not,
    as the refusal says it ("method=dpo scores chosen and rejected as rows of their own")."""

    padded: str | None
    """None: its micro-batches may lay their rows end to end, each attending only to itself (data.padding_free; a pair's
    rows summed per sample). Else why not, as the refusal says it."""

    split_tokens: str | None
    """None: its loss is a sum over tokens, which context parallel (parallelism.cp) splits over ranks. Else why
    it cannot, and what to do instead, after "method=NAME with parallelism.cp=N is not supported: "."""

    scalars: tuple[str, ...]
    """Numbers an example carries from its row, by name (KTO: its desirable/undesirable label), each an attribute
    of the example: the token cache keeps them as float columns and gives them back to `join`; `Item.values`
    puts them in the batch. () for none."""

    images: str | None
    """None: its rows may show images (a vision-language model's: finetune.data.images), which every row of an example
    shows. Else why they cannot, after "method=NAME does not read rows with images yet: "."""

    attached: bool
    """Its examples carry values computed on the ranks (a precomputed reference's log-probs): the token cache's
    rows are then read into objects once, not row by row from the memory map."""

    model_class: str
    """The transformers Auto class the ranks build the trained model with (finetune.rank.model.load_model), which
    also loads its final/: "AutoModelForCausalLM" (token logits: SFT, DPO) or "AutoModelForSequenceClassification"
    (one score per row, num_labels=1, pooled at the last non-pad token: a reward model)."""

    def check_row(self, row: dict[str, Any], data: DataConfig, where: str) -> None:
        """Convert one raw row as `encode` would, without a tokenizer (the launcher checks every local row before
        a rank starts): raise ConfigError naming `where` for a malformed row."""

    def encode(self, row: dict[str, Any], where: str, tokenizer: Any, data: DataConfig, chat: bool) -> Encoded:
        """One row -> its examples, no longer than data.max_length (finetune.data.examples.tokenize_row calls it,
        in memory, in the token cache's workers and in a stream's worker). `chat`: render with the tokenizer's
        chat template. `finetune.data.tokenize.fit` cuts prompt + response rows to length the shared way."""

    def join(self, rows: list[Example], scalars: dict[str, float]) -> Any:
        """The example made of these rows (one per `columns` entry) and `scalars`, as the token cache reads it back."""

    def settle(self, examples: list[Any], data: DataConfig, key: str) -> list[Any]:
        """A split's examples once all are read on a rank, before the reference is computed (KTO: each example's
        mismatched row, another example's response after its prompt); `key` names the split (data.train) in a
        refusal. Most methods return them as they are."""

    def reference(self, cfg: MethodConfig) -> Reference | None:
        """How the reference log-probs its loss needs are computed (finetune.rank.reference: precomputed, live,
        adapter_disabled); None: it needs none. The rules, the planner (a live reference's weights) and the
        ranks read it here."""

    def teacher(self, cfg: MethodConfig) -> TeacherModel | None:
        """The model its loss learns from (method=distill's method.teacher) and the precision it is held in, loaded
        frozen on every rank and placed like the policy (finetune.rank.teacher), or None. The planner counts its weights."""

    def make_first(self, cfg: MethodConfig, make: Callable[[str, str, str, str], str]) -> None:
        """Before launch (not a dry run's): what it learns from made by a recipe where missing (method=distill's
        method.teacher_recipe_if_missing), through `make(key, recipe_key, path, recipe)`, which returns the path resolved."""

    def validate(self, cfg: Config) -> None:
        """Its rules across config groups (keys it leaves unused, data forms, peft for a reference): raise
        ConfigError naming the keys and what to do instead."""

    def objective(self, cfg: MethodConfig, reference: Any, router: Any, head: Any) -> Objective:
        """The loss (rank side: imports torch). `reference`: what finetune.rank.reference.setup returned (a callable
        (policy, batch) -> reference log-probs, or None: in the batch or not needed); `router`: a MoE's
        load-balancing loss (finetune.methods.losses.RouterLoss) or None; `head`: logits=chunked's ChunkedHead or None."""
