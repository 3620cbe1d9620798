"""Rows of several samples attended sample by sample (finetune/rank/varlen.py), and padding-free micro-batches
(data.padding_free): every family's logits and gradients equal to each sample run alone and to transformers' own
block mask, one kernel call per sample and no mask over the whole row, padded batches untouched, an
activation-checkpointing recomputation after another forward reading its own samples; a padding-free micro-batch's
loss equal to the padded one's; where padding-free runs and where it is refused."""

from __future__ import annotations

import pytest
import torch

from conftest import read_metrics, train_here
from finetune.rank import varlen
from finetune.config import ConfigError
from finetune.data.batches import IGNORE, TrainBatches, collate
from finetune.data.pack import pack
from finetune.data.tokenize import Example
from finetune.families import FAMILIES
from finetune.methods.sft import SFT

TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256, vocab_size=101, pad_token_id=0, bos_token_id=1, eos_token_id=2)
KEYS = {"gemma": dict(head_dim=16), "gemma2": dict(head_dim=16), "gemma3_text": dict(head_dim=16, sliding_window=8),
        "qwen3": dict(head_dim=16), "mistral": dict(sliding_window=8), "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
        "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16),
        "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)}
"""Sliding windows of 8 tokens (Mistral, Gemma-3) cut into the longer samples; Gemma-2 soft-caps (eager only)."""
LENGTHS = [5, 17, 3, 30, 9]
POSITIONS = torch.cat([torch.arange(n) for n in LENGTHS])[None]


def build(family: str, kernel: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(family, **TINY, **KEYS.get(family, {}))
    return AutoModelForCausalLM.from_config(config, attn_implementation=kernel).float().eval()  # eval: no dropout (GPT-2)


def ids() -> torch.Tensor:
    return torch.randint(3, 100, (1, sum(LENGTHS)), generator=torch.Generator().manual_seed(1))


def runnable(family: str, kernel: str) -> bool:
    return not (family == "gemma2" and kernel == "sdpa")  # soft-capping: transformers refuses sdpa for it


CASES = [(f, k) for f in sorted(FAMILIES) for k in varlen.KERNELS if runnable(f, k)]


@pytest.mark.parametrize(("family", "kernel"), CASES)
def test_every_family_attends_each_packed_sample_alone(family, kernel):
    model = build(family, kernel)
    x = ids()
    starts = [sum(LENGTHS[:i]) for i in range(len(LENGTHS))]
    alone = torch.cat([model(input_ids=x[:, s : s + n], use_cache=False).logits for s, n in zip(starts, LENGTHS)], 1)
    masked = model(input_ids=x, position_ids=POSITIONS, use_cache=False).logits  # transformers' block-diagonal mask
    masked.square().sum().backward()
    reference = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()

    varlen.Varlen(model)
    logits = model(input_ids=x, position_ids=POSITIONS, use_cache=False).logits
    assert model.config._attn_implementation.startswith(varlen.NAME)
    torch.testing.assert_close(logits, alone, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(logits, masked, atol=2e-5, rtol=1e-5)
    logits.square().sum().backward()
    for name, grad in reference.items():
        torch.testing.assert_close(dict(model.named_parameters())[name].grad, grad, atol=1e-4, rtol=1e-4, msg=name)


def count_calls(monkeypatch, kernel: str) -> list[int]:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    calls: list[int] = []
    inner = ALL_ATTENTION_FUNCTIONS[kernel]

    def spy(module, q, k, v, mask, **kwargs):
        calls.append(q.shape[2])
        return inner(module, q, k, v, mask, **kwargs)
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, kernel, spy)
    return calls


def test_each_sample_is_one_kernel_call_and_no_mask_is_made(monkeypatch):
    model = build("llama", "sdpa")
    v = varlen.Varlen(model)
    calls = count_calls(monkeypatch, "sdpa")
    v.inner_mask = lambda *a, **k: pytest.fail("a mask over the whole row was made")
    model(input_ids=ids(), position_ids=POSITIONS, use_cache=False)
    assert calls == LENGTHS * TINY["num_hidden_layers"]


def test_padded_batches_go_to_the_family_kernel_with_its_mask(monkeypatch):
    x = torch.randint(3, 100, (3, 12), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(x)
    mask[1, 7:] = 0
    mask[2, 3:] = 0
    plain = build("qwen2", "sdpa")(input_ids=x, attention_mask=mask, use_cache=False).logits
    model = build("qwen2", "sdpa")
    varlen.Varlen(model)
    calls = count_calls(monkeypatch, "sdpa")
    torch.testing.assert_close(model(input_ids=x, attention_mask=mask, use_cache=False).logits, plain)
    assert calls == [12] * TINY["num_hidden_layers"]  # the whole padded batch, once per layer


def test_a_recomputation_after_another_forward_attends_its_own_samples():
    """Activation checkpointing recomputes each layer in backward; a padded forward in between (evaluation) must not
    change which samples the recomputed attention sees."""
    x, padded = ids(), torch.randint(3, 100, (2, 10))
    grads = []
    for split in (False, True):
        model = build("llama", "sdpa").train()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if split:
            varlen.Varlen(model)
        loss = model(input_ids=x, position_ids=POSITIONS, use_cache=False).logits.square().sum()
        with torch.no_grad():
            model(input_ids=padded, attention_mask=torch.ones_like(padded), use_cache=False)
        loss.backward()
        grads.append([p.grad for p in model.parameters()])
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------------------------------------
# Padding-free micro-batches


def examples(prompted: bool) -> list[Example]:
    """Five samples; `prompted`: the first half of each is a prompt (no labels), else every token is a label (text rows)."""
    out = []
    for i, n in enumerate(LENGTHS):
        tokens = torch.randint(3, 100, (n,), generator=torch.Generator().manual_seed(10 + i)).tolist()
        labels = [IGNORE] * (n // 2) + tokens[n // 2 :] if prompted else list(tokens)
        out.append(Example(tokens, labels, n // 2 if prompted else 0, ""))
    return out


@pytest.mark.parametrize("prompted", [True, False], ids=["prompt-response", "text"])
def test_a_padding_free_micro_batch_has_the_padded_loss(prompted):
    model = build("llama", "sdpa")
    varlen.Varlen(model)
    sft = SFT()
    rows = examples(prompted)
    padded, flat = collate(rows, pad_id=0), collate(rows, pad_id=0, flat=True)
    assert flat["input_ids"].shape == (1, sum(LENGTHS)) and int(flat["real_tokens"].sum()) == int(padded["real_tokens"].sum())
    assert sft.count(flat) == sft.count(padded)
    want, got = sft(model, padded)[0], sft(model, flat)[0]  # summed over the labelled tokens
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-6)
    # the first token of every sample is predicted by nothing, as in a row of its own
    first = torch.tensor([sum(LENGTHS[:i]) for i in range(len(LENGTHS))])
    assert (flat["labels"][0, first] == IGNORE).all()


def test_packed_rows_do_not_predict_a_samples_first_token_from_the_one_before():
    """Text rows label every token: in a packed row, the last token of a sample must not be trained to predict the
    next sample's first."""
    row = collate(pack(examples(False), max_length=128, seed=0), pad_id=0)
    sample_starts = row["position_ids"] == 0
    assert (row["labels"][sample_starts] == IGNORE).all()
    assert int((row["labels"] != IGNORE).sum()) == sum(n - 1 for n in LENGTHS)


def test_train_batches_lay_a_micro_batch_end_to_end():
    rows = examples(True) * 4
    padded = TrainBatches(rows, global_batch=8, micro_batch=4, dp_rank=0, dp_size=1, seed=0, pad_id=0)
    flat = TrainBatches(rows, global_batch=8, micro_batch=4, dp_rank=0, dp_size=1, seed=0, pad_id=0, flat=True)
    for p, f in zip(padded.micro_batches(3), flat.micro_batches(3)):
        assert f["input_ids"].shape == (1, int(p["real_tokens"].sum()))
        assert f["input_ids"][0].tolist() == p["input_ids"][p["attention_mask"].bool()].tolist()


# ---------------------------------------------------------------------------------------------
# Where padding-free runs


@pytest.mark.parametrize(("overrides", "on", "why"), [
    ([], True, "auto"),
    (["data.padding_free=false"], False, "data.padding_free=false"),
    (["train.micro_batch_size=1"], False, "padded: one row per micro-batch has no padding"),
    (["+recipe=quickstart_dpo"], True, "auto"),  # a pair's rows end to end, summed per sample
    (["+recipe=quickstart_kto"], False, "padded: method=kto scores each response's whole log-probability in a row of its own"),
    (["+recipe=quickstart_grpo", "train.micro_batch_size=1"], True, "auto"),  # a rollout's completions end to end
    (["+recipe=quickstart_rloo"], True, "auto"),
    (["+recipe=quickstart_vlm", "method=grpo"], False,
     "padded: method=grpo's rollouts with images are padded (each completion shown its prompt's images)"),
])
def test_auto_pads_where_padding_free_does_not_apply_and_says_why(compose, overrides, on, why):
    from finetune.data.rows import padding_free

    base = [] if overrides[:1] and overrides[0].startswith("+recipe=") else ["+recipe=quickstart_sft"]
    assert padding_free(compose([*base, *overrides])) == (on, why)


@pytest.mark.parametrize(("overrides", "why"), [
    (["+recipe=quickstart_kto"], "method=kto scores each response's whole log-probability in a row of its own"),
    (["+recipe=quickstart_sft", "parallelism=fsdp", "parallelism.pp=2", "launcher.nproc_per_node=2"],
     "parallelism.pp=2 sends every micro-batch through the stages at one shape (data.max_length)"),
])
def test_padding_free_true_is_refused_where_it_cannot_run(compose, overrides, why):
    with pytest.raises(ConfigError) as e:
        compose([*overrides, "data.padding_free=true"])
    assert str(e.value) == f"data.padding_free=true cannot run here: {why}: set data.padding_free=false (or null)"


def test_the_loss_curve_is_the_padded_one(tmp_path):
    """Three optimizer steps of the quickstart on one process, padded and padding-free (the default): the same losses."""
    short = ["+recipe=quickstart_sft", "parallelism=single", "launcher.nproc_per_node=1", "train.max_steps=3", "optim.warmup_steps=0",
             "train.eval_every=0", "train.exact_match_samples=0", "train.memory_report=false"]
    losses = {}
    for free in ("false", "null"):
        train_here([*short, f"data.padding_free={free}"], tmp_path / free)
        losses[free] = [m["loss"] for m in read_metrics(tmp_path / free) if m["kind"] == "train"]
    assert len(losses["null"]) == 3
    assert losses["null"] == pytest.approx(losses["false"], abs=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_flash_attention_takes_its_variable_length_path_for_padding_free_rows(monkeypatch):
    """On CUDA with flash-attn, rows of several samples go to transformers' varlen call (no Varlen installed): each
    sample's logits are those it has alone."""
    pytest.importorskip("flash_attn")
    import transformers.modeling_flash_attention_utils as fa

    packed_calls: list[bool] = []
    inner = fa._is_packed_sequence

    def spy(position_ids, batch_size):
        packed_calls.append(bool(inner(position_ids, batch_size)))
        return packed_calls[-1]
    monkeypatch.setattr(fa, "_is_packed_sequence", spy)
    model = build("llama", "flash_attention_2").to(device="cuda", dtype=torch.bfloat16)
    x = ids().cuda()
    starts = [sum(LENGTHS[:i]) for i in range(len(LENGTHS))]
    with torch.no_grad():
        alone = torch.cat([model(input_ids=x[:, s : s + n], use_cache=False).logits for s, n in zip(starts, LENGTHS)], 1)
        packed_calls.clear()
        logits = model(input_ids=x, position_ids=POSITIONS.cuda(), use_cache=False).logits
    assert packed_calls == [True] * TINY["num_hidden_layers"]
    torch.testing.assert_close(logits.float(), alone.float(), atol=3e-2, rtol=3e-2)


@pytest.mark.slow
def test_the_varlen_benchmark_prints_the_mask_and_per_sample_rows(tmp_path):
    import re
    import subprocess
    import sys

    from conftest import REPO

    out = subprocess.run([sys.executable, str(REPO / "scripts/benchmark_varlen.py"), "--rows", "600", "--steps", "1", "--hidden", "32",
                          "--layers", "1", "--kernels", "sdpa", "eager"], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("| 600 |")]
    assert [r.split("|")[3:5] for r in rows] == [[" sdpa ", " mask "], [" sdpa ", " per sample "], [" eager ", " mask "],
                                                   [" eager ", " per sample "]]
    assert all(re.search(r"\| [0-9.]+x \|$", r) for r in rows)
