"""The memory planner: per-rank bytes of a composed config, before anything starts (launcher side: no torch).

In the order it computes (each module imports only those before it):

- counts.py: the architecture (finetune/families/), trainable vs frozen parameters, and the bytes of weights,
  gradients and optimizer states per parameter for each engine and precision.
- activations.py: what a block and the head save for backward, tensor by tensor, and how checkpointing, offload
  and a pipeline hold it through backward.
- peak.py: `plan(cfg, longest) -> Plan`: the categories per rank, the backward and optimizer-step peaks, offload,
  the budget it is checked against.
- records.py: the plan beside what a run measured (metrics.jsonl's plan and memory records).
- suggest.py: override sets that fit, in docs/memory.md's order of strategies.
- cli.py: `python -m finetune.plan ...` (finetune/plan.py keeps that command) and the rendered table.

The formulas are docs/memory.md's; tests/test_plan.py and tests/test_plan_families.py check them against autograd's
saved tensors and MemTracker. Callers import the module they need (`from finetune.planner.peak import plan`).
"""
