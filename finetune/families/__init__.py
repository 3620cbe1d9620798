"""What differs between model families, read from a transformers config.json (a dict): the
parameters of every module, counted exactly as `AutoModelForCausalLM.from_config` builds them.

One code path counts every family. Most of what differs is a config key (head_dim,
tie_word_embeddings, num_local_experts / num_experts / n_routed_experts, moe_intermediate_size,
shared_expert_intermediate_size, n_shared_experts, which layers are sparse (mlp_layer_types,
first_k_dense_replace, mlp_only_layers...), kv_lora_rank for DeepSeek's latent attention); what a
family's config.json does not say is the small `Family` record below, keyed by model_type: which
key switches which bias (attention_bias, use_bias, mlp_bias... or always, as Qwen2's q/k/v), its
norms (RMSNorm, LayerNorm, none; q/k norms; how many per block), fused or plain projections and
their names, sinks and other small parameters (EXTRAS). FAMILIES are supported end to end;
COUNTED adds the decoders transformers has whose blocks the same records describe, and
tests/test_causal_lm_counts.py checks every one against `AutoModelForCausalLM.from_config` (meta
device) with each key its record reads flipped. Any other model_type is refused with the reason
(`uncountable`: encoder-decoder, other modalities' towers, state-space or linear-attention layers,
or no record), never counted as a guess.

Mixture-of-experts layers follow transformers 5: each layer's experts are two fused 3-D
parameters (gate_up_proj, down_proj) and the router a plain weight, none of them an nn.Linear.
LoRA reaches the experts through PEFT's `target_parameters` (`adapted`): all-linear adapts every
nn.Linear / Conv1D and the experts' stacks, not the router; bitsandbytes quantizes none of them.

Attention: which kernels a family cannot run (`attention_limits`) is read from the config (soft-capped
attention logits: sdpa has no soft-capping) and from the family record (what transformers publishes
as the model class's `_supports_sdpa` / `_supports_flash_attn`; tests check the two agree);
`pick_attention` chooses for model.attn_implementation=auto and refuses an explicit choice.

Pure arithmetic on the dict: no torch, no transformers.

The package, records apart from what reads and checks them:
- records.py: the `Family` record per model_type (FAMILIES, COUNTED), config.json key aliases (`config_value`).
- arch.py: a config.json -> `Arch` (blocks of `Linear`s, a `Moe`'s experts), counted exactly; `uncountable`.
- checks.py: PEFT targets (`targeted`, `adapted`, `unmatched_targets`), attention kernels (`attention_limits`,
  `pick_attention`), a MoE's router loss under context or pipeline parallel.
Every name is re-exported here: the loader, the layouts, the planner and the rules read `finetune.families`.
"""

from finetune.families.arch import (ATTENTION_LAYERS, O_NAMES, SUB_CONFIGS, Arch, Block, Linear, Moe, adapted_outside_linears,
                                    arch_from_build, arch_from_config, sparse_layers, uncountable)
from finetune.families.checks import (ATTENTION, SOFTCAP_KEYS, adapted, arch_targets, attention_limits, dora_experts, lora_params,
                                      pick_attention, router_loss_split, router_loss_under_pp, targeted, unmatched_targets)
from finetune.families.records import (ALIASES, COUNTED, EXTRAS, FAMILIES, LLAMA_NAMES, NORM_TOPK_DEFAULT, Family,
                                       config_value)

__all__ = ["ALIASES", "ATTENTION", "ATTENTION_LAYERS", "COUNTED", "EXTRAS", "FAMILIES", "LLAMA_NAMES", "NORM_TOPK_DEFAULT",
           "O_NAMES", "SOFTCAP_KEYS", "SUB_CONFIGS", "Arch", "Block", "Family", "Linear", "Moe", "adapted",
           "adapted_outside_linears", "arch_from_build", "arch_from_config", "arch_targets", "attention_limits",
           "config_value", "dora_experts", "lora_params", "pick_attention", "router_loss_split", "router_loss_under_pp",
           "sparse_layers", "targeted", "uncountable", "unmatched_targets"]
