"""method=distill (finetune/methods/distill.py, finetune/rank/teacher.py): each divergence against its formula by hand,
the chunked path equal to the whole-logits one (loss and gradients), a model distilled into itself at zero, the rules
and refusals in one line, the planner's teacher, a run through the CLI that moves the student towards its teacher, and
the same run through one process, DDP, FSDP2 and ZeRO-3."""

from __future__ import annotations

import copy
import math

import pytest

from finetune.config import ConfigError
from finetune.methods.distill import DISTILL, DistillConfig, DistillLoss, divergence

from conftest import GenerationEngine, read_metrics, run_cli, tiny_model, train_here
from ranks import launch_here

torch = pytest.importorskip("torch")

STUDENT = [[1.0, 0.0, -1.0], [0.5, 2.0, 0.0]]
TEACHER = [[0.0, 1.0, 0.5], [0.5, 2.0, 0.0]]  # the second position: the same logits as the student's


def softmax(z: list[float], t: float) -> list[float]:
    e = [math.exp(x / t) for x in z]
    return [x / sum(e) for x in e]


def kl(p: list[float], q: list[float]) -> float:
    return sum(a * math.log(a / b) for a, b in zip(p, q))


@pytest.mark.parametrize("loss,beta,t", [("forward_kl", 0.5, 1.0), ("reverse_kl", 0.5, 1.0), ("jsd", 0.3, 1.0), ("jsd", 0.5, 2.0),
                                         ("forward_kl", 0.5, 2.0)])
def test_each_divergence_is_its_formula_by_hand(loss, beta, t):
    """forward KL(P || Q), reverse KL(Q || P), and GKD's generalized JSD beta KL(P || M) + (1 - beta) KL(Q || M) with
    M = beta P + (1 - beta) Q, P the teacher's and Q the student's softmax at temperature t; 0 where they agree."""
    cfg = DistillConfig(teacher="t", loss=DistillLoss(loss), beta=beta, temperature=t)
    got = divergence(torch.tensor(STUDENT), torch.tensor(TEACHER), cfg).tolist()
    p, q = softmax(TEACHER[0], t), softmax(STUDENT[0], t)
    m = [beta * a + (1 - beta) * b for a, b in zip(p, q)]
    want = {"forward_kl": kl(p, q), "reverse_kl": kl(q, p), "jsd": beta * kl(p, m) + (1 - beta) * kl(q, m)}[loss]
    assert got == pytest.approx([want, 0.0], abs=1e-6)
    assert got[0] > 0.01


def test_jsd_at_one_half_is_symmetric_and_at_most_log_2():
    cfg = DistillConfig(teacher="t", loss=DistillLoss.jsd, beta=0.5)
    a, b = torch.randn(5, 11) * 4, torch.randn(5, 11) * 4
    assert divergence(a, b, cfg).tolist() == pytest.approx(divergence(b, a, cfg).tolist(), abs=1e-6)
    assert (divergence(a, b, cfg) <= math.log(2) + 1e-6).all()
    far = torch.tensor([[60.0, 0.0]]), torch.tensor([[0.0, 60.0]])
    assert divergence(*far, cfg).item() == pytest.approx(math.log(2), abs=1e-5)


class Frozen:
    """An engine's `frozen` as the torch engine's: eval mode, no gradients."""

    @staticmethod
    def frozen(model):
        return model.eval().requires_grad_(False)


def models():
    """A tiny student, a teacher of the same shape with other weights, the tokenizer and a padded batch: rows of
    different lengths whose first tokens are the prompt (no label)."""
    student, tok = tiny_model()
    teacher = copy.deepcopy(student)
    torch.manual_seed(3)
    for p in teacher.parameters():
        p.data.add_(torch.randn_like(p) * 0.2)
    torch.manual_seed(0)
    ids = torch.randint(3, len(tok), (3, 12))
    mask = torch.ones_like(ids)
    mask[1, 9:], mask[2, 5:] = 0, 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :3] = -100
    return student, teacher, tok, {"input_ids": ids, "attention_mask": mask, "labels": labels}


def by_hand(student, teacher, batch, cfg):
    """The summed divergence over the response tokens from the two models' whole logits, in float64."""
    with torch.no_grad():
        s = student(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1].double()
        t = teacher(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1].double()
    keep = batch["labels"][:, 1:] != -100
    return float(divergence(s[keep], t[keep], cfg).sum())


@pytest.mark.parametrize("loss", list(DistillLoss))
def test_the_chunked_loss_equals_the_whole_logits_one_and_the_hand_sum(loss):
    """logits=chunked (chunks of 5 response tokens: the teacher's hidden states, both logits a chunk at a time) gives
    the loss, the metrics and the student's gradients of the whole-logits path, which is the hand sum."""
    from finetune.rank.head import ChunkedHead
    from finetune.rank.teacher import Teacher

    student, teacher, tok, batch = models()
    cfg = DistillConfig(teacher="t", loss=loss, beta=0.4, temperature=1.5, sft_weight=0.25)
    want = by_hand(student, teacher, batch, cfg)
    taught = Teacher(teacher, len(tok)).place(Frozen)
    full = DISTILL(cfg, taught)
    loss_full, metrics_full = full(student, batch)
    loss_full.backward()
    grads = [p.grad.clone() for p in student.parameters()]
    student.zero_grad()
    assert metrics_full["divergence"].item() == pytest.approx(want, rel=1e-5)
    assert loss_full.item() == pytest.approx(want + 0.25 * metrics_full["nll"].item(), rel=1e-6)
    chunked = DISTILL(cfg, taught, head=ChunkedHead(student, chunk_tokens=5))
    loss_chunked, metrics_chunked = chunked(student, batch)
    loss_chunked.backward()
    assert loss_chunked.item() == pytest.approx(loss_full.item(), rel=1e-5)
    assert {k: v.item() for k, v in metrics_chunked.items()} == pytest.approx({k: v.item() for k, v in metrics_full.items()}, rel=1e-5)
    for a, b in zip(grads, (p.grad for p in student.parameters())):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-5 * float(a.abs().max()))
    assert full.count(batch) == int((batch["labels"][:, 1:] != -100).sum()) == 9 + 6 + 2


def test_a_model_distilled_into_itself_has_zero_divergence_and_no_gradient():
    from finetune.rank.teacher import Teacher

    student, _, tok, batch = models()
    taught = Teacher(copy.deepcopy(student), len(tok)).place(Frozen)
    for loss in DistillLoss:
        out, metrics = DISTILL(DistillConfig(teacher="t", loss=loss), taught)(student, batch)
        out.backward()
        assert metrics["divergence"].item() == pytest.approx(0.0, abs=1e-5)
        assert max(p.grad.abs().max().item() for p in student.parameters()) < 1e-6
        student.zero_grad()


def test_the_logits_are_compared_over_the_tokenizers_vocabulary():
    """A teacher whose output layer is wider than the tokenizer (a family pads it, by other amounts at other sizes):
    the rows past the tokenizer's tokens take no part."""
    from finetune.rank.teacher import Teacher

    student, teacher, tok, batch = models()
    cfg = DistillConfig(teacher="t")
    want = DISTILL(cfg, Teacher(teacher, len(tok)).place(Frozen))(student, batch)[1]["divergence"].item()
    wide = copy.deepcopy(teacher)
    head = wide.lm_head
    wide.lm_head = torch.nn.Linear(head.in_features, head.out_features + 7, bias=False)
    wide.lm_head.weight.data[: head.out_features] = head.weight.data
    wide.lm_head.weight.data[head.out_features:] = 5.0
    got = DISTILL(cfg, Teacher(wide, len(tok)).place(Frozen))(student, batch)[1]["divergence"].item()
    assert got == pytest.approx(want, rel=1e-6)


BASE = ["+recipe=quickstart_sft", "method=distill"]


def test_rules(compose, tmp_path):
    from finetune.config import ASSETS

    teacher = str(ASSETS / "models" / "quickstart_tools_sft")  # the shipped tokenizer's vocabulary, another template
    assert compose([*BASE, f"method.teacher={teacher}"]).method.teacher == teacher
    refusals = [
        ([], "method=distill needs method.teacher: the model to learn from (a model directory, a run directory or a hub id), whose "
             "tokenizer is the student's"),
        ([f"method.teacher={teacher}", "method.beta=0.3"], "method.beta=0.3 has no effect with method.loss=forward_kl (only with jsd): "
                                                           "remove it or change the option"),
        ([f"method.teacher={tmp_path}/nowhere"], f"method.teacher={tmp_path}/nowhere: no such directory: give a model directory, a run "
                                                 "directory or a hub id"),
        ([f"method.teacher={teacher}", "parallelism=tp2", "launcher.nproc_per_node=2"],
         "method=distill with parallelism.tp=2 is not supported: the teacher is placed replicated (DDP) or sharded like the student "
         "(zero=stage3, parallelism=fsdp), not split by layers or heads; use one of those to fit it"),
        ([f"method.teacher={teacher}", "parallelism=cp2", "launcher.nproc_per_node=2"],
         "method=distill with parallelism.cp=2 is not supported: the teacher's forward is not split over context-parallel ranks; use "
         "parallelism.cp=1 (with logits=chunked and checkpointing=full for long rows)"),
        ([f"method.teacher={ASSETS / 'models' / 'tiny_vlm'}"],
         f"method.teacher={ASSETS / 'models' / 'tiny_vlm'}: its tokenizer is not the student's (4 tokens in one only, 107 against 103 in "
         "all; '<|vision_start|>' is 103 in the teacher's and absent in the student's; '<|image_pad|>' is 104 in the teacher's and "
         "absent in the student's; '<|vision_end|>' is 105 in the teacher's and absent in the student's): distillation compares the "
         "two models' distributions token by token, so both need one vocabulary; use a teacher of the student's family"),
        ([f"method.teacher={teacher}", "method.completion_tokens=32"],
         "method.completion_tokens=32 has no effect with method.lmbda=0 (offline: every step learns on the data's responses): remove "
         "it or change the option"),
        ([f"method.teacher={teacher}", "method.lmbda=0.5", "data.packing=true"],
         "data.packing=true with method.lmbda=0.5 is not supported: an on-policy step replaces each sample's response with the "
         "student's, of another length, so rows cannot be packed in advance: set data.packing=false (padding-free micro-batches "
         "still lay the samples end to end)"),
        ([f"method.teacher={teacher}", "method.lmbda=0.5", "data.format=text"],
         "method.lmbda=0.5: on-policy steps sample a response to each row's prompt, and data.format=text rows have none: use "
         "alpaca, chat, sharegpt or completion rows, or method.lmbda=0"),
        ([f"method.teacher={teacher}", "method.lmbda=1.5"], "method.lmbda=1.5 must be in [0, 1]"),
        ([f"method.teacher={teacher}", "method.lmbda=0.5", "method.teacher_topk=20"],
         "method.teacher_topk=20 with method.lmbda=0.5 is not supported: the teacher's top-k is computed once, before training, "
         "and on-policy steps train on responses the student samples then; use method.lmbda=0, or drop method.teacher_topk (the "
         "teacher runs at every step)"),
        ([f"method.teacher={teacher}", "method.teacher_precision=bf16", "zero=stage3", "launcher.nproc_per_node=2"],
         "method.teacher_precision=bf16 with zero=stage3 is not supported: DeepSpeed's engine holds the teacher in its own "
         "precision (bf16 weights under precision=bf16 or bf16_pure); drop method.teacher_precision, or use parallelism=fsdp or "
         "ddp without zero"),
    ]
    for extra, message in refusals:
        with pytest.raises(ConfigError) as e:
            compose([*BASE, *extra])
        assert str(e.value) == message
    with pytest.raises(ConfigError, match=r"^method.beta=1.0 must be in \(0, 1\)$"):
        compose([*BASE, f"method.teacher={teacher}", "method.loss=jsd", "method.beta=1"])


def test_the_planner_counts_the_teacher(compose):
    """Its weights (split like the student's under ZeRO-3), its gathered output layer under logits=chunked where split,
    and its probabilities over the response tokens with whole logits."""
    from finetune.config import ASSETS
    from finetune.planner.peak import plan

    teacher, params = ASSETS / "models" / "quickstart_tools_sft", 420_224  # the quickstart's tiny Llama (its model line)
    one = ["launcher.nproc_per_node=1", "parallelism=single"]
    sft, distill = plan(compose([*BASE[:1], *one])), plan(compose([*BASE, f"method.teacher={teacher}", *one]))
    assert distill.weights - sft.weights == pytest.approx(4 * params, rel=1e-3)
    tokens, vocab = 64 * 16, 103  # data.max_length x micro batch (no data read: the upper bound)
    assert distill.logits - sft.logits == pytest.approx(tokens * vocab * 8, rel=1e-3)
    zero3 = ["zero=stage3", "launcher.nproc_per_node=2", "logits=chunked"]
    split = plan(compose([*BASE, f"method.teacher={teacher}", *zero3])).weights - plan(compose([*BASE[:1], *zero3])).weights
    assert split == pytest.approx(4 * params / 2 + 4 * vocab * 128, rel=1e-3)  # fp32: half the weights, the whole head
    half = plan(compose([*BASE, f"method.teacher={teacher}", *one, "method.teacher_precision=bf16"]))
    assert distill.weights - half.weights == pytest.approx(2 * params, rel=1e-3)  # bf16: 2 bytes a weight, not 4
    table = plan(compose([*BASE, f"method.teacher={teacher}", *one, "method.teacher_topk=20"]))  # no teacher while training
    assert (table.weights, table.logits - sft.logits) == pytest.approx((sft.weights, tokens * 21 * 8), rel=1e-3)
    # on-policy steps (lmbda > 0): rows of prompt + a sampled response, planned as rows 32 tokens wider, and the sampling
    on = plan(compose([*BASE, f"method.teacher={teacher}", *one, "method.lmbda=0.5", "method.completion_tokens=32"]))
    wider = plan(compose([*BASE, f"method.teacher={teacher}", *one, "data.max_length=96"]))
    assert (on.logits, on.activations) == (wider.logits, wider.activations) and on.rollout > 0 == wider.rollout


QUICK = ["+recipe=quickstart_sft", "method=distill", "train.max_steps=12", "optim.warmup_steps=0", "optim.lr=1e-2",
         "train.eval_every=0", "train.exact_match_samples=0", "data.eval_size=32", "data.eval=null", "train.micro_batch_size=4",
         "train.global_batch_size=8"]


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    """A teacher on disk: the quickstart's tiny model with other weights (random init, seed 5)."""
    path = tmp_path_factory.mktemp("teacher") / "model"
    net, tok = tiny_model()
    torch.manual_seed(5)
    for p in net.parameters():
        p.data.add_(torch.randn_like(p) * 0.1)
    net.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def eval_divergence(model_dir, teacher_dir) -> float:
    """Mean forward KL per response token of a saved model to the teacher over the quickstart's first 32 eval rows."""
    from transformers import AutoModelForCausalLM

    from finetune.config import ASSETS, DataConfig
    from finetune.data.batches import collate
    from finetune.data.examples import load_split

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(teacher_dir)
    rows, _, _ = load_split(DataConfig(train=str(ASSETS / "data" / "quickstart" / "eval.jsonl"), eval_size=0, max_length=64), tok, 0)
    batch = collate(rows[:32], tok.pad_token_id)
    models = [AutoModelForCausalLM.from_pretrained(d).eval() for d in (model_dir, teacher_dir)]
    keep = batch["labels"][:, 1:] != -100
    with torch.no_grad():
        s, t = (m(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1][keep] for m in models)
    return float(divergence(s, t, DistillConfig(teacher="t")).mean())


def test_distillation_through_the_cli_moves_the_student_towards_its_teacher(teacher_dir, tmp_path):
    """12 steps from the quickstart's random init (model.init.seed 0) with the teacher above: the logged divergence falls,
    and the final model is nearer the teacher on held-out rows than the initial one, by the same measure."""
    out = run_cli(*QUICK, f"method.teacher={teacher_dir}", "parallelism=single", "launcher.nproc_per_node=1",
                  f"hydra.run.dir={tmp_path / 'run'}", "train.save_hf=false", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    train = [m for m in read_metrics(tmp_path / "run") if m["kind"] == "train"]
    assert train[-1]["divergence"] < 0.8 * train[0]["divergence"], [m["divergence"] for m in train]
    assert all(m["loss"] == pytest.approx(m["divergence"]) for m in train)
    start, tok = tiny_model()
    start.save_pretrained(tmp_path / "start")
    tok.save_pretrained(tmp_path / "start")
    before, after = eval_divergence(tmp_path / "start", teacher_dir), eval_divergence(tmp_path / "run" / "final", teacher_dir)
    print(f"forward KL to the teacher on 32 eval rows: {before:.4f} -> {after:.4f}")
    assert after < 0.9 * before  # measured 0.619 -> 0.513


@pytest.fixture(scope="module")
def start(tmp_path_factory):
    """The student's initial weights on disk: every run starts from them (ZeRO-3 builds a random-init model inside
    zero.Init, which draws other random numbers)."""
    path = tmp_path_factory.mktemp("distill_start") / "model"
    net, tok = tiny_model()
    net.save_pretrained(path)
    tok.save_pretrained(path)
    return ["model=pretrained", f"model.path={path}", "method.loss=jsd", "method.sft_weight=0.5", "train.max_steps=3"]


@pytest.fixture(scope="module")
def one_process(teacher_dir, start, tmp_path_factory):
    run = tmp_path_factory.mktemp("distill_one") / "run"
    train_here([*QUICK, f"method.teacher={teacher_dir}", *start, "parallelism=single", "launcher.nproc_per_node=1"], run)
    return [m for m in read_metrics(run) if m["kind"] == "train"]


@pytest.mark.slow
@pytest.mark.parametrize("layout", [["parallelism=ddp"], ["parallelism=fsdp", "logits=chunked", "logits.chunk_tokens=16"],
                                    ["zero=stage3", "parallelism=ddp", "logits=chunked", "logits.chunk_tokens=16"]],
                         ids=["ddp", "fsdp_chunked", "zero3_chunked"])
def test_two_ranks_follow_one_process(layout, teacher_dir, start, one_process, tmp_path):
    """The teacher replicated (DDP) or sharded like the student (FSDP2, ZeRO-3; its output layer gathered whole once
    for the chunks): the losses and divergences of one process."""
    out = launch_here(*QUICK, f"method.teacher={teacher_dir}", *start, *layout, "launcher.nproc_per_node=2", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    ours = [m for m in read_metrics(tmp_path / "run") if m["kind"] == "train"]
    for key in ("loss", "divergence", "nll"):
        assert [m[key] for m in ours] == pytest.approx([m[key] for m in one_process], rel=1e-4), key


def test_padding_free_rows_give_the_padded_losses(teacher_dir, tmp_path):
    """The student's micro-batches laid end to end (data.padding_free's default): the teacher reads the same rows, each
    sample attended alone (per sample by finetune.rank.varlen, as the student; transformers' block-diagonal mask would
    give the same numbers at a row's square cost), so the losses are the padded batches'."""
    runs = {}
    for free in ("true", "false"):
        train_here([*QUICK, f"method.teacher={teacher_dir}", "train.max_steps=2", f"data.padding_free={free}", "parallelism=single",
                    "launcher.nproc_per_node=1", "data.eval_size=0"], tmp_path / free)
        runs[free] = [m["divergence"] for m in read_metrics(tmp_path / free) if m["kind"] == "train"]
    assert runs["true"] == pytest.approx(runs["false"], rel=1e-5)


@pytest.mark.parametrize("precision", [None, "bf16"])
def test_planned_within_15_percent_of_memtracker(precision, tmp_path):
    """A distillation step with logits=chunked, measured by MemTracker (train.memory_report=categories) against the plan:
    the weights (the student's and the frozen teacher's: measured 24.42 MiB, planned the same; with
    method.teacher_precision=bf16 the teacher's are half: 18.3), the activations (21.05 planned, 21.66 measured) and the
    peak (70.0 planned, 67.6 measured). The shipped tokenizer's 103 tokens keep the logits small here: the chunks'
    saving is in tests/test_logits.py's larger vocabulary."""
    from finetune.planner.records import compare

    shape = ["model.init.hidden_size=256", "model.init.intermediate_size=768", "model.init.num_hidden_layers=4"]
    teacher = tmp_path / "teacher"
    train_here(["+recipe=quickstart_sft", *shape, "train.max_steps=1", "optim.warmup_steps=0", "data.eval=null", "data.eval_size=0",
                "train.exact_match_samples=0", "parallelism=single", "launcher.nproc_per_node=1", "train.save_hf=false"], teacher)
    run = tmp_path / "run"
    train_here(["+recipe=quickstart_sft", "method=distill", f"method.teacher={teacher}", *shape, "train.micro_batch_size=8",
                "train.global_batch_size=8", "train.max_steps=2", "data.eval=null", "data.eval_size=0", "train.exact_match_samples=0",
                "train.memory_report=categories", "data.padding_free=false", "logits=chunked", "optim.warmup_steps=0",
                "parallelism=single", "launcher.nproc_per_node=1", *([f"method.teacher_precision={precision}"] if precision else [])], run)
    rows = {name: (planned, measured) for name, planned, measured in compare(run)}
    print(rows)
    student = rows["gradients"][1]  # fp32, one per trainable weight: the student's weights' size
    assert rows["weights"][0] == pytest.approx(rows["weights"][1], rel=0.01)
    assert rows["weights"][1] == pytest.approx(student * (1.5 if precision else 2), rel=0.01)
    for name in ("activations", "peak"):
        assert rows[name][0] == pytest.approx(rows[name][1], rel=0.15), name


def test_lora_on_the_student_and_a_resume_give_the_uninterrupted_losses(teacher_dir, tmp_path):
    """peft=lora on the student (the teacher stays whole and frozen); 4 steps saving at step 2, then a run resumed from
    that checkpoint: its steps 3 and 4 are the uninterrupted run's (the teacher is loaded again from method.teacher, not
    kept in the checkpoint)."""
    common = [*QUICK, f"method.teacher={teacher_dir}", "peft=lora", "train.max_steps=4", "train.save_every=2", "parallelism=single",
              "launcher.nproc_per_node=1", "data.eval_size=0"]
    train_here(common, tmp_path / "full")
    train_here([*common, f"train.resume={tmp_path / 'full/checkpoints/step_2'}"], tmp_path / "resumed")
    full, resumed = ([m for m in read_metrics(tmp_path / d) if m["kind"] == "train"] for d in ("full", "resumed"))
    assert [m["step"] for m in resumed] == [3, 4]
    assert [m["divergence"] for m in resumed] == pytest.approx([m["divergence"] for m in full[2:]], rel=1e-6)
    assert (tmp_path / "full/final/adapter_config.json").is_file()


def quickstart_rows(tok, n):
    from finetune.config import ASSETS, DataConfig
    from finetune.data.examples import load_split

    rows, _, _ = load_split(DataConfig(train=str(ASSETS / "data" / "quickstart" / "eval.jsonl"), eval_size=0, max_length=64), tok, 0)
    return rows[:n]


def test_an_on_policy_step_trains_on_the_students_own_samples():
    """method.lmbda: an on-policy step keeps each row's prompt and puts after it what the student samples (the online
    methods' sampler, seeded by (seed, step, rank, micro-batch)), labelled; padded rows stay padded and rows laid end to
    end stay so; the loss is the divergence on those tokens; an offline step hands the data's micro-batches on as they are."""
    from finetune.data.batches import collate
    from finetune.methods.distill import GKD, Draw, on_policy, prompts_of
    from finetune.methods.sampling import sample
    from finetune.rank.teacher import Teacher

    student, teacher, tok, _ = models()
    rows = quickstart_rows(tok, 6)
    prompts = [r.input_ids[: r.prompt_len] for r in rows]
    cfg = DistillConfig(teacher="t", lmbda=1.0, completion_tokens=8)
    objective, engine = GKD(cfg, Teacher(teacher, len(tok)).place(Frozen)), GenerationEngine(student)
    for flat in (False, True):
        data = [collate(rows[:3], tok.pad_token_id, flat=flat), collate(rows[3:], tok.pad_token_id, flat=flat)]
        assert prompts_of(data[0]) + prompts_of(data[1]) == prompts
        out, seconds = objective.rollout(engine, data, step=4, tokenizer=tok, seed=0)
        assert seconds > 0 and len(out) == 2
        for k, batch in enumerate(out):
            mine = prompts[3 * k : 3 * k + 3]
            want = sample(engine, mine, Draw(8, 1.0), tok, seed=(0, 4, 0, k))
            examples = [(p + c, [-100] * len(p) + c) for p, c in zip(mine, want)]
            if flat:
                assert batch["input_ids"][0].tolist() == [t for ids, _ in examples for t in ids] and "attention_mask" not in batch
                assert batch["labels"][0].tolist() == [t for _, labels in examples for t in labels]  # a sample's first: a prompt's
            else:
                for r, (ids, labels) in enumerate(examples):
                    assert batch["input_ids"][r, : len(ids)].tolist() == ids and batch["labels"][r, : len(ids)].tolist() == labels
                    assert (batch["labels"][r, len(ids):] == -100).all()
            responses = [[t for t in r.labels if t != -100] for r in rows[3 * k : 3 * k + 3]]
            assert want != responses  # the student's tokens (a random init), not the data's
            loss, metrics = objective(student, batch)
            assert metrics["on_policy"].item() == objective.count(batch) == sum(len(c) for c in want)
            if not flat:
                assert metrics["divergence"].item() == pytest.approx(by_hand(student, teacher, batch, cfg), rel=1e-5)
    mixed = DistillConfig(teacher="t", lmbda=0.3)
    steps = [on_policy(0.3, 0, s) for s in range(1, 2001)]
    assert 0.27 < sum(steps) / len(steps) < 0.33 and steps == [on_policy(0.3, 0, s) for s in range(1, 2001)]
    offline = steps.index(False) + 1
    data = [collate(rows[:3], tok.pad_token_id)]
    assert GKD(mixed, objective.teacher).rollout(engine, data, step=offline, tokenizer=tok, seed=0) == (data, 0.0)
    assert GKD(mixed, objective.teacher)(student, data[0])[1]["on_policy"].item() == 0.0


ON = [*QUICK, "method.lmbda=0.5", "method.completion_tokens=12", "parallelism=single", "launcher.nproc_per_node=1", "data.eval_size=0",
      "train.max_steps=6", "train.save_every=3"]


def test_on_policy_steps_through_the_cli_and_a_resume(teacher_dir, tmp_path):
    """method.lmbda=0.5: the steps drawn on-policy (from train.seed and the step) log on_policy 1 and their generation
    time; the others 0 and none. A run resumed at step 3 samples the same responses: the uninterrupted divergences."""
    from finetune.methods.distill import on_policy

    train_here([*ON, f"method.teacher={teacher_dir}"], tmp_path / "full")
    train_here([*ON, f"method.teacher={teacher_dir}", f"train.resume={tmp_path / 'full/checkpoints/step_3'}"], tmp_path / "resumed")
    full, resumed = ([m for m in read_metrics(tmp_path / d) if m["kind"] == "train"] for d in ("full", "resumed"))
    drawn = [on_policy(0.5, 42, s) for s in range(1, 7)]  # train.seed's default
    assert any(drawn) and not all(drawn)
    assert [m["on_policy"] for m in full] == [float(d) for d in drawn]
    assert [m["generation_s"] > 0 for m in full] == drawn
    assert [m["step"] for m in resumed] == [4, 5, 6]
    assert [m["divergence"] for m in resumed] == pytest.approx([m["divergence"] for m in full[3:]], rel=1e-6)


@pytest.mark.slow
def test_on_policy_under_zero3_with_chunked_logits_follows_ddp(teacher_dir, start, tmp_path):
    """Two ranks sampling their rows' responses each step (lmbda=1): under ZeRO-3 (generation in lockstep, the
    teacher sharded, logits chunked) the losses of DDP, where every rank holds both models whole."""
    runs = {}
    for name, layout in (("ddp", ["parallelism=ddp"]), ("zero3", ["zero=stage3", "parallelism=ddp", "logits=chunked", "logits.chunk_tokens=16"])):
        out = launch_here(*QUICK, f"method.teacher={teacher_dir}", *start, *layout, "method.lmbda=1", "method.completion_tokens=12",
                          "launcher.nproc_per_node=2", "data.eval_size=0", f"hydra.run.dir={tmp_path / name}", cwd=tmp_path)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        runs[name] = [m for m in read_metrics(tmp_path / name) if m["kind"] == "train"]
    assert [m["on_policy"] for m in runs["zero3"]] == [1.0] * 3
    for key in ("loss", "divergence", "nll"):
        assert [m[key] for m in runs["zero3"]] == pytest.approx([m[key] for m in runs["ddp"]], rel=1e-4), key


@pytest.mark.parametrize("loss", list(DistillLoss))
def test_the_top_k_divergence_is_over_k_tokens_and_a_tail_bucket(loss):
    """method.teacher_topk: both distributions coarsened to the teacher's top K tokens and one bucket for the rest,
    at the temperature; the divergence of those K + 1 outcomes by hand; with K = V - 1 (the tail is one token) the
    whole vocabulary's divergence; and forward KL over buckets never above the whole one (coarsening loses information)."""
    from finetune.methods.distill import buckets, divergence_of

    cfg = DistillConfig(teacher="t", loss=loss, beta=0.3, temperature=1.5)
    torch.manual_seed(0)
    student, teacher = torch.randn(6, 11) * 3, torch.randn(6, 11) * 3
    for k in (3, 10):
        top = teacher.topk(k, -1).indices
        got = divergence_of(buckets(student, top, 1.5), buckets(teacher, top, 1.5), cfg)
        for row in range(6):
            p, q = softmax(teacher[row].tolist(), 1.5), softmax(student[row].tolist(), 1.5)
            ids = top[row].tolist()
            pb = [p[i] for i in ids] + [sum(p) - sum(p[i] for i in ids)]
            qb = [q[i] for i in ids] + [sum(q) - sum(q[i] for i in ids)]
            m = [0.3 * a + 0.7 * b for a, b in zip(pb, qb)]
            want = {"forward_kl": kl(pb, qb), "reverse_kl": kl(qb, pb), "jsd": 0.3 * kl(pb, m) + 0.7 * kl(qb, m)}[loss.value]
            assert got[row].item() == pytest.approx(want, rel=1e-4, abs=1e-6)
        if k == 10:
            assert got.tolist() == pytest.approx(divergence(student, teacher, cfg).tolist(), rel=1e-4, abs=1e-6)
        elif loss == DistillLoss.forward_kl:
            assert (got <= divergence(student, teacher, cfg) + 1e-6).all()


TOPK = [*QUICK, "train.max_steps=3", "parallelism=single", "launcher.nproc_per_node=1", "data.eval_size=8"]


def test_a_top_k_table_of_every_token_but_one_gives_the_live_teachers_losses(teacher_dir, tmp_path, capsys):
    """The teacher's table with K = 102 of the 103 tokens (the tail bucket one token: the whole distribution) gives the
    divergences of the live teacher, padded or padding-free, logits full or chunked; the table is computed by the first
    run and read by the next (the same data and teacher), which loads no teacher: MemTracker measures the student's
    weights alone (the live teacher's run holds both)."""
    from finetune.planner.records import compare

    live = tmp_path / "live"
    train_here([*TOPK, f"method.teacher={teacher_dir}"], live)
    want = [m["divergence"] for m in read_metrics(live) if m["kind"] == "train"]
    cache = f"data.cache_dir={tmp_path / 'cache'}"
    for name, extra in (("first", []), ("chunked", ["logits=chunked", "logits.chunk_tokens=16", "data.padding_free=false",
                                                   "train.memory_report=categories"])):
        train_here([*TOPK, f"method.teacher={teacher_dir}", "method.teacher_topk=102", cache, *extra], tmp_path / name)
        out = capsys.readouterr().out
        said = "computed in" if name == "first" else "read from"
        assert "teacher top-102: " in out and said in out.split("teacher top-102: ")[1].splitlines()[0], out[-2000:]
        got = [m["divergence"] for m in read_metrics(tmp_path / name) if m["kind"] == "train"]
        assert got == pytest.approx(want, rel=1e-4), name
    rows = {name: (planned, measured) for name, planned, measured in compare(tmp_path / "chunked")}
    assert rows["weights"][1] == pytest.approx(rows["gradients"][1], rel=0.01)  # the student's alone: no teacher held
    assert rows["weights"][0] == pytest.approx(rows["weights"][1], rel=0.01)
    assert len(list((tmp_path / "cache" / "teacher_topk").glob("*.pt"))) == 1


def test_a_sample_missing_from_the_table_is_one_line():
    from finetune.rank.topk import TopK, key

    ids, labels = torch.tensor([[5, 6, 7, 8]]), torch.tensor([[-100, -100, 7, 8]])
    table = TopK({key([5, 6, 7, 8]): (0, 2)}, torch.zeros(2, 3, dtype=torch.int32), torch.zeros(2, 4), 103)
    got = table.lookup({"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids)})
    assert got[0].shape == (2, 3) and got[0].dtype == torch.int64 and got[1].shape == (2, 4)
    with pytest.raises(RuntimeError, match=r"^method.teacher_topk: a sample of 4 tokens is not in the teacher's table \(the data, "
                                           r"its tokenization or data.max_length changed since it was computed\?\)$"):
        table.lookup({"input_ids": ids + 1, "labels": labels, "attention_mask": torch.ones_like(ids)})


@pytest.mark.slow
def test_a_top_k_table_computed_by_two_zero3_ranks_is_one_processs(teacher_dir, tmp_path):
    """Under ZeRO-3 each rank scores its share of the samples with the sharded teacher (as many forwards on each), and
    the shares gathered make one table: its losses are those of the table one process computes."""
    cache = f"data.cache_dir={tmp_path / 'cache'}"
    one = tmp_path / "one"
    train_here([*TOPK, f"method.teacher={teacher_dir}", "method.teacher_topk=5", f"data.cache_dir={tmp_path / 'one_cache'}"], one)
    out = launch_here(*QUICK, "train.max_steps=3", "data.eval_size=8", f"method.teacher={teacher_dir}", "method.teacher_topk=5",
                      cache, "zero=stage3", "parallelism=ddp", "launcher.nproc_per_node=2", f"hydra.run.dir={tmp_path / 'zero3'}",
                      cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    a, b = (torch.load(next((tmp_path / c / "teacher_topk").glob("*.pt"))) for c in ("one_cache", "cache"))
    order = [{int(k): (int(o), int(n)) for k, o, n in t["index"]} for t in (a, b)]
    assert order[0].keys() == order[1].keys() and len(order[0]) > 3900  # the quickstart's 4,000 rows (a few repeat)
    for k, (o, n) in order[0].items():
        p, m = order[1][k]
        assert torch.equal(a["ids"][o : o + n], b["ids"][p : p + m])
        assert torch.allclose(a["logps"][o : o + n], b["logps"][p : p + m], atol=1e-5)
