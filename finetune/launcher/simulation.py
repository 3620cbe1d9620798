"""plan.simulate=true: the formula plan beside the config's real step simulated (no torch here).

The step runs in a child process, `python -m finetune.rank.simulate` (the rank side: the rank's own model building,
strategies, engine and train_step under FakeTensorMode over a fake process group of the run's world size), which
writes its measurements as JSON; this module starts it and renders the table: per category the formula's bytes, the
simulation's and their ratio, and when each peak falls.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from finetune.config import Config, to_yaml
from finetune.planner.counts import GIB
from finetune.planner.peak import Plan

CHILD = "finetune.rank.simulate"


def measure(cfg: Config, pl: Plan, timeout: float = 3600.0) -> dict[str, Any]:
    """The child's result (bytes per category, see finetune.rank.simulate), {"refused": line} when the layout cannot be
    simulated, or {"failed": line} when the child died."""
    with tempfile.TemporaryDirectory(prefix="finetune-simulate-") as tmp:
        path, out = Path(tmp, "config.yaml"), Path(tmp, "result.json")
        path.write_text(to_yaml(cfg))
        argv = [sys.executable, "-m", CHILD, str(path), "--width", str(pl.width), "--world-size", str(cfg.world_size), "--out", str(out)]
        start = time.perf_counter()
        done = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=timeout)
        if done.returncode != 0 or not out.is_file():
            lines = [row for row in done.stderr.strip().splitlines() if row.strip()]
            return {"failed": f"{CHILD} exited {done.returncode}: {lines[-1] if lines else 'no output'}"}
        result = json.loads(out.read_text())
        result["wall_s"] = time.perf_counter() - start
        return result


def rows(pl: Plan, sim: dict[str, Any]) -> list[tuple[str, float, float, str]]:
    """(category, formula bytes, simulated bytes, when it is read) for the table and the tests."""
    gathered = sim["gathered"]
    return [
        ("weights", pl.weights, sim["weights"] + gathered,
         "held + the most gathered at once (FSDP)" if gathered else "held throughout"),
        ("gradients", pl.gradients, sim["gradients"], "at the optimizer step's start"),
        ("optimizer", pl.optimizer, sim["optimizer"], "after the optimizer step"),
        ("activations", pl.measured_activations, sim["backward_activations"], "saved + temporaries, backward's start or worst"),
        ("temporaries", pl.step_temp, sim["step_temporaries"], "at the optimizer step's own peak"),
        ("peak", pl.total - pl.overhead, sim["peak"], f"formula at {pl.peak_at}; simulated at {sim['peak_at']}"),
    ]


def render(cfg: Config, pl: Plan, sim: dict[str, Any]) -> str:
    """The table: formula vs simulated per category, GiB; or the one line saying why there is none."""
    if "refused" in sim or "failed" in sim:
        return f"simulated step: none ({sim.get('refused') or sim.get('failed')})"
    head = (f"simulated step, GiB -- rank 0 of {sim['world_size']} under FakeTensorMode ({sim['engine']}, {sim['tracker']}; the "
            f"second of two train_steps at {sim['rows']} x {sim['width']} tokens; {sim['wall_s']:.0f} s)")
    lines = [head, f"  {'':<12}{'formula':>9}{'simulated':>11}{'ratio':>8}   when"]
    for name, formula, measured, when in rows(pl, sim):
        ratio = f"{formula / measured:7.2f}x" if measured else f"{'-':>8}"
        lines.append(f"  {name:<12}{formula / GIB:9.2f}{measured / GIB:11.2f}{ratio}   {when}")
    lines.append("note: ratio = formula / simulated; the formula's peak is without its fixed overhead "
                 f"({pl.overhead / GIB:.2f} GiB: CUDA context, allocator), which the simulation does not see either")
    at = sim["at_peak"]
    parts = ", ".join(f"{k.lower()} {v / GIB:.2f}" for k, v in at.items() if k != "Total" and v >= GIB / 100)
    lines.append(f"note: simulated peak ({sim['peak_at']}): {parts}")
    return "\n".join(lines)
