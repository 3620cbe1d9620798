"""The engine interface (finetune/rank/engine/base.py) as the three engines implement it: every member the loop,
evaluation, the reference and the checkpoints call is there, in each."""

from __future__ import annotations

import inspect

import pytest

from finetune.rank.engine.base import Engine


def members() -> tuple[set[str], set[str]]:
    """(methods and properties, attributes) of the Engine protocol."""
    called = {name for name, value in vars(Engine).items() if not name.startswith("_") and (callable(value) or isinstance(value, property))}
    return called, set(Engine.__annotations__)


@pytest.mark.parametrize("where, name", [("torch_engine", "TorchEngine"), ("deepspeed_engine", "DeepSpeedEngine"),
                                         ("mesh_engine", "MeshEngine")])
def test_each_engine_has_every_member_of_the_interface(where, name):
    module = pytest.importorskip(f"finetune.rank.engine.{where}")
    cls = getattr(module, name)
    called, attributes = members()
    assert called == {"train_step", "inference", "frozen", "generation_model", "memory_targets", "save", "load", "export"}
    missing = sorted(m for m in called if not hasattr(cls, m))
    source = inspect.getsource(cls)
    missing += sorted(a for a in attributes if not hasattr(cls, a) and f"self.{a}" not in source)  # set in __init__
    assert not missing, f"{name} lacks {missing} of finetune.rank.engine.base.Engine"
    for m in called - {"generation_model"}:  # the same parameters, by name
        ours = list(inspect.signature(getattr(Engine, m)).parameters)
        theirs = list(inspect.signature(getattr(cls, m)).parameters)
        assert theirs[: len(ours)] == ours, f"{name}.{m}{theirs} against Engine.{m}{ours}"
