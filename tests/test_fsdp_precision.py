"""precision=bf16 under FSDP2 as torchtitan trains it (finetune.rank.parallel.fully_shard's MixedPrecisionPolicy, no
autocast in the mesh engine), measured on two gloo ranks of the tiny Llama, each step run by the engine itself: half the
all-gather bytes of the fp32 gathers autocast had, the root gathered once a step rather than twice, gradients still
reduce-scattered in fp32, no bf16 copy of the blocks' weights alive when the forward ends (autocast's weight-cast cache
kept one of every weight), and the losses within bf16's rounding of the old path's. LoRA, QLoRA and FP8 (torchao's FP8
all-gather, through torch's CPU FP8 matmuls) take the same policy; the planner counts what it gathers."""

from __future__ import annotations

import os
import pickle
import tempfile
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch

import ranks

LAYOUT = ["+recipe=quickstart_sft", "parallelism=fsdp", "launcher.nproc_per_node=2", "train.micro_batch_size=2",
          "train.global_batch_size=4", "optim.warmup_steps=0", "optim.lr=3e-3"]
ROWS, WIDTH = 2, 37  # a micro-batch of 2 x 37 tokens: no activation has the shape of a weight


def on_ranks(fn: Any, *args: Any, world: int = 2) -> list[Any]:
    """fn(*args) on `world` gloo ranks forked from tests/ranks.py's fork server; each rank's return value."""
    ctx, port = ranks.context(), ranks.free_port()
    with tempfile.TemporaryDirectory() as out, ranks.cores(world):
        procs = [ctx.Process(target=_rank, args=(r, world, port, out, fn, args)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(300)
        assert [p.exitcode for p in procs] == [0] * world, [Path(out, f"{r}.err").read_text()[-3000:] for r in range(world)
                                                           if Path(out, f"{r}.err").is_file()]
        return [pickle.loads(Path(out, f"{r}.pkl").read_bytes()) for r in range(world)]


def _rank(rank: int, world: int, port: int, out: str, fn: Any, args: tuple) -> None:
    import traceback

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    code = 1
    try:
        Path(out, f"{rank}.pkl").write_bytes(pickle.dumps(fn(*args)))
        code = 0
    except BaseException:  # noqa: BLE001 - the parent shows it
        Path(out, f"{rank}.err").write_text(traceback.format_exc())
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        os._exit(code)


class Collectives:
    """FSDP2's all-gathers and reduce-scatters (torch.distributed's *_single, what torch 2.13's FSDP2 calls), recorded:
    (output elements, dtype) of each."""

    def __init__(self) -> None:
        self.gathers: list[tuple[int, torch.dtype]] = []
        self.reduces: list[tuple[int, torch.dtype]] = []

    def __enter__(self) -> Collectives:
        dist = torch.distributed
        self.saved = dist.all_gather_single, dist.reduce_scatter_single
        gather, reduce = self.saved

        def all_gather_single(output, input, *args, **kwargs):
            self.gathers.append((output.numel(), output.dtype))
            return gather(output, input, *args, **kwargs)

        def reduce_scatter_single(output, input, *args, **kwargs):
            self.reduces.append((input.numel(), input.dtype))
            return reduce(output, input, *args, **kwargs)

        dist.all_gather_single, dist.reduce_scatter_single = all_gather_single, reduce_scatter_single
        return self

    def __exit__(self, *exc: Any) -> None:
        torch.distributed.all_gather_single, torch.distributed.reduce_scatter_single = self.saved

    @staticmethod
    def bytes(calls: list[tuple[int, torch.dtype]]) -> int:
        return sum(n * dt.itemsize for n, dt in calls)


class AliveAtForwardEnd(torch.utils._python_dispatch.TorchDispatchMode):
    """Every bf16 tensor made during the forward with the shape of one of `shapes` (the blocks' weights, or their
    transposes), kept by weak reference: `alive_bytes()` at the forward's end counts those still holding memory (each
    storage once). Autocast's cast cache holds one per weight it cast; FSDP frees its gathered weights' storage."""

    def __init__(self, shapes: set[tuple[int, ...]]) -> None:
        super().__init__()
        self.shapes, self.made = shapes | {s[::-1] for s in shapes}, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if type(t) in (torch.Tensor, torch.nn.Parameter) and t.dtype == torch.bfloat16 and tuple(t.shape) in self.shapes:
                self.made.append(weakref.ref(t))
        return out

    def alive_bytes(self) -> int:
        storages = {}
        for ref in self.made:
            t = ref()
            if t is not None and t.untyped_storage().nbytes():
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return sum(storages.values())


def build(cfg: Any, dist: Any, run_dir: Path) -> torch.nn.Module:
    """The model as a rank builds it (finetune.rank.train's load): 4-bit under QLoRA, FP8 layers, then the adapters."""
    from finetune.config import ASSETS
    from finetune.rank import fp8, model

    cfg.model.tokenizer = str(ASSETS / "tokenizer")
    tok = model.load_tokenizer(cfg.model, cfg.data)
    net = model.load_model(cfg.model, tok, attention="sdpa", peft=cfg.peft, compute_dtype=torch.bfloat16, zero3=False,
                           run_dir=run_dir, is_main=dist.is_main, barrier=dist.barrier, fsdp=True)
    if cfg.precision.fp8 is not None:
        fp8.convert(net, cfg.precision.fp8.value, dist.device, on_cpu=True, fsdp=True)
    return model.apply_strategies(net, checkpointing=cfg.checkpointing, peft=cfg.peft)


def steps(mode: str, run_dir: str, count: int = 3, extra: tuple[str, ...] = (), frozen: bool = False) -> dict[str, Any]:
    """`count` steps of the tiny Llama under FSDP2 on this rank, run by the mesh engine. mode: bf16 (the policy),
    autocast (precision=bf16 as it ran before: autocast over fp32 gathers, the root resharded after forward), fp32.
    Returns the losses, each step's collectives, the root's gathered elements, and what the first forward left alive;
    with `frozen`, a frozen copy's gathers over two forwards and whether it is all shards after them."""
    import contextlib
    import math

    from finetune.config import Device
    from finetune.launcher.compose import preflight
    from finetune.methods.losses import forward, token_loss_sum
    from finetune.rank import parallel
    from finetune.rank.dist import init
    from finetune.rank.engine.mesh_engine import MeshEngine

    dist = init(Device.cpu)
    cfg = preflight([*LAYOUT, f"precision={'fp32' if mode == 'fp32' else 'bf16'}", *extra])
    net = build(cfg, dist, Path(run_dir))
    blocks = parallel.block_list(net)[1]
    shapes = {tuple(q.shape) for q in blocks.parameters() if q.ndim == 2 and q.is_floating_point()}
    block_bytes = 2 * sum(q.numel() for q in blocks.parameters() if q.ndim == 2 and q.is_floating_point())
    if mode == "autocast":  # the old path: fully_shard without a policy, the root resharded, autocast in the forward
        shard = parallel.fully_shard
        parallel.fully_shard = lambda *a, **k: shard(*a, **{**k, "param_dtype": None, "keep_root": False})
    try:
        engine = MeshEngine(net, cfg=cfg, dist=dist)
    finally:
        if mode == "autocast":
            parallel.fully_shard = shard
            engine.param_dtype = None
    world = dist.world_size
    root = [q for n, q in parallel.causal_lm(engine.model).named_parameters() if ".layers." not in n]
    root_numel = world * sum(-(-q.shape[0] // world) * math.prod(q.shape[1:]) for q in root)  # row shards, padded
    torch.manual_seed(dist.rank)  # each rank its own batches
    batches = [torch.randint(0, 103, (ROWS, WIDTH)) for _ in range(count)]
    seen: dict[str, Any] = {}

    def objective(model, batch):
        watch = AliveAtForwardEnd(shapes) if not seen else contextlib.nullcontext()
        with watch:
            logits = forward(model, batch)
            loss = token_loss_sum(logits, batch["labels"]) / batch["labels"][:, 1:].numel()
        seen.setdefault("alive", watch.alive_bytes() if isinstance(watch, AliveAtForwardEnd) else None)
        seen.setdefault("dtypes", (str(logits.dtype), str(loss.dtype)))
        return loss, {}

    out: dict[str, Any] = {"losses": [], "gathers": [], "reduces": [], "root_numel": root_numel, "block_bytes": block_bytes}
    for ids in batches:
        with Collectives() as calls:
            result = engine.train_step([{"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids)}], objective, 1.0)
        out["losses"].append(float(torch.as_tensor(result.loss_sum)))
        out["gathers"].append(calls.gathers)
        out["reduces"].append(calls.reduces)
    out["shards"] = sorted({str(q.to_local().dtype) for q in engine.params})
    if frozen:  # a frozen copy (DPO's live reference) placed by the engine: two forwards without gradients
        reference = engine.frozen(build(cfg, dist, Path(run_dir)))
        with Collectives() as calls, torch.no_grad():
            for ids in batches[:2]:
                forward(reference, {"input_ids": ids})
        out["frozen_gathers"] = calls.gathers
        out["frozen_resharded"] = all(type(q).__name__ == "DTensor" for q in reference.parameters())
    return {**out, **seen}


MODES = ("bf16", "autocast", "fp32")


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict[str, list[dict[str, Any]]]:
    """Three steps of the tiny Llama on two ranks in each mode (and its frozen copy's two forwards): {mode: per rank}."""
    runs = on_ranks(each_mode, MODES, str(tmp_path_factory.mktemp("fsdp")), 3, (), True)
    return {mode: [rank[mode] for rank in runs] for mode in MODES}


def each_mode(modes: tuple[str, ...], run_dir: str, *args: Any) -> dict[str, dict[str, Any]]:
    """`steps` in each of `modes`, one after another on this rank: {mode: its measurements}."""
    return {mode: steps(mode, run_dir, *args) for mode in modes}


def sizes(calls: list[tuple[int, torch.dtype]]) -> list[int]:
    return [n for n, _ in calls]


def test_bf16_gathers_half_the_bytes_of_fp32_and_the_root_once_a_step(measured):
    """Each step gathers every unit's weights in bf16: the same gathers as fp32's at half the bytes (measured per rank
    and step: 1,628,416 bytes, against 3,256,832 in fp32 and 3,363,840 on the old path, autocast over fp32 gathers that
    gathered the root twice); the root (embeddings, final norm, head) once, kept for backward, each of the 2 blocks
    twice (resharded after forward); the gradients still reduce-scattered in fp32, as many bytes as before."""
    for rank in range(2):
        bf16, old, fp32 = (measured[mode][rank] for mode in MODES)
        root = bf16["root_numel"]
        for step in range(3):
            gathers = bf16["gathers"][step]
            print(f"rank {rank} step {step}: all-gather bytes bf16 {Collectives.bytes(gathers):,}, fp32 "
                  f"{Collectives.bytes(fp32['gathers'][step]):,}, old path {Collectives.bytes(old['gathers'][step]):,}")
            assert {dt for _, dt in gathers} == {torch.bfloat16} and {dt for _, dt in old["gathers"][step]} == {torch.float32}
            assert sizes(gathers) == sizes(fp32["gathers"][step]) and len(gathers) == 1 + 2 * 2
            assert 2 * Collectives.bytes(gathers) == Collectives.bytes(fp32["gathers"][step])
            assert sizes(gathers).count(root) == 1 and sizes(old["gathers"][step]).count(root) == 2
            assert 2 * Collectives.bytes(gathers) < Collectives.bytes(old["gathers"][step])
            assert bf16["reduces"][step] == old["reduces"][step] == fp32["reduces"][step]
            assert {dt for _, dt in bf16["reduces"][step]} == {torch.float32} and len(bf16["reduces"][step]) == 3


def test_no_bf16_copy_of_the_blocks_weights_is_alive_when_the_forward_ends(measured):
    """Autocast's weight-cast cache kept a bf16 copy of every block weight until the forward ended (measured: 786,432
    bytes, all of the 2 blocks' matrices); FSDP's bf16 gathers are freed as each block reshards: none."""
    for rank in range(2):
        assert measured["autocast"][rank]["alive"] == measured["autocast"][rank]["block_bytes"] == 786_432
        assert measured["bf16"][rank]["alive"] == 0 and measured["fp32"][rank]["alive"] == 0


def test_bf16_losses_stay_within_bf16s_rounding_of_the_old_paths(measured):
    """bf16 logits, the loss upcast to fp32 before its log-softmax, fp32 master shards; 3 steps within bf16's 2**-8 of the
    old path's and fp32's losses (measured at most 4.5e-4 relative), and not fp32's own (it computes in bf16)."""
    for rank in range(2):
        bf16, old, fp32 = (measured[mode][rank] for mode in MODES)
        assert bf16["dtypes"] == ("torch.bfloat16", "torch.float32") and bf16["shards"] == ["torch.float32"]
        for other in (old, fp32):
            deltas = [abs(a - b) / b for a, b in zip(bf16["losses"], other["losses"])]
            print(f"rank {rank}: loss deltas {['%.1e' % d for d in deltas]}")
            assert max(deltas) < 2**-8
        assert bf16["losses"] != fp32["losses"]


def test_a_frozen_copy_takes_the_policy_and_reshards_the_root(measured):
    """engine.frozen (a live reference, a teacher): gathered in bf16 under the same policy, every unit, the root too,
    resharded after each forward (no backward comes to free it): two forwards gather the root twice."""
    for rank in range(2):
        bf16 = measured["bf16"][rank]
        gathers = bf16["frozen_gathers"]
        assert {dt for _, dt in gathers} == {torch.bfloat16} and len(gathers) == 2 * (1 + 2)
        assert sizes(gathers).count(bf16["root_numel"]) == 2 and bf16["frozen_resharded"]
        assert {dt for _, dt in measured["fp32"][rank]["frozen_gathers"]} == {torch.float32}


@pytest.mark.parametrize("variant,extra", [
    ("lora", ("peft=lora", "peft.dropout=0.0")),
    ("qlora", ("peft=qlora", "peft.dropout=0.0")),
    ("fp8", ("precision=fp8", "precision.fp8_on_cpu=true")),
])
def test_lora_qlora_and_fp8_take_the_policy(variant, extra, tmp_path):
    """LoRA (its adapters gathered with their block, bf16), QLoRA (the 4-bit bytes gathered as they are: FSDP moves a
    block of mixed dtypes as bytes, 176,640 of them against 254,976 with the adapters and norms in fp32) and FP8
    (torchao's FP8 all-gather of the converted weights, bytes too; the rest bf16): fewer bytes than the old path, no
    bf16 copy alive when the forward ends, and 2 steps' losses within bf16's rounding of it."""
    runs = on_ranks(each_mode, ("bf16", "autocast"), str(tmp_path), 2, extra)[0]
    new, old = runs["bf16"], runs["autocast"]
    for step in range(2):
        ours, theirs = new["gathers"][step], old["gathers"][step]
        print(f"{variant} step {step}: all-gather bytes {Collectives.bytes(ours):,}, old path {Collectives.bytes(theirs):,}")
        assert Collectives.bytes(ours) < Collectives.bytes(theirs) and sizes(ours).count(new["root_numel"]) == 1
        blocks = {dt for n, dt in ours if n != new["root_numel"]}
        assert blocks == ({torch.bfloat16} if variant == "lora" else {torch.uint8})
        assert {dt for _, dt in new["reduces"][step]} == {torch.float32}
    assert new["alive"] == 0 and new["shards"] == ["torch.float32"]
    assert new["losses"] == pytest.approx(old["losses"], rel=2**-8)


def test_the_planner_counts_the_root_kept_gathered_and_bf16_gathers(measured):
    """The planner's FSDP2 units are the ranks' measured gathers (the root's elements within the shards' padding, a
    block's exactly), what it holds gathered is counted in bf16 under the policy (2 bytes a weight and an unsharded
    gradient, the reduce-scatter's copy fp32: 1,654,272 bytes here against fp32 gathers' 2,521,088) with the root kept
    gathered, and the activations are a bf16 module's (no autocast copies): below the old path's plan (measured here:
    weights 2,494,720 bytes against 3,361,536, activations 1,645,056 against 2,818,304). tests/test_simulate.py checks the same formula against a simulated FSDP2 step at
    Llama-3.1-8B's and -70B's shapes."""
    from finetune.launcher.compose import preflight
    from finetune.planner import activations, terms
    from finetune.planner.counts import architecture, fsdp_frozen_and_gathered, fsdp_root_params
    from finetune.planner.peak import plan

    cfg = preflight([*LAYOUT, "precision=bf16"])
    arch = architecture(cfg.model)
    gathers = sizes(measured["bf16"][0]["gathers"][0])
    root = measured["bf16"][0]["root_numel"]
    assert fsdp_root_params(arch, cfg) == pytest.approx(root, rel=0.01) and gathers.count(root) == 1
    assert {n for n in gathers if n != root} == {arch.block_params}
    bf16, fp32 = (fsdp_frozen_and_gathered(arch, cfg, 0.0, w, 4)[1] for w in (2, 4))
    assert (bf16, fp32) == (1_654_272, 2_521_088) and bf16 > 2 * 2 * (root + arch.block_params) * 0.99  # both, twice
    ours = plan(cfg)
    assert any(n.startswith("FSDP2 in mixed precision (precision=bf16): fp32 shards, each unit gathered and computed in bf16")
               for n in ours.notes)
    with pytest.MonkeyPatch.context() as mp:  # the old path's plan: fp32 gathers, autocast
        mp.setattr(activations, "fsdp_gathers_bf16", lambda cfg: False)
        mp.setattr(terms, "fsdp_gathers_bf16", lambda cfg: False)
        before = plan(cfg)
    print(f"plan: weights {ours.weights:,.0f} bytes (old path {before.weights:,.0f}), activations {ours.activations:,.0f} "
          f"({before.activations:,.0f})")
    assert ours.weights - before.weights == pytest.approx(bf16 - fp32) and ours.activations < before.activations
