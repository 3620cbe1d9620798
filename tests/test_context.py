"""Context parallel (parallelism.cp, finetune/rank/context.py): every sequence's tokens split over ranks, the
whole sequence attended through two all-to-alls. The slices and masks are checked piece by piece; the runs
on 2 and 4 CPU ranks follow one process's losses (padded and packed rows, sliding windows, soft-capping,
tensor parallel, DDP), activation memory per rank is measured at about 1/cp, the planner follows it, and
what cannot combine is refused before launch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import last_line, read_metrics, reload_and_evaluate, run_cli, train_here
from ranks import launch_here
from finetune.config import ASSETS, ConfigError
from finetune.rank.context import split_batch, whole_mask
from finetune.data.tokenize import IGNORE
from finetune.methods.losses import logits_logps, token_loss_sum

BASE = ["+recipe=quickstart_sft", "train.max_steps=3", "optim.warmup_steps=1", "train.micro_batch_size=8",
        "train.exact_match_samples=0", "train.progress_bar=false", "train.eval_every=0", "train.tensorboard=false"]
STEPS = [*BASE, "model.init.num_hidden_layers=4"]
SINGLE = ["parallelism=single", "launcher.nproc_per_node=1"]


# -- the pieces ---------------------------------------------------------------------------------


def test_slices_cover_every_token_and_every_label_once():
    """Rows padded to a multiple of cp; each slice's labels are one longer (its last position predicts the next
    slice's first label): the slices' targets are the row's targets, each once."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 50, (2, 7), generator=g)
    labels = ids.clone()
    labels[0, :3] = IGNORE
    labels[1, 5:] = IGNORE  # a right-padded row
    batch = {"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids)}
    parts = [split_batch(batch, rank, 3)[0] for rank in range(3)]
    assert [p["input_ids"].shape[1] for p in parts] == [3, 3, 3] and [p["labels"].shape[1] for p in parts] == [4, 4, 4]
    assert torch.equal(torch.cat([p["input_ids"] for p in parts], 1)[:, :7], ids)
    assert torch.equal(torch.cat([p["position_ids"] for p in parts], 1), torch.arange(9).expand(2, 9))
    targets = torch.cat([p["labels"][:, 1:] for p in parts], 1)
    assert torch.equal(targets[:, :6], labels[:, 1:]) and (targets[:, 6:] == IGNORE).all()
    assert "attention_mask" not in parts[0]  # the whole rows' mask is context parallel's own


def test_slice_losses_add_up_to_the_rows_loss():
    """token_loss_sum and logits_logps of the slices (labels one longer) sum to the whole rows' values."""
    g = torch.Generator().manual_seed(1)
    logits, ids = torch.randn(2, 8, 11, generator=g), torch.randint(0, 11, (2, 8), generator=g)
    labels = ids.clone()
    labels[:, :2] = IGNORE
    batch = {"input_ids": ids, "labels": labels}
    parts = [split_batch(batch, rank, 2)[0] for rank in range(2)]
    sliced = [logits[:, :4], logits[:, 4:]]
    assert sum(token_loss_sum(x, p["labels"]) for x, p in zip(sliced, parts)) == pytest.approx(float(token_loss_sum(logits, labels)), rel=1e-6)
    logps, counts = logits_logps(logits, labels)
    pieces = [logits_logps(x, p["labels"]) for x, p in zip(sliced, parts)]
    assert torch.allclose(sum(p[0] for p in pieces), logps, rtol=1e-6) and torch.equal(sum(p[1] for p in pieces), counts)


def test_the_whole_rows_mask():
    """Causal, per packed sample (positions restart), within the sliding window; None where sdpa's causal
    mask is all of it; additive for the eager function."""
    plain = torch.arange(5)[None]
    assert whole_mask(plain, None, None) is None and whole_mask(plain, 8, None) is None
    packed = torch.tensor([[0, 1, 2, 0, 1]])
    allowed = whole_mask(packed, None, None)[0, 0]
    assert allowed.tolist() == [[True, False, False, False, False], [True, True, False, False, False],
                                [True, True, True, False, False], [False, False, False, True, False],
                                [False, False, False, True, True]]
    windowed = whole_mask(plain, 2, None)[0, 0]
    assert windowed.tolist() == [[True, False, False, False, False], [True, True, False, False, False],
                                 [False, True, True, False, False], [False, False, True, True, False],
                                 [False, False, False, True, True]]
    additive = whole_mask(plain, None, torch.float32)[0, 0]
    assert torch.equal(additive == 0, torch.ones(5, 5, dtype=torch.bool).tril())


@pytest.mark.parametrize("overrides,message", [
    (["parallelism=cp2", "parallelism.pp=2", "launcher.nproc_per_node=4", "model.init.num_hidden_layers=4"],
     "parallelism.cp=2 does not compose with parallelism.pp=2: a pipeline stage hands whole sequences to the next: "
     "use cp with fsdp or ddp, and tp"),
    (["parallelism=cp2", "method=dpo", "data=quickstart_dpo"],
     "method=dpo with parallelism.cp=2 is not supported: the DPO loss needs each response's whole log-probability before it is "
     "computed, and each rank holds a slice of the tokens; use parallelism.cp=1 (with checkpointing=full and logits=chunked for "
     "long pairs)"),
    (["parallelism=cp4", "launcher.nproc_per_node=4"],
     "parallelism.cp=4 must divide the model's num_key_value_heads=2: each context-parallel rank attends over whole heads; use a "
     "cp that divides 2"),
    (["parallelism=cp2", "parallelism.tp=2", "launcher.nproc_per_node=4"],
     "parallelism.cp=2 must divide 1 per tensor-parallel rank (num_key_value_heads=2 / parallelism.tp=2): each context-parallel "
     "rank attends over whole heads; use a cp that divides 1"),
    (["parallelism=cp2", "launcher.nproc_per_node=3", "train.global_batch_size=48"],
     "parallelism.tp=1 x parallelism.pp=1 x parallelism.cp=2 = 2 ranks per model replica does not divide the launch size 3 "
     "(launcher.nproc_per_node=3 x launcher.nnodes=1): launch a multiple of 2 ranks"),
    (["parallelism=single", "parallelism.cp=2"],
     "parallelism.tp=1/pp=1/cp=2 need parallelism.strategy=ddp or fsdp (data parallel over world / (tp x pp x cp) replicas), "
     "not single"),
    (["parallelism=ddp", "parallelism.cp=2", "zero=stage2"],
     "zero=stage2 does not compose with parallelism.cp=2: ZeRO shards over data-parallel ranks on the DeepSpeed engine; FSDP2, "
     "tensor, pipeline and context parallel run on the mesh engine: use parallelism=ddp with zero, or zero=none"),
], ids=["pp", "dpo", "kv_heads", "kv_heads_per_tp_rank", "world", "single", "zero"])
def test_what_context_parallel_cannot_combine_with_is_refused(compose, overrides, message):
    with pytest.raises(ConfigError) as e:
        compose(["+recipe=quickstart_sft", "train.exact_match_samples=0", *overrides])
    assert str(e.value) == message


def test_the_planner_splits_activations_and_suggests_context_parallel(compose):
    """At 128k tokens, FSDP over 8 A100s of 40 GB does not fit even with full recompute (each block's
    input alone is 32 GiB in bf16); cp8 splits them (the long-context recipe), and plan.suggest offers
    context parallel."""
    from finetune.planner.peak import plan
    from finetune.launcher.suggest import suggest

    small = "hardware=a100_40g"
    one, split = compose(["+recipe=long_context", "parallelism=fsdp", small]), compose(["+recipe=long_context", small])
    whole, cp8 = plan(one), plan(split)
    assert not whole.fits and cp8.fits
    assert cp8.activations < whole.activations / 6  # 1/8 of the tokens per rank, plus the all-to-all buffers
    assert any("context parallel: 16384 of each row's 131072 tokens on each of 8 ranks" in n for n in cp8.notes)
    suggested = [" ".join(s.overrides) for s in suggest(one, count=5)]
    assert any("parallelism.cp=" in s for s in suggested), suggested


# -- runs ---------------------------------------------------------------------------------------


def losses(run_dir: Path) -> list[float]:
    return [m["loss"] for m in read_metrics(run_dir) if m["kind"] == "train"]


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def run(tmp_path: Path, name: str, *overrides: str, base: list[str] = STEPS) -> Path:
    out = launch_here(*base, *overrides, f"hydra.run.dir={tmp_path / name}", cwd=tmp_path)
    assert out.returncode == 0, name + out.stdout[-2000:] + out.stderr[-3000:]
    return tmp_path / name


def single(tmp_path: Path, *overrides: str, base: list[str] = STEPS) -> Path:
    """The one-process run the layouts are compared with: the rank's code in this process (the maths, not the launch)."""
    train_here([*base, *overrides, *SINGLE], tmp_path / "single")
    return tmp_path / "single"


def model_dir(root: Path, family: str, **keys) -> Path:
    """A local model (random weights, the shipped tokenizer) of `family` with config keys the random-init group
    does not take (sliding windows, dropout; GPT-2 reads the sizes through its aliases)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(ASSETS / "tokenizer"))
    config = AutoConfig.for_model(family, vocab_size=len(tok), pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                                  eos_token_id=tok.eos_token_id, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, **keys)
    torch.manual_seed(0)
    directory = root / family
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    tok.save_pretrained(directory)
    return directory


@pytest.mark.slow
@pytest.mark.parametrize("common,layouts", [
    ([], {"cp2": ["parallelism=cp2"], "cp2_ddp": ["parallelism=cp2", "parallelism.strategy=ddp"]}),
    # packed rows (per-sample masks), full recompute (the recomputed forward attends over the whole rows too), chunked loss
    (["data.packing=true", "checkpointing=full", "logits=chunked"], {"cp2": ["parallelism=cp2"]}),
    # 4 ranks: tp2 x cp2 (4 kv heads: 2 per tp rank, 1 per cp rank), and dp2 x cp2
    (["model.init.num_key_value_heads=4"], {"tp2_cp2": ["parallelism=cp2", "parallelism.tp=2", "launcher.nproc_per_node=4"],
                                            "dp2_cp2": ["parallelism=cp2", "launcher.nproc_per_node=4"]}),
], ids=["padded", "packed_recompute_chunked", "4_ranks"])
def test_context_parallel_follows_one_process(tmp_path, common, layouts):
    reference = single(tmp_path, *common)
    for name, layout in layouts.items():
        got = run(tmp_path, name, *common, *layout)
        assert losses(got) == pytest.approx(losses(reference), rel=1e-5), name
        after = summary(reference)["after"]["eval_loss"]
        assert summary(got)["after"]["eval_loss"] == pytest.approx(after, rel=1e-5), name  # evaluation split the same way
    assert reload_and_evaluate(got / "final", got)[0] == pytest.approx(after, rel=1e-4)  # one checkpoint, gathered


@pytest.mark.slow
@pytest.mark.parametrize("family,keys,extra", [
    # alternating sliding-window layers (4 tokens: the rows are longer), soft-capped logits in its eager function
    ("gemma2", {"sliding_window": 4}, ["data.packing=true"]),
    ("mistral", {"sliding_window": 4}, []),
    ("gpt2", {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}, []),  # learned positions, Conv1D, no dropout to differ
], ids=["gemma2", "mistral", "gpt2"])
def test_families_under_context_parallel(tmp_path, family, keys, extra):
    directory = model_dir(tmp_path, family, **keys)
    common = ["model=pretrained", f"model.path={directory}", "train.max_steps=2", *extra]
    reference = single(tmp_path, *common, base=BASE)
    got = run(tmp_path, "cp2", *common, "parallelism=cp2", base=BASE)
    assert losses(got) == pytest.approx(losses(reference), rel=1e-5)


@pytest.mark.slow
def test_activation_memory_per_rank_is_split_and_planned(tmp_path):
    """The long-context recipe at CPU size, on rows of ~400 tokens (no packing: no whole-row mask, which every
    rank would hold whole, as sdpa does without context parallel): per rank, the activations MemTracker measures
    under cp2 are about half of one rank's, and the planner follows each within 15% (peak) / 25% (activations)."""
    rows = tmp_path / "long.jsonl"
    rows.write_text("".join(json.dumps({"instruction": "repeat", "output": "abcdefghij" * 40 + str(i)}) + "\n" for i in range(16)))
    common = ["+recipe=long_context_cpu", "data=jsonl", f"data.train={rows}", "data.packing=false", "checkpointing=none",
              "train.max_steps=2", "optim.warmup_steps=0", "train.exact_match_samples=0", "train.progress_bar=false", "train.memory_report=categories"]
    measured = {}
    for name, layout in (("cp1", ["parallelism=fsdp", "launcher.nproc_per_node=1"]), ("cp2", [])):
        out = launch_here(*common, *layout, f"hydra.run.dir={tmp_path / name}", cwd=tmp_path)
        assert out.returncode == 0, out.stderr[-3000:]
        records = read_metrics(tmp_path / name)
        planned, memory = (next(r for r in records if r["kind"] == kind) for kind in ("plan", "memory"))
        assert planned["plan_peak_mib"] == pytest.approx(memory["mem_peak_total_mib"], rel=0.15), name
        assert planned["plan_activations_mib"] == pytest.approx(memory["mem_backward_activations_mib"], rel=0.25), name
        measured[name] = memory["mem_activations_mib"]
    print(f"activations MiB per rank: cp1 {measured['cp1']:.1f}, cp2 {measured['cp2']:.1f}")
    assert measured["cp2"] < 0.55 * measured["cp1"]
    assert losses(tmp_path / "cp2") == pytest.approx(losses(tmp_path / "cp1"), rel=1e-5)
