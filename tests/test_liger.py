"""model.kernels=liger and logits.kernel=liger (finetune/families/liger.py, finetune/rank/head.py): Liger-Kernel's Triton kernels.

On CPU: the refusals, each one line through the real CLI's dry run and on a rank; and, where liger-kernel imports
(it does on CPU, though its kernels cannot run there), that the swap really happens on the quickstart's tiny Llama
with its weights and their names unchanged, and that the launcher reads the installed Liger's family table.
On CUDA (`-m gpu`, scripts/gpu_check.sh): liger on and off give the same loss and gradients, in-process and over a
2-step run (logits.kernel=liger against the full logits: tests/test_logits.py, beside cut-cross-entropy's kernel).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from conftest import read_metrics, run_cli, tiny_model
from test_errors import cli_error
from test_logits import FAMILIES, STEPS, batch, tiny

INSTALLED = importlib.util.find_spec("liger_kernel") is not None
NOT_INSTALLED = ("error: {key} needs the liger-kernel package (the `gpu` extra), which is not installed here: "
                 'pip install -e ".[gpu]", or use {instead}')
needs_liger = pytest.mark.skipif(not INSTALLED, reason="liger-kernel is not installed (the gpu extra)")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture
def family_modules(monkeypatch):
    """Liger's swap also sets module globals of the families it patches (RoPE, the norm and MLP classes): each
    family module's globals as they were, back after the test (later models of this process are the family's own)."""
    import importlib

    for family in ("llama", *FAMILIES):
        module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        for name, value in list(vars(module).items()):
            monkeypatch.setattr(module, name, value)


@pytest.mark.parametrize("args,message", [
    (["model.kernels=liger", "train.device=cpu"],
     "error: model.kernels=liger with train.device=cpu: Liger's kernels are Triton, CUDA only: use model.kernels=none on CPU"),
    (["logits=chunked", "logits.kernel=liger", "train.device=cpu"],
     "error: logits.kernel=liger with train.device=cpu: Liger's kernels are Triton, CUDA only: use logits.kernel=torch "
     "(or auto) on CPU"),
    (["logits.kernel=liger"],
     "error: logits.kernel=liger has no effect with logits=full (only with logits=chunked): remove it or change the option"),
], ids=["model-cpu", "logits-cpu", "logits-full"])
def test_refused_in_one_line_by_the_dry_run(tmp_path, args, message):
    assert cli_error(tmp_path, "+recipe=quickstart_sft", *args) == message


def test_without_the_package_the_dry_run_says_how_to_get_it(tmp_path):
    """Without liger-kernel: both switches refused, naming the install command; with it: the dry run passes."""
    for args, key, instead in [(["model.kernels=liger"], "model.kernels=liger", "model.kernels=none"),
                               (["logits=chunked", "logits.kernel=liger"], "logits.kernel=liger", "logits.kernel=torch (or auto)")]:
        if INSTALLED:
            out = run_cli("+recipe=quickstart_sft", *args, "launcher.dry_run=true", f"hydra.run.dir={tmp_path / key.split('.')[0]}", cwd=tmp_path)
            assert out.returncode == 0, out.stderr[-2000:]
        else:
            assert cli_error(tmp_path, "+recipe=quickstart_sft", *args) == NOT_INSTALLED.format(key=key, instead=instead)


@needs_liger
@pytest.mark.parametrize("args,message", [
    (["model.init.model_type=gpt2"], "error: model.kernels=liger: Liger has no kernels for model_type=gpt2 (it patches {families}): "
                                     "use model.kernels=none"),
    (["parallelism=tp2", "launcher.nproc_per_node=2"],
     "error: model.kernels=liger with parallelism.tp=2: Liger's Triton kernels take plain tensors, and under tensor parallel "
     "some layers see DTensor shards (transformers' styles for experts and gathered outputs); the pairing was never run: use "
     "model.kernels=liger with parallelism=fsdp, ddp or pp, or model.kernels=none with tp"),
], ids=["family", "tp"])
def test_a_family_liger_does_not_patch_and_tp_are_refused(tmp_path, args, message):
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    expected = message.format(families=", ".join(sorted(MODEL_TYPE_TO_APPLY_LIGER_FN)))
    assert cli_error(tmp_path, "+recipe=quickstart_sft", "model.kernels=liger", *args) == expected


@needs_liger
def test_the_launcher_reads_the_installed_table_without_importing_it():
    """finetune.families.liger.families reads Liger's table from its source: the same keys as the imported table."""
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    from finetune.families import liger

    assert liger.families() == sorted(MODEL_TYPE_TO_APPLY_LIGER_FN)
    assert {"llama", "mistral", "qwen2", "qwen3", "gemma2", "phi3", "olmo2", "mixtral"} <= set(liger.families())


def test_a_cpu_rank_refuses_both(compose):
    """A rank on CPU (train.device=auto on a machine without CUDA) refuses the swap and the fused loss in one line;
    a CUDA rank without the package is told how to get it."""
    from finetune.families import liger
    from finetune.config import ConfigError, LogitsKernel
    from finetune.rank.head import ChunkedHead, fused_blocker

    model, cpu = tiny("llama"), torch.device("cpu")
    with pytest.raises(ConfigError) as e:
        liger.apply(model, cpu)
    assert str(e.value) == "model.kernels=liger: this rank runs on cpu, and Liger's kernels are Triton, CUDA only: use model.kernels=none"
    with pytest.raises(ConfigError) as e:
        ChunkedHead(model, 8, LogitsKernel.liger, cpu)
    assert str(e.value) == ("logits.kernel=liger: this rank runs on cpu, and Liger's kernels are Triton, CUDA only: use "
                            "logits.kernel=torch (or auto)")
    if not INSTALLED:
        why = fused_blocker(model, torch.device("cuda"), LogitsKernel.liger)
        assert why.startswith("liger-kernel is not installed (") and why.endswith("): pip install 'finetune[gpu]'")


@needs_liger
def test_the_swap_replaces_norms_mlps_and_rope_and_keeps_the_weights(family_modules):
    """On the quickstart's tiny Llama: every RMSNorm and MLP runs Liger's forward (bound to the module, named by
    Liger's class), the family's RoPE is Liger's, and the state dict is the same, key for key and value for value.
    Nothing runs a kernel: that needs CUDA."""
    from liger_kernel.transformers.rms_norm import LigerRMSNorm
    from liger_kernel.transformers.rope import liger_rotary_pos_emb
    from liger_kernel.transformers.swiglu import LigerSwiGLUMLP
    from transformers.models.llama import modeling_llama

    from finetune.families import liger

    model, _ = tiny_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    norms = [m for m in model.modules() if isinstance(m, modeling_llama.LlamaRMSNorm)]
    mlps = [m for m in model.modules() if isinstance(m, modeling_llama.LlamaMLP)]
    assert norms and mlps and modeling_llama.apply_rotary_pos_emb is not liger_rotary_pos_emb
    liger.swap(model)
    assert all(m.forward.__func__ is LigerRMSNorm.forward and m._get_name() == "LigerRMSNorm" for m in norms)
    assert all(m.forward.__func__ is LigerSwiGLUMLP.forward and m._get_name() == "LigerSwiGLUMLP" for m in mlps)
    assert modeling_llama.apply_rotary_pos_emb is liger_rotary_pos_emb
    assert type(model).forward is modeling_llama.LlamaForCausalLM.forward and "forward" not in vars(model)  # our loss, not Liger's
    after = model.state_dict()
    assert list(after) == list(before)
    assert all(torch.equal(after[k], before[k]) for k in before)
    layers = model.config.num_hidden_layers
    assert liger.describe(model) == (f"kernels: liger ({2 * layers + 1} LigerRMSNorm, {layers} LigerSwiGLUMLP, and its RoPE) in "
                                     "place of llama's own")


# -- CUDA: scripts/gpu_check.sh runs these (pytest -m gpu) -------------------------------------------------------------


def loss_and_grads(model, b, objective) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss, _ = objective(model, b)
    loss.backward()
    return loss.detach().float(), {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}


def assert_close_grads(grads, reference, rel):
    assert grads.keys() == reference.keys()
    for name in reference:  # relative to the gradient's norm: another summation order differs in the last bits
        assert (grads[name] - reference[name]).norm() <= rel * reference[name].norm(), name


@pytest.mark.gpu
@needs_cuda
@needs_liger
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_swapped_model_computes_the_same_loss_and_gradients(family_modules, precision):
    """Liger's RMSNorm, RoPE and SwiGLU against the family's own: one forward and backward of the quickstart's tiny
    Llama on CUDA, in fp32 and under bf16 autocast, the same weights."""
    from finetune.families import liger
    from finetune.methods.sft import SFT

    b = {k: v.cuda() for k, v in batch(vocab=100).items()}
    results = []
    for swapped in (False, True):
        model = tiny_model()[0].cuda()
        if swapped:
            liger.apply(model, torch.device("cuda"))
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "bf16"):
            results.append(loss_and_grads(model, b, SFT()))
    (own, own_grads), (mine, grads) = results
    rel = 1e-4 if precision == "fp32" else 2e-2
    torch.testing.assert_close(mine, own, rtol=rel, atol=rel)
    assert_close_grads(grads, own_grads, rel)


@pytest.mark.gpu
@needs_cuda
@needs_liger
@pytest.mark.parametrize("logits", [[], ["logits=chunked", "logits.kernel=liger"]], ids=["full", "liger-loss"])
def test_two_steps_with_liger_train_as_without(tmp_path, logits):
    """2 steps of the quickstart in bf16 on one GPU through the real CLI, model.kernels=liger (and Liger's loss) against
    none: the same losses (the second after an update, so the gradients agree too) and gradient norms, within bf16."""
    base = ["+recipe=quickstart_sft", "train.device=cuda", "precision=bf16", *STEPS]
    runs = {}
    for name, extra in [("own", []), ("liger", ["model.kernels=liger", *logits])]:
        out = run_cli(*base, *extra, f"hydra.run.dir={tmp_path / name}", cwd=tmp_path)
        assert out.returncode == 0, out.stderr[-3000:]
        runs[name] = [m for m in read_metrics(tmp_path / name) if m["kind"] == "train"]
        if name == "liger":
            assert "kernels: liger (" in out.stdout
    own, mine = runs["own"], runs["liger"]
    assert len(own) == len(mine) == 2
    assert [m["loss"] for m in mine] == pytest.approx([m["loss"] for m in own], rel=2e-2)
    assert [m["grad_norm"] for m in mine] == pytest.approx([m["grad_norm"] for m in own], rel=5e-2)
