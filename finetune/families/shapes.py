"""A model's architecture as the planner and the rules read it: its linear layers, blocks, MoE experts (Arch, read
from a config by finetune.families.arch). Plain records: the checks and the reader both import them."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from finetune.families.records import Family


@dataclass(frozen=True)
class Linear:
    """One weight matrix (and bias) of a block: `name` is its path inside the block."""

    name: str
    inputs: int
    outputs: int
    bias: bool = False
    experts: int = 1
    """> 1: the experts' weights, one fused 3-D parameter (not an nn.Linear: PEFT adapts it through
    target_parameters, one r-rank pair per expert; bitsandbytes does not quantize it)."""
    adaptable: bool = True
    """An nn.Linear / Conv1D module: PEFT's target_modules adapt it and bitsandbytes quantizes it. False:
    a weight of another module (a MoE's router, its experts), which only target_parameters reach."""

    @property
    def params(self) -> int:
        return self.experts * (self.inputs * self.outputs + (self.outputs if self.bias else 0))


@dataclass(frozen=True)
class Moe:
    """A sparse MLP: each token goes to top_k of `experts` experts of `width`, chosen by a router."""

    experts: int
    top_k: int
    width: int
    normalized: bool = True
    """The top-k routing weights are renormalised to sum to one (Mixtral; norm_topk_prob)."""


@dataclass(frozen=True)
class Block:
    """One decoder block: its linears (attention, MLP or experts) and its norms' parameters."""

    linears: tuple[Linear, ...]
    norms: int
    mlp_width: int
    """The MLP width one token's activations have (MoE: its top-k experts' and the shared expert's)."""
    roles: dict[str, tuple[str, ...]] = field(default_factory=dict, compare=False, hash=False)
    """Linears by what they read: qkv (the normed stream), o (attention output), up (the normed
    stream, MLP side: a MoE's router and shared expert), down (the MLP activation): for the activation count."""
    moe: Moe | None = None
    """The routed experts of a sparse block (their linears are `experts` > 1)."""

    @property
    def params(self) -> int:
        return sum(lin.params for lin in self.linears) + self.norms

    def role(self, name: str) -> tuple[Linear, ...]:
        """The linears that read one input: qkv, o, up or down."""
        return tuple(lin for lin in self.linears if lin.name in self.roles.get(name, ()))

    @property
    def linear_params(self) -> int:
        return sum(lin.params for lin in self.linears)


@dataclass(frozen=True)
class Arch:
    """A decoder-only model as the planner counts it: every block's modules, the embeddings and the head."""

    model_type: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    layers: tuple[Block, ...]
    final_norm: int
    positions: int = 0
    """Learned position embeddings (GPT-2): max_position_embeddings x hidden_size."""
    head_bias: int = 0
    """The output head's bias (vocab_size; 0: none)."""
    known: bool = True
    """Whether model_type is one of FAMILIES (supported end to end: its module names are checked against
    peft.target_modules before launch); else one COUNTED lists for its count only."""
    attention: dict[str, str] = field(default_factory=dict, compare=False, hash=False)
    """The attention kernels this model cannot run, with the reason (attention_limits)."""
    family: Family = field(default=Family(), compare=False)
    """The family record it was read with (norm placement and dtype, GPT-2's layout...): for the activation count."""
    act: str = "silu"
    """The MLP's activation function (hidden_act)."""
    attention_dropout: float = 0.0
    residual_dropout: float = 0.0
    """Dropout on each sublayer's output before the residual add (resid_pdrop)."""
    embedding_dropout: float = 0.0
    attn_softcap: float = 0.0
    """tanh soft-capping of the attention logits (attn_logit_softcapping); 0: none."""
    final_softcap: float = 0.0
    """tanh soft-capping of the output logits (final_logit_softcapping); 0: none."""
    head_outputs: int = 0
    """The output head's width: 0, the vocabulary (a causal LM's lm_head); 1, a sequence classifier's score (`scored`)."""
    image_parts: tuple[tuple[str, int], ...] = ()
    """A vision-language model's parts (finetune.families.vision.parts): (vision, projector, language) with their
    parameters; model.freeze chooses which are frozen. The tower and the projector are counted in `final_norm`'s rest."""
    tower: Arch | None = field(default=None, compare=False, hash=False)
    """A vision-language model's vision tower as a stack of blocks (read off the meta build as the language model's
    are): for the activations it keeps when it trains, per image patch."""
    patch_input: int = 0
    """The pixel values one patch is (the tower's patch embedding reads channels x frames x patch x patch of them)."""

    @property
    def kv_dim(self) -> int:
        return self.head_dim * self.num_key_value_heads

    @property
    def q_dim(self) -> int:
        return self.head_dim * self.num_attention_heads

    @property
    def block(self) -> Block:
        """The largest block (MoE models with dense layers: a sparse one)."""
        return max(self.layers, key=lambda b: b.params)

    @property
    def intermediate_size(self) -> int:
        """The MLP width one token's activations have in the largest block."""
        return self.block.mlp_width

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each adaptable linear (nn.Linear / Conv1D) of the largest block, by its path in the block."""
        return {lin.name: (lin.inputs, lin.outputs) for lin in self.block.linears if lin.adaptable}

    @property
    def block_linear_params(self) -> int:
        return self.block.linear_params

    @property
    def block_params(self) -> int:
        return self.block.params

    @property
    def quantized_params(self) -> int:
        """Weights bitsandbytes stores in 4 bits under QLoRA: those of every nn.Linear of the blocks."""
        return sum(lin.inputs * lin.outputs for b in self.layers for lin in b.linears if lin.adaptable)

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def head_width(self) -> int:
        """Outputs of the head per token: the vocabulary's logits, or one score."""
        return self.head_outputs or self.vocab_size

    @property
    def head_params(self) -> int:
        """The output head (and its bias); 0 when tied to the embeddings."""
        return (0 if self.tie_word_embeddings else self.head_width * self.hidden_size) + self.head_bias

    def scored(self) -> Arch:
        """The same body under transformers' ForSequenceClassification head (method=reward): a score of hidden x 1, no
        bias, never tied to the embeddings, no logit soft-capping, in place of lm_head."""
        return replace(self, head_outputs=1, tie_word_embeddings=False, head_bias=0, final_softcap=0.0)

    @property
    def params(self) -> int:
        """P = embeddings (+ learned positions) + every block + final norm + head."""
        return self.embedding_params + self.positions + sum(b.params for b in self.layers) + self.final_norm + self.head_params

    @property
    def largest_layer_params(self) -> int:
        """The largest single module (what ZeRO-3 gathers at a time): the embedding, the head, one
        linear (weight and bias), or one layer's experts (their two fused parameters are one module)."""
        experts = (sum(lin.params for lin in b.linears if lin.experts > 1) for b in self.layers)
        return max(self.embedding_params, self.head_params, *experts, *(lin.params for b in self.layers for lin in b.linears))
