"""The engine interface (finetune/rank/engine/base.py) as the three engines implement it: every member the loop,
evaluation, the reference and the checkpoints call is there, in each."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from finetune.layouts import ENGINES
from finetune.rank.engine.base import Engine


def members() -> tuple[set[str], set[str]]:
    """(methods and properties, attributes) of the Engine protocol."""
    called = {name for name, value in vars(Engine).items() if not name.startswith("_") and (callable(value) or isinstance(value, (property, classmethod)))}
    return called, set(Engine.__annotations__)


@pytest.mark.parametrize("record", ENGINES, ids=lambda e: e.name)
def test_each_engine_has_every_member_of_the_interface(record):
    """Each record of finetune.layouts.ENGINES names a class that has the whole Engine protocol and every record field
    says something: an engine added as a record with a missing term fails here."""
    assert all(getattr(record, f.name) for f in dataclasses.fields(record)), record
    where, _, name = record.builds.partition(":")
    module = pytest.importorskip(where)
    cls = getattr(module, name)
    called, attributes = members()
    assert called == {"from_config", "train_step", "inference", "frozen", "generation_model", "memory_targets", "save", "load",
                      "export"}
    missing = sorted(m for m in called if not hasattr(cls, m))
    source = inspect.getsource(cls)
    missing += sorted(a for a in attributes if not hasattr(cls, a) and f"self.{a}" not in source)  # set in __init__
    assert not missing, f"{name} lacks {missing} of finetune.rank.engine.base.Engine"
    for m in called - {"generation_model"}:  # the same parameters, by name
        ours = list(inspect.signature(getattr(Engine, m)).parameters)
        theirs = list(inspect.signature(getattr(cls, m)).parameters)
        assert theirs[: len(ours)] == ours, f"{name}.{m}{theirs} against Engine.{m}{ours}"


@pytest.mark.parametrize("overrides,engine,launcher", [
    (["parallelism=single", "launcher.nproc_per_node=1"], "torch", "torchrun"),
    (["parallelism=ddp"], "torch", "torchrun"),
    (["parallelism=fsdp"], "mesh", "torchrun"),
    (["parallelism=tp2"], "mesh", "torchrun"),
    (["parallelism=cp2"], "mesh", "torchrun"),
    (["zero=stage2"], "deepspeed", "deepspeed"),
    (["zero=stage3_offload"], "deepspeed", "deepspeed"),
])
def test_the_engine_records_pick_what_runs_and_what_starts_it(compose, overrides, engine, launcher):
    from finetune.layouts import engine_kind, engine_of, launcher_for

    cfg = compose(["+recipe=quickstart_sft", *overrides])
    assert engine_kind(cfg) == engine_of(cfg).name == engine and launcher_for(cfg).value == launcher
