"""The layouts as records (finetune/layouts/__init__.py LAYOUTS): every record says each thing the code needs of it, the
code it names exists, its planner terms change the plan of a config that uses it, and what it composes with is what
the engines run. A layout added with a missing or empty term fails here."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from finetune.config import ConfigError
from finetune.layouts import ENGINES, LAYOUTS, LayoutRecord, check_composes, engine_kind, layouts_of, resolve, shape
from finetune.planner.peak import plan

STATES = ["arch", "cfg", "s", "counts", "on_gpu", "notes"]
WORK = ["arch", "cfg", "w", "notes"]
OPTIONAL = {"rules", "states", "work", "fixed"}  # may be None or empty, each for its reason (the record's docstring)

GPU = ["hardware=h100_80g", "launcher.nproc_per_node=8", "train.micro_batch_size=1", "train.global_batch_size=8", "precision=bf16"]
USES = {  # layout -> a quickstart config that uses it, planned on GPUs (offload to CPU moves something only there)
    "zero0": ["zero=stage0", "parallelism=ddp", *GPU],
    "zero1": ["zero=stage1", "parallelism=ddp", *GPU],
    "zero2": ["zero=stage2", "parallelism=ddp", *GPU],
    "zero3": ["zero=stage3", "parallelism=ddp", *GPU],
    "zero_offload_optimizer": ["zero=stage2_offload", "parallelism=ddp", *GPU],
    "zero_offload_param": ["zero=stage3_offload", "parallelism=ddp", *GPU],
    "cp": ["parallelism=cp2", *GPU],
    "tp": ["parallelism=tp2", *GPU],
    "pp": ["parallelism=pp2", "parallelism.pp_schedule=gpipe", *GPU, "train.global_batch_size=16"],
    "ddp": ["parallelism=ddp", *GPU],
    "fsdp": ["parallelism=fsdp", *GPU],
    "fsdp_offload": ["parallelism=fsdp_offload", *GPU],
}


@pytest.mark.parametrize("rec", LAYOUTS, ids=lambda r: r.name)
def test_each_layout_record_says_everything(rec: LayoutRecord):
    """Every field says something (but those that may be empty for a reason), the code each names exists with the
    signature the planner calls, and at least one memory term is there."""
    assert all(getattr(rec, f.name) for f in dataclasses.fields(rec) if f.name not in OPTIONAL), rec
    assert rec.states or rec.work, f"layout {rec.name} has no memory term for the planner (states or work)"
    assert set(rec.engines) <= {e.name for e in ENGINES}
    assert set(rec.fixed) <= set(shape(_compose(USES[rec.name])))
    for term, params in ((rec.states, STATES), (rec.work, WORK)):
        if term is not None:
            assert list(inspect.signature(resolve(term)).parameters) == params, term
    pytest.importorskip("torch")
    assert callable(resolve(rec.rank)), rec.rank


def test_what_composes_runs_on_one_engine_and_both_ways():
    """composes is symmetric, and two layouts said to compose share an engine that runs them (engine_of could not pick
    one otherwise); the layouts' names are one each, and every layout has a config in USES."""
    names = [r.name for r in LAYOUTS]
    assert len(set(names)) == len(names) and set(names) == set(USES)
    for a in LAYOUTS:
        for b in a.composes:
            other = next(r for r in LAYOUTS if r.name == b)
            assert a.name in other.composes, f"{a.name} composes with {b}, not the other way"
            assert set(a.engines) & set(other.engines), f"{a.name} and {b} compose but no engine runs both"


_composed: dict[tuple[str, ...], object] = {}


def _compose(overrides: list[str]):
    from finetune.launcher.compose import preflight

    key = tuple(overrides)
    if key not in _composed:
        _composed[key] = preflight(["+recipe=quickstart_sft", *overrides])
    return _composed[key]


def _numbers(p) -> tuple[float, ...]:
    return (p.weights, p.gradients, p.optimizer, p.activations, p.logits, p.backward, p.cpu_bytes, p.nvme_bytes, p.total)


@pytest.mark.parametrize("name", list(USES))
def test_each_layouts_terms_change_the_plan(name, monkeypatch):
    """A config that uses the layout finds it, runs on an engine that runs it, and planned without each of its terms
    the numbers change: a term that does nothing, or one the planner does not read, fails here."""
    import finetune.layouts as layouts

    cfg = _compose(USES[name])
    rec = next(r for r in layouts_of(cfg) if r.name == name)
    assert engine_kind(cfg) in rec.engines
    with_terms = _numbers(plan(cfg))
    for term in ("states", "work"):
        if getattr(rec, term) is None:
            continue
        without = tuple(dataclasses.replace(r, **{term: None}) if r is rec else r for r in LAYOUTS)
        monkeypatch.setattr(layouts, "LAYOUTS", without)
        assert _numbers(plan(cfg)) != with_terms, f"{name}'s {term} term changes nothing in the plan"
        monkeypatch.setattr(layouts, "LAYOUTS", LAYOUTS)


@pytest.mark.parametrize("overrides,message", [
    (["zero=stage2", "parallelism=tp2", "launcher.nproc_per_node=2"],
     "zero=stage2 does not compose with parallelism.tp=2: ZeRO shards over data-parallel ranks on the DeepSpeed engine; FSDP2, "
     "tensor, pipeline and context parallel run on the mesh engine: use parallelism=ddp with zero, or zero=none"),
    (["zero=stage3", "parallelism=fsdp", "launcher.nproc_per_node=2"],
     "zero=stage3 does not compose with parallelism=fsdp: ZeRO shards over data-parallel ranks on the DeepSpeed engine; FSDP2, "
     "tensor, pipeline and context parallel run on the mesh engine: use parallelism=ddp with zero, or zero=none"),
])
def test_layouts_that_do_not_compose_are_refused_naming_both(overrides, message):
    """The refusal comes from the records: the earlier layout's reason, both as the user spelled them."""
    from finetune.launcher.compose import preflight

    with pytest.raises(ConfigError) as e:
        preflight(["+recipe=quickstart_sft", *overrides])
    assert str(e.value) == message


def test_check_composes_reads_the_records(monkeypatch):
    """Taking a pair out of the records' composes refuses a layout the engines run: the rule is the records, not a
    list kept beside them."""
    import finetune.layouts as layouts

    cfg = _compose(USES["tp"])
    check_composes(cfg)
    apart = tuple(dataclasses.replace(r, composes=tuple(n for n in r.composes if n != "ddp")) if r.name == "tp" else r
                  for r in LAYOUTS)
    monkeypatch.setattr(layouts, "LAYOUTS", apart)
    with pytest.raises(ConfigError, match=r"^parallelism.tp=2 does not compose with parallelism=ddp: "):
        check_composes(cfg)


@pytest.mark.parametrize("saved,now,refused", [
    (["parallelism=pp2", "launcher.nproc_per_node=2", "train.micro_batch_size=1", "train.global_batch_size=8"],
     ["parallelism=fsdp", "launcher.nproc_per_node=2", "train.micro_batch_size=1", "train.global_batch_size=8"], "pp=2"),  # the saved layout fixes pp
    (["parallelism=fsdp", "launcher.nproc_per_node=2", "train.micro_batch_size=1", "train.global_batch_size=8"],
     ["parallelism=pp2", "launcher.nproc_per_node=2", "train.micro_batch_size=1", "train.global_batch_size=8"], "pp=1"),  # and so does the new one
    (["zero=stage2", "parallelism=ddp", "launcher.nproc_per_node=4", "train.micro_batch_size=1", "train.global_batch_size=8"],
     ["zero=stage2", "parallelism=ddp", "launcher.nproc_per_node=2", "train.micro_batch_size=1", "train.global_batch_size=8"], "world_size=4"),
    (["parallelism=fsdp", "launcher.nproc_per_node=4", "train.micro_batch_size=1", "train.global_batch_size=8"],
     ["parallelism=fsdp", "launcher.nproc_per_node=2", "train.micro_batch_size=1", "train.global_batch_size=8"], None),  # DCP reshards
    (["zero=stage3", "parallelism=ddp", "launcher.nproc_per_node=2", "train.micro_batch_size=1", "train.global_batch_size=8"],
     ["zero=stage3_offload", "parallelism=ddp", "launcher.nproc_per_node=2", "train.micro_batch_size=1", "train.global_batch_size=8"], None),
])
def test_a_resume_keeps_what_the_layouts_checkpoints_fix(tmp_path, saved, now, refused):
    """check_compatible reads the records' `fixed` keys of the saved layouts and of the new ones: what a layout's
    checkpoint cannot change is refused naming the key, what it can is resumed."""
    import json

    pytest.importorskip("torch")
    from finetune.rank.checkpoint import META, check_compatible, config_hash, layout, trajectory

    before, after = _compose(saved), _compose(now)
    settings = trajectory(before)
    (tmp_path / META).write_text(json.dumps({"step": 1, "config_hash": config_hash(settings), "settings": settings,
                                             "layout": layout(before)}))
    if refused is None:
        check_compatible(tmp_path, after)
        return
    with pytest.raises(ConfigError, match=f"was saved with {refused} .*that checkpoint format cannot change it"):
        check_compatible(tmp_path, after)
