"""logits=chunked: the loss and its gradients equal the full logits' (every family's logit post-processing
repeated per chunk), a family doing something unknown is refused before training, the planner counts one
chunk, and the switch works through the real CLI under each engine."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from conftest import read_metrics, run_cli, train_here
from ranks import launch_here

IGNORE = -100
FAMILIES = {  # the families whose forward changes lm_head's output: soft-capping, logits_scaling, logit_scale; llama: none
    "llama": {},
    "gemma2": dict(head_dim=16, final_logit_softcapping=3.0),
    "granite": dict(logits_scaling=4.0),
    "cohere": dict(logit_scale=0.5),
}


def tiny(family: str, vocab: int = 300):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(family, vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, **FAMILIES[family])
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)


def batch(vocab: int = 300, rows: int = 4, length: int = 21) -> dict[str, torch.Tensor]:
    """Rows with prompts of different lengths, right padding, and one row with no label at all."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (rows, length), generator=g)
    labels = ids.clone()
    mask = torch.ones_like(ids)
    for r in range(rows):
        labels[r, : 3 + 2 * r] = IGNORE  # the prompt
        labels[r, length - r:] = IGNORE  # padding
        mask[r, length - r:] = 0
    labels[1] = IGNORE
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def loss_and_grads(family: str, objective_of, chunk: int | None, b: dict) -> tuple[torch.Tensor, dict, dict]:
    from finetune.rank.head import ChunkedHead

    model = tiny(family)
    head = ChunkedHead(model, chunk) if chunk else None
    loss, metrics = objective_of(head)(model, b)
    loss.backward()
    return loss.detach(), metrics, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def sft(head):
    from finetune.methods.sft import SFT
    return SFT(head=head)


def dpo(head):
    from finetune.methods.dpo import DpoConfig
    from finetune.methods.dpo import DPO
    return DPO(DpoConfig(beta=0.1), head=head)


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("method", ["sft", "dpo"])
@pytest.mark.parametrize("chunk", [1, 7, 4096])
def test_chunked_loss_and_gradients_equal_the_full_logits(family, method, chunk):
    b = batch()
    if method == "dpo":  # 2 pairs: rows 0, 1 chosen, 2, 3 rejected; reference log-probs precomputed
        b["reference_logps"] = torch.tensor([-40.0, -1.0, -35.0, -30.0])
    objective_of = sft if method == "sft" else dpo
    full, full_metrics, full_grads = loss_and_grads(family, objective_of, None, b)
    mine, metrics, grads = loss_and_grads(family, objective_of, chunk, b)
    assert full.item() != 0
    torch.testing.assert_close(mine, full, rtol=1e-5, atol=1e-6)
    assert metrics.keys() == full_metrics.keys()
    for k in metrics:
        torch.testing.assert_close(metrics[k], full_metrics[k], rtol=1e-5, atol=1e-5)
    assert grads.keys() == full_grads.keys()  # the output layer's weight among them (tied to the embedding in gemma2)
    for name in grads:  # relative to the gradient's norm: fp32 sums in another order differ in the last bits
        assert (grads[name] - full_grads[name]).norm() <= 1e-5 * full_grads[name].norm(), name


def test_only_one_chunk_of_logits_exists():
    """The output layer sees at most chunk_tokens positions at a time, and only those with a label."""
    from finetune.rank.head import ChunkedHead

    model = tiny("llama")
    seen = []
    model.lm_head.register_forward_hook(lambda _m, args, out: seen.append(tuple(out.shape)))
    head = ChunkedHead(model, 5)
    b = batch()
    labelled = int((b["labels"][:, 1:] != IGNORE).sum())
    from finetune.methods.sft import SFT
    SFT(head=head)(model, b)[0].backward()
    forward = [s for s in seen if len(s) == 2]
    assert [s[0] for s in forward[: len(forward) // 2]] == [5] * (labelled // 5) + ([labelled % 5] if labelled % 5 else [])
    assert max(s[0] for s in forward) == 5 and all(s[1] == 300 for s in forward)
    seen.clear()
    assert model(input_ids=b["input_ids"]).logits.shape == (4, 21, 300)  # without labels: the layer itself


def test_an_unknown_logit_transform_is_refused_by_the_probe(monkeypatch):
    """A family whose forward changes the logits in a way head.post_ops does not know (here: Granite with
    its logits_scaling forgotten) is refused by the probe before training, never trained on a wrong loss."""
    from finetune.rank import head as head_module
    from finetune.config import ConfigError

    monkeypatch.setattr(head_module, "post_ops", lambda model: [])
    model = tiny("granite")
    head = head_module.ChunkedHead(model, 8)
    ids = batch()["input_ids"][:1]
    probe = {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}
    with torch.no_grad():
        results = head.probe(model, probe)
    with pytest.raises(ConfigError, match=r"^logits=chunked: granite's forward changes the logits after its output layer in a "
                                          r"way finetune does not repeat per chunk .* use logits=full$"):
        head.check(*results)
    llama = tiny("llama")
    with torch.no_grad():
        plain = head_module.ChunkedHead(llama, 8)
        plain.check(*plain.probe(llama, probe))  # nothing to repeat


def test_the_fused_kernel_runs_where_it_can_and_says_why_not(compose):
    """logits.kernel=auto takes cut-cross-entropy's kernel where it can run and says why not elsewhere (here: a CPU
    rank); logits.kernel=cce is refused there, as it is at compose time with train.device=cpu; the logits keys are
    refused under logits=full, which ignores them."""
    from finetune.config import ConfigError, LogitsKernel
    from finetune.rank.head import ChunkedHead, fused_blocker

    model, cpu = tiny("llama"), torch.device("cpu")
    head = ChunkedHead(model, 8, LogitsKernel.auto, cpu)
    assert (head.kernel, head.why) == (LogitsKernel.torch, "logits.kernel=auto: chunks in torch (this rank runs on cpu, and "
                                                           "cut-cross-entropy's kernels are Triton, CUDA only)")
    with pytest.raises(ConfigError, match=r"^logits.kernel=cce: this rank runs on cpu, and cut-cross-entropy's kernels are "
                                          r"Triton, CUDA only: use logits.kernel=torch \(or auto\)$"):
        ChunkedHead(tiny("llama"), 8, LogitsKernel.cce, cpu)
    try:
        import cut_cross_entropy  # noqa: F401
    except ImportError:  # a CUDA rank without the gpu extra is told how to get it
        assert fused_blocker(model, torch.device("cuda")).startswith("cut-cross-entropy is not installed (")
        assert fused_blocker(model, torch.device("cuda")).endswith("): pip install 'finetune[gpu]'")
    for overrides, message in [
        (["logits=chunked", "logits.kernel=cce", "train.device=cpu"],
         "logits.kernel=cce with train.device=cpu: cut-cross-entropy's kernels are Triton, CUDA only: use logits.kernel=torch "
         "(or auto) on CPU"),
        (["logits.chunk_tokens=512"], "logits.chunk_tokens=512 has no effect with logits=full (only with logits=chunked): remove "
                                      "it or change the option"),
        (["logits.kernel=cce"], "logits.kernel=cce has no effect with logits=full (only with logits=chunked): remove it or "
                                "change the option")]:
        with pytest.raises(ConfigError) as e:
            compose(overrides)
        assert str(e.value) == message


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("method", ["sft", "dpo"])
@pytest.mark.parametrize("kernel", ["cce", "liger"])
def test_the_fused_kernel_equals_the_full_logits(family, method, kernel):
    """logits.kernel=cce or liger on CUDA (the gpu extra): the loss and every gradient of the full logits' (the soft
    cap passed to the kernel, a logit factor folded into the output layer's weight), in fp32; only labelled tokens
    reach the kernel."""
    pytest.importorskip({"cce": "cut_cross_entropy", "liger": "liger_kernel"}[kernel])
    from finetune.config import LogitsKernel
    from finetune.rank.head import ChunkedHead

    b = {k: v.cuda() for k, v in batch().items()}
    if method == "dpo":
        b["reference_logps"] = torch.tensor([-40.0, -1.0, -35.0, -30.0], device="cuda")
    objective_of = sft if method == "sft" else dpo
    results = []
    for fused in (False, True):
        model = tiny(family).cuda()
        head = ChunkedHead(model, 7, LogitsKernel(kernel), torch.device("cuda")) if fused else None
        assert head is None or head.kernel == LogitsKernel(kernel)
        loss, _ = objective_of(head)(model, b)
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (full, full_grads), (mine, grads) = results
    torch.testing.assert_close(mine, full, rtol=1e-4, atol=1e-5)
    for name in full_grads:
        assert (grads[name] - full_grads[name]).norm() <= 1e-3 * full_grads[name].norm(), name


def test_planner_counts_one_chunk(compose):
    from finetune.planner.peak import plan

    full = plan(compose(["+recipe=quickstart_sft", "model.init.vocab_size=32000", "data.max_length=512"]))
    chunked = plan(compose(["+recipe=quickstart_sft", "model.init.vocab_size=32000", "data.max_length=512",
                                   "logits=chunked", "logits.chunk_tokens=256"]))
    assert chunked.logits * 8 <= full.logits
    assert chunked.total < full.total


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory) -> Path:
    """The quickstart's tiny Llama saved once: every layout below starts from these very weights."""
    from conftest import tiny_model

    path = tmp_path_factory.mktemp("model") / "tiny"
    model, tokenizer = tiny_model()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


STEPS = ["train.max_steps=2", "optim.warmup_steps=0", "train.eval_every=0", "train.exact_match_samples=0", "train.progress_bar=false",
         "train.micro_batch_size=4", "train.global_batch_size=8", "data.max_length=64", "data.eval=null", "data.eval_size=0",
         "train.tensorboard=false"]


@pytest.fixture(scope="module")
def full_logits(saved_model, tmp_path_factory) -> list[float]:
    """The train losses of 2 steps on a single rank with the full logits (in this process): what every layout matches."""
    run = tmp_path_factory.mktemp("full") / "run"
    train_here(["+recipe=quickstart_sft", "model=pretrained", f"model.path={saved_model}", *STEPS, "parallelism=single",
                "launcher.nproc_per_node=1"], run)
    return [m["loss"] for m in read_metrics(run) if m["kind"] == "train"]


@pytest.mark.parametrize("layout", [["parallelism=fsdp"], ["parallelism=tp2"], ["zero=stage3", "launcher.nproc_per_node=2"],
                                    ["parallelism=pp2"]], ids=["fsdp", "tp2", "zero3", "pp2"])
def test_chunked_under_each_engine_trains_as_the_full_logits_do(tmp_path, saved_model, full_logits, layout):
    """2 steps with logits=chunked on 2 ranks: the losses of a single rank with the full logits (pp2: the last
    stage takes its micro-batch's labels and returns the rows' log-probs)."""
    base = ["+recipe=quickstart_sft", "model=pretrained", f"model.path={saved_model}", *STEPS]
    full = full_logits
    out = launch_here(*base, "logits=chunked", *layout, f"hydra.run.dir={tmp_path / 'chunked'}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    chunked = [m["loss"] for m in read_metrics(tmp_path / "chunked") if m["kind"] == "train"]
    assert len(full) == 2 and chunked == pytest.approx(full, rel=2e-4)
    assert ("logits: chunked, torch (logits.kernel=auto: chunks in torch (this rank runs on cpu, and cut-cross-entropy's "
            "kernels are Triton, CUDA only))") in out.stdout


@pytest.mark.parametrize("precision,chunk", [("fp32", 256), ("bf16", 1024)])
def test_planned_within_15_percent_of_measured(tmp_path, precision, chunk):
    """A 32k vocabulary (the logits dominate without chunks): MemTracker against the plan, as tests/test_plan.py does."""
    from test_plan import measured_run

    rows = measured_run(tmp_path, "model.init.vocab_size=32000", f"precision={precision}", "logits=chunked",
                        f"logits.chunk_tokens={chunk}", micro=4, seq=256)
    for name, predicted, measured in rows:
        assert predicted == pytest.approx(measured, rel=0.15 if name == "peak" else 0.25), name


def test_a_vocabulary_below_the_tokenizer_is_refused_by_the_dry_run(tmp_path):
    from conftest import last_line

    out = run_cli("+recipe=quickstart_sft", "model.init.vocab_size=100", "launcher.dry_run=true", cwd=tmp_path)
    assert out.returncode != 0
    assert last_line(out.stderr) == ("error: model.init.vocab_size=100 is below the tokenizer's 103 token ids (ids from 100 up "
                                     "would index past the embedding): set it to at least 103, or null for exactly the tokenizer's")
