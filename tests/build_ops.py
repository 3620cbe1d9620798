"""Build one of DeepSpeed's JIT ops for this machine's accelerator (what its engine loads on first use), into
TORCH_EXTENSIONS_DIR; conftest starts one of these per op when a test session starts (`prebuild_ops`).

    python tests/build_ops.py FusedAdamBuilder

Why: on a machine that never built them, DeepSpeed compiles each op the first time a rank needs it (here, on the CPU
accelerator: fused_adam, cpu_adam and the shm communication op, about 5 CPU-minutes together), one source file at a
time, inside a test that holds the cores of a job of two ranks: one core compiles, the other waits. Started with the
session, the builds fill the cores beside the first tests instead; a rank that needs an op meanwhile waits for the
build's lock, as it would for another rank's build. Where the ops are built already, loading them takes a second.
"""

from __future__ import annotations

import sys


def main(name: str) -> int:
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder(name)
    if builder is None or not builder.is_compatible():
        print(f"{name}: not built for {get_accelerator().device_name()} (no such op here, or not compatible)")
        return 0
    builder.load(verbose=False)
    print(f"{name}: built")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
