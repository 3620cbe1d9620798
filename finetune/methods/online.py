"""What the online methods share (method=grpo, method=rloo: finetune/methods/grpo.py, rloo.py): settings, rules, and the
rollout that turns a step's prompts into the rows it trains on.

Each step, for every prompt q of the batch (a row of any SFT form: its conversation without the last response) the
current policy samples G = `method.generations` completions o_1..o_G (`method.temperature`, `method.top_p`, at most
`method.completion_tokens` tokens, seeded by (train.seed, step, rank, micro-batch): a resumed run samples the same ones)
through the engine (`generation_model`, synced across ranks where parameters are gathered collectively: FSDP2, ZeRO-3),
or through a vLLM engine on each rank with method.vllm (finetune.methods.vllm_rollout). The rewards
(finetune.methods.rewards) score each completion, r_i = sum_k w_k R_k(q, o_i); the method turns a group's rewards into
advantages (GRPO: their z-score; RLOO: each minus the mean of the others) and its loss into a gradient.

Dynamic sampling (`method.dynamic_sampling`: DAPO, Yu et al. 2025, arXiv:2503.14476, section 3.2): a group whose
rewards are all equal has advantage 0 everywhere and so no gradient (only its share of the normaliser). Such groups are
dropped and the step samples again, from prompts drawn anew from the dataset (`TrainBatches.refill`, seeded by
(train.seed, step, round): a resumed run draws the same), until every rank holds as many groups with distinct rewards
as the step had prompts, or `method.sampling_rounds` rounds are spent; then the batch is filled with equal groups (as
without the option: the metric `equal_trained` says how much of it). Every rank runs the same rounds (one collective
per round), so layouts that generate in lockstep (FSDP2, ZeRO-3) stay in step. Metrics: `equal_groups` (of the groups
sampled, the fraction with equal rewards: logged always, it is what the option removes), `sampling_rounds`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Callable

from finetune.config import (NAMES, POSITIVE, SOME_NAMES, TEXT, Accepts, Config, ConfigError, DataConfig, DataFormat, Logits,
                             MethodConfig, Reference, at_least, checked, in_range, unused)
from finetune.data.batches import on_grid
from finetune.data.images import SHOWN, pictures_of
from finetune.data.tokenize import IGNORE, Encoded, Example
from finetune.methods.base import CAUSAL_LM, Output, Sampling
from finetune.methods.collectives import world_max
from finetune.methods.sampling import ends, sample, spoken
from finetune.methods.sft import METHOD as SFT_METHOD

if TYPE_CHECKING:
    import torch


@dataclass
class OnlineConfig(MethodConfig):
    """The keys every online method has: what is sampled, how it is scored, and by what."""

    beta: float = checked(at_least(0), 0.0)
    """The weight of the KL to the reference; 0: no KL term and no reference model (TRL's default since DAPO/Dr. GRPO)."""
    reference: Reference = Reference.precomputed
    """With beta > 0, where the reference log-probs come from: live (a frozen copy of the initial model) or
    adapter_disabled (with peft); precomputed cannot score completions sampled while training."""
    generations: int = checked(at_least(2), 8)
    """Completions sampled per prompt (the group G)."""
    completion_tokens: int = checked(POSITIVE, 64)
    """The most tokens a sampled completion has (generation stops at the EOS token or here)."""
    temperature: float = checked(POSITIVE, 1.0)
    """The sampling temperature of the completions."""
    top_p: float = checked(in_range(0, 1), 1.0)
    """Nucleus sampling's probability mass (1: the whole distribution)."""
    mask_truncated_completions: bool = False
    """Completions cut at completion_tokens before their EOS carry no loss (DAPO): a cut answer is not judged."""
    overlong_buffer: int | None = checked(POSITIVE, None)
    """The `overlong` reward's soft zone: a completion longer than completion_tokens - overlong_buffer tokens loses up to 1
    linearly, -1 at the limit (DAPO's soft overlong punishment)."""
    dynamic_sampling: bool = False
    """Drop the groups whose rewards are all equal (no gradient) and sample again from prompts drawn anew, until each rank
    has as many groups with distinct rewards as prompts, or sampling_rounds are spent (DAPO's dynamic sampling)."""
    sampling_rounds: int = checked(at_least(2), 4)
    """With dynamic_sampling: the most rounds of sampling in a step (DAPO's max_num_gen_batches); short after them, the
    batch is filled with equal groups (the metric equal_trained)."""
    tools: list[str] = checked(NAMES, factory=list)
    """Functions `package.module:function` the policy may call while it samples (each by its own name, as the rows'
    `tools` schemas offer them): a call's result comes back as a tool turn and sampling goes on (finetune.methods.tool_calls)."""
    max_turns: int = checked(POSITIVE, 1)
    """With tools: the most calls a completion makes, each followed by its result and more sampling."""
    tool_timeout: float = checked(POSITIVE, 10.0)
    """With tools: the seconds a call may take; past them its answer is an error."""
    rewards: list[str] = checked(SOME_NAMES, factory=lambda: ["exact_match"])
    """The reward functions, summed with `reward_weights`: built-in exact_match (1 when the completion equals the row's
    response, stripped), similarity (partial credit: difflib's matched-character ratio with the response), format (1
    when the completion matches `format_pattern`), length (minus the completion's tokens over completion_tokens), overlong
    (0, then down to -1 over the last `overlong_buffer` tokens before completion_tokens: DAPO's), or a
    Python function `package.module:function` (finetune.methods.rewards says how it is called), or `reward:PATH`: a
    reward model this project trained (method=reward), scoring prompt + completion."""
    reward_weights: list[float] | None = checked(Accepts("a list of numbers", lambda v: len(v) > 0, ("[]",)), None)
    """One weight per entry of `rewards` (null: 1 each)."""
    format_pattern: str | None = checked(TEXT, None)
    """The regular expression the `format` reward matches each whole completion against (Python's re.fullmatch, DOTALL)."""
    vllm: bool = False
    """Sample the completions with vLLM (`pip install vllm`) instead of transformers' generate: an engine on each rank
    beside training (colocated), the policy's weights (gathered, any adapter merged in) loaded into it before each
    rollout."""
    vllm_memory: float = checked(in_range(0.05, 0.95), 0.3)
    """With vllm: the fraction of the GPU's memory vLLM takes for its weights and KV cache (its gpu_memory_utilization);
    training gets the rest."""
    vllm_servers: list[str] | None = checked(Accepts("a list of HOST:PORT", lambda v: len(v) > 0 and all(
        a.rpartition(":")[0] != "" and a.rpartition(":")[2].isdigit() for a in v), ("[localhost]", "[]")), None)
    """With vllm: sample through the vLLM engine of a `python -m finetune.vllm` at each HOST:PORT, on devices of
    its own (TRL's server mode), instead of one beside training on each rank; the policy's weights are pushed to it before
    each rollout (finetune.methods.vllm_rollout). With N servers rank r asks server r mod N, and rank k < N pushes to
    server k. vLLM need not be installed where training runs."""


class OnlineMethod:
    """What the records of the online methods share (finetune.methods.base.Method); a subclass names itself, its config
    and its objective."""

    name: str
    forms = (DataFormat.alpaca, DataFormat.chat, DataFormat.sharegpt, DataFormat.completion)
    unit = "prompt"
    columns = ("",)
    rows_per_example = 1  # x method.generations completions, each a row with gradients (`sampling`)
    no_grad_rows = 0
    scalars = ()
    images = None  # its prompts' images: shown to the sampler, and to the policy with each completion
    attached = False
    model_class = CAUSAL_LM

    @property
    def unpacked(self) -> str:
        return f"method={self.name} samples each prompt's completions as rows of their own"

    padded = None  # a rollout's completions laid end to end in one row (Online.flat): data.padding_free's default

    @property
    def split_tokens(self) -> str:
        return (f"the {self.name.upper()} loss weighs each completion's tokens together, and each rank would hold a slice of them; "
                "use parallelism.cp=1 (with checkpointing=full for long completions)")

    def check_row(self, row: dict[str, Any], data: DataConfig, where: str) -> None:
        SFT_METHOD.check_row(row, data, where)

    def encode(self, row: dict[str, Any], where: str, tokenizer: Any, data: DataConfig, chat: bool) -> Encoded:
        return SFT_METHOD.encode(row, where, tokenizer, data, chat)

    def join(self, rows: list[Example], scalars: dict[str, float]) -> Example:
        return rows[0]

    def settle(self, examples: list[Any], data: DataConfig, key: str) -> list[Any]:
        return examples

    def sampling(self, cfg: OnlineConfig) -> Sampling:
        overlapped = bool(getattr(cfg, "async_generation", False))  # GRPO's option (RLOO has none)
        sampler = ("vllm_server" if cfg.vllm and cfg.vllm_servers else "vllm" if cfg.vllm else "background" if overlapped else "generate")
        return Sampling(cfg.generations, cfg.completion_tokens, sampler, cfg.vllm_memory if sampler == "vllm" else 0.0,
                        1 + cfg.max_turns if cfg.tools else 1, tuple(cfg.vllm_servers or ()) if cfg.vllm else (), copy=overlapped,
                        completion_logits=True)

    def teacher(self, cfg: MethodConfig) -> None:
        return None

    def make_first(self, cfg: MethodConfig, make: Any) -> None:
        return None

    def reference(self, cfg: OnlineConfig) -> Reference | None:
        return cfg.reference if cfg.beta > 0 else None

    def validate(self, cfg: Config) -> None:
        """The rules every online method has (a subclass adds its own)."""
        from finetune.methods import rewards

        m, name = cfg.method, f"method={self.name}"
        if m.beta == 0:
            unused(m, "method", tuple(f.name for f in fields(m) if f.name != "reference"),
                   f"with {name} and method.beta=0 (no KL term, no reference)")
        elif m.reference == Reference.precomputed:
            raise ConfigError(f"method.reference=precomputed cannot score {self.name.upper()}'s completions, which are sampled while "
                              "training: use method.reference=live (or adapter_disabled with peft), or method.beta=0 (no KL term)")
        if not m.dynamic_sampling:
            unused(m, "method", tuple(f.name for f in fields(m) if f.name != "sampling_rounds"),
                   "without method.dynamic_sampling=true (the rounds are its refills)")
        elif cfg.data.streaming:
            raise ConfigError("method.dynamic_sampling=true with data.streaming=true is not supported: the refills draw prompts at "
                              "random from the whole dataset, which a stream does not hold; use data.streaming=false")
        if m.tools:
            tool_rules(cfg, name)
        else:
            unused(m, "method", tuple(f.name for f in fields(m) if f.name not in ("max_turns", "tool_timeout")),
                   "without method.tools (the functions the policy may call)")
        if cfg.data.format == DataFormat.text:
            raise ConfigError(f"{name} samples a response to each row's prompt, and data.format=text rows have none: use alpaca, "
                              "chat, sharegpt or completion rows")
        if cfg.parallelism.pp > 1:
            raise ConfigError(f"{name} with parallelism.pp={cfg.parallelism.pp} is not supported: pipeline stages cannot "
                              "generate the completions (no rank holds the whole model); use fsdp, zero or tp")
        if ("overlong" in m.rewards) != (m.overlong_buffer is not None):
            raise ConfigError("method.rewards has overlong but method.overlong_buffer is not set: the tokens before "
                              "completion_tokens where the penalty starts (DAPO: a quarter of it), e.g. "
                              f"method.overlong_buffer={max(1, m.completion_tokens // 4)}" if m.overlong_buffer is None else
                              f"method.overlong_buffer={m.overlong_buffer} has no effect without the overlong reward: add overlong "
                              "to method.rewards or remove it")
        if m.overlong_buffer is not None and m.overlong_buffer > m.completion_tokens:
            raise ConfigError(f"method.overlong_buffer={m.overlong_buffer} is longer than method.completion_tokens="
                              f"{m.completion_tokens}: the soft zone ends at the limit; use at most {m.completion_tokens}")
        if cfg.logits.name == Logits.chunked:
            raise ConfigError(f"logits=chunked with {name} is not supported: the {self.name.upper()} loss needs each token's log-prob, which "
                              "the chunked head reduces per row; use logits=full")
        if m.vllm:
            from finetune.disk import local_vision

            if local_vision(cfg.model) is not None:
                raise ConfigError(f"method.vllm=true with model.path={cfg.model.path}, a vision-language model: the vLLM sampler "
                                  "is given the prompts' tokens, not their images: set method.vllm=false (transformers' "
                                  "generate samples from both)")
            from finetune.methods.vllm_rollout import vllm_rules

            vllm_rules(cfg)
        else:
            for key, default, what in (("vllm_memory", OnlineConfig().vllm_memory, "the share of the GPU a colocated vLLM takes"),
                                       ("vllm_servers", None, "the vLLM servers that sample")):
                value = getattr(m, key)
                if value != default:
                    shown = f"[{','.join(value)}]" if isinstance(value, list) else f"{value:g}"
                    raise ConfigError(f"method.{key}={shown} is set but method.vllm=false: it is {what}; set "
                                      "method.vllm=true or drop it")
        rewards.resolve(m)


def tool_rules(cfg: Config, name: str) -> None:
    """method.tools: functions that import, on a layout and sampler the multi-turn rollout runs on."""
    from finetune.disk import local_vision
    from finetune.methods import tool_calls

    tool_calls.resolve(cfg.method.tools)
    why = ("method.vllm=true (the vLLM sampler is given whole completions, not turns)" if cfg.method.vllm else
           "this layout (each rank's completions call tools a different number of times, and sharded layouts sample in "
           "lockstep): use parallelism=single or ddp" if not whole_model(cfg) else
           "a vision-language model (its continuations would need the prompts' images again; not built)"
           if local_vision(cfg.model) is not None else None)
    if why is not None:
        raise ConfigError(f"method.tools with {name} is not supported with {why}")


def whole_model(cfg: Config) -> bool:
    """Each rank holds the whole model and trains it alone between steps' collectives: single process or DDP, no ZeRO
    (the torch engine's layouts)."""
    from finetune.config import Strategy

    p = cfg.parallelism
    return p.strategy in (Strategy.single, Strategy.ddp) and p.tp == p.pp == p.cp == 1 and not cfg.zero.enabled


@dataclass
class Group:
    """A prompt's G sampled completions and their rewards."""

    prompt: list[int]
    answer: list[int]
    images: tuple[Any, ...]
    completions: list[list[int]]
    rewards: list[float]  # the weighted sum per completion
    each: dict[str, list[float]]  # each reward's own values
    owned: list[list[bool]] | None = None  # per completion token: the policy's (labelled) or a tool turn's (context)
    ended: list[bool] | None = None  # per completion: it ended its turn (None: where it holds the EOS token)
    calls: list[int] | None = None  # per completion: the tools it called (method.tools)
    equal: bool = field(init=False)  # every reward the same: advantage 0, no gradient

    def __post_init__(self) -> None:
        self.equal = max(self.rewards) == min(self.rewards)


class Online:
    """An online method's objective: its rollout (this class) and its loss (a subclass: `advantages`, `__call__`)."""

    updates = 1  # optimizer steps per rollout (GRPO's method.updates_per_rollout)

    def __init__(self, cfg: OnlineConfig, reference: Any = None, router: Any = None) -> None:
        self.cfg, self.reference, self.router = cfg, reference, router
        self.rewards: list[Any] | None = None  # resolved (reward models loaded) at the first rollout
        self.rollout_every = self.updates  # the loop stops on a signal only after a rollout's last update
        self.buffer: list[dict[str, torch.Tensor]] = []  # the rollout the next updates train on
        self.vllm: Any = None  # method.vllm: the rank's VllmSampler, built at the first rollout
        self.prompt_tokens: int | None = None  # the longest prompt (data.max_length, set by finetune.train): vLLM's context
        self.flat = False  # the rollout's completions end to end in one row (data.padding_free, set by finetune.train)
        self.overlapped = bool(getattr(cfg, "async_generation", False))  # the next rollout sampled while this step trains
        self.background: Any = None  # then its finetune.methods.background.Background, built at the first rollout
        names = [f"rewards/{name}" for name in cfg.rewards]
        sampled = (("equal_groups",) + (("equal_trained", "sampling_rounds") if cfg.dynamic_sampling else ())
                   + (("sampling_s",) if self.overlapped else ()) + (("tool_calls",) if cfg.tools else ()))
        self.functions: dict[str, Any] | None = None  # method.tools, resolved at the first rollout
        self.metrics = ("reward", "reward_std", *names, "kl", "completion_tokens", *sampled) + ((router.metric,) if router else ())
        self.eval_metrics = (router.metric,) if router else ()  # evaluation scores the rows' own responses: no rollout

    def advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        """[prompts, G] rewards -> their advantages."""
        raise NotImplementedError

    def finished(self, engine: Any, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A scored rollout batch, completed on the rank before it trains (GRPO: the sampler's log-probs; RLOO: the KL in
        the reward)."""
        return batch

    def rescaled(self, engine: Any, batches: list[dict[str, torch.Tensor]]) -> None:
        """The rank's whole rollout, once made (GRPO's scale_rewards=batch divides by the global batch's std)."""

    def count(self, batch: dict[str, torch.Tensor]) -> int:
        """Completions in a rollout batch (rows with labels in an evaluation batch): the loop divides the global batch's
        summed loss by their sum."""
        return completions(batch)

    def metric_count(self, batch: dict[str, torch.Tensor]) -> int:
        """What the metrics (rewards, KL) are averaged over: completions."""
        return completions(batch)

    def loss(self, logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> Output:
        raise NotImplementedError(f"method={self.cfg.name} does not run under pipeline parallel (refused before launch)")

    def rows_loss(self, logps: torch.Tensor, batch: dict[str, torch.Tensor]) -> Output:
        raise NotImplementedError(f"method={self.cfg.name} does not run with logits=chunked (refused before launch)")

    def rollout(self, engine: Any, micro_batches: list[dict[str, torch.Tensor]], *, step: int, tokenizer: Any, seed: int,
                refill: Callable[[int], list[dict[str, torch.Tensor]]] | None = None,
                ahead: Callable[[], list[dict[str, torch.Tensor]]] | None = None) -> tuple[list[dict[str, torch.Tensor]], float]:
        """Each micro-batch of prompts -> a batch of its G completions per prompt, with their advantages and rewards
        (columns `sum_<metric>`, summed by the loss into its metrics); and the seconds this rank spent on it here.
        `refill(round)`: micro-batches of prompts drawn anew (dynamic sampling). `ahead()`: the next step's micro-batches
        (method.async_generation samples them in the background while this step trains; None at the last step). With
        mu = `updates` > 1 the first step of every mu samples; the next mu - 1 steps train on the same completions,
        their prompts unread."""
        from finetune.methods import rewards

        mu = self.updates
        if (step - 1) % mu and self.buffer:
            return self.buffer, 0.0
        if (step - 1) % mu:
            raise RuntimeError(f"step {step} is inside a rollout of method.updates_per_rollout={mu} steps, whose completions are gone "
                               "(a checkpoint falls between rollouts: train.save_every is a multiple of it)")
        if self.rewards is None:
            self.rewards = rewards.resolve(self.cfg, load_models=True)
        tic = time.perf_counter()
        if self.cfg.vllm and self.vllm is None:
            from finetune.methods import vllm_rollout

            self.vllm = (vllm_rollout.ServedSampler(list(self.cfg.vllm_servers), engine, tokenizer, self.cfg, prompt_tokens=self.prompt_tokens)
                         if self.cfg.vllm_servers else vllm_rollout.VllmSampler(engine, tokenizer, self.cfg, prompt_tokens=self.prompt_tokens))
        if not self.overlapped:
            if self.vllm is not None:
                self.vllm.sync(engine)
            out = self.made(engine, micro_batches, step=step, tokenizer=tokenizer, seed=seed, refill=refill)
        else:
            bg = self.started(engine)
            out = bg.take(step)
            if out is None:  # the first step (or one resumed without a rollout saved ahead): sampled now, by the copy
                self.refreshed(engine)
                bg.submit(step, lambda sampler: self.made(sampler, micro_batches, step=step, tokenizer=tokenizer, seed=seed))
                out = bg.take(step)
            if ahead is not None and bg.lag:  # the next step's, sampled by the policy as it is now while this step trains
                upcoming = ahead()
                self.refreshed(engine)
                bg.submit(step + 1, lambda sampler: self.made(sampler, upcoming, step=step + 1, tokenizer=tokenizer, seed=seed))
        self.rescaled(engine, out)
        self.buffer = out if mu > 1 else []
        return out, time.perf_counter() - tic

    def refreshed(self, engine: Any) -> None:
        """The background sampler's copy (which scores what is sampled) and a vLLM server's engine (which samples it, where
        one does) given the policy as it is now: the thread that used them last has been waited for."""
        self.background.sampler.refresh()
        if self.vllm is not None:
            self.vllm.sync(engine)

    def started(self, engine: Any) -> Any:
        if self.background is None:
            from finetune.methods.background import Background

            self.background = Background(engine)
        return self.background

    def save_ahead(self, directory: Any, rank: int) -> None:
        """A checkpoint's: the rollout sampled ahead for the next step (method.async_generation), written beside it."""
        if self.background is not None:
            self.background.save(directory, rank)

    def restore_ahead(self, engine: Any, directory: Any, rank: int) -> None:
        """A resumed run's: the rollout its checkpoint kept for the next step."""
        if self.overlapped:
            self.started(engine).load(directory, rank)

    def close(self) -> None:
        if self.background is not None:
            self.background.close()
        if self.vllm is not None:
            self.vllm.close()

    def made(self, engine: Any, micro_batches: list[dict[str, torch.Tensor]], *, step: int, tokenizer: Any, seed: int,
             refill: Callable[[int], list[dict[str, torch.Tensor]]] | None = None) -> list[dict[str, torch.Tensor]]:
        """The rollout of `micro_batches` sampled through `engine` (the policy's, or the background sampler's copy)."""
        tic = time.perf_counter()
        sizes = [int(mb["input_ids"].shape[0]) for mb in micro_batches]  # prompts: a row each (never packed: `unpacked`)
        groups: list[Group] = []
        for k, mb in enumerate(micro_batches):
            groups += self.sampled(engine, mb, tokenizer, seed=(seed, step, engine.dp_rank, k))
        sampling = time.perf_counter() - tic
        wanted, rounds, equal, sampled = sum(sizes), 1, sum(g.equal for g in groups), len(groups)
        if self.cfg.dynamic_sampling:
            kept = [g for g in groups if not g.equal]
            dropped = [g for g in groups if g.equal]
            while rounds < self.cfg.sampling_rounds and world_max(float(len(kept) < wanted), engine) > 0:
                if refill is None:
                    raise RuntimeError("method.dynamic_sampling: the loop gave no refill (a streamed dataset is refused before launch)")
                for k, mb in enumerate(refill(rounds)):
                    for g in self.sampled(engine, mb, tokenizer, seed=(seed, step, engine.dp_rank, k, rounds)):
                        (dropped if g.equal else kept).append(g)
                rounds += 1
            equal, sampled = len(dropped), len(kept) + len(dropped)
            groups = kept[:wanted] + dropped[: max(wanted - len(kept), 0)]
        out, start = [], 0
        for n in sizes:
            batch = self.batch_of(groups[start : start + n], tokenizer)
            start += n
            rows = completions(batch)
            batch["sum_equal_groups"] = torch_full(rows, equal / max(sampled, 1))
            if self.cfg.dynamic_sampling:
                batch["sum_sampling_rounds"] = torch_full(rows, float(rounds))
            if self.overlapped:
                batch["sum_sampling_s"] = torch_full(rows, sampling)
            out.append(self.finished(engine, batch))
        return out

    def sampled(self, engine: Any, mb: dict[str, torch.Tensor], tokenizer: Any, seed: tuple[int, ...]) -> list[Group]:
        """A micro-batch of prompts -> each prompt's group: its G completions, sampled, and their rewards."""
        prompts, answers = split_rows(mb)
        if self.cfg.tools:
            return self.conversed(engine, prompts, answers, tokenizer, seed)
        shown = mb.get(SHOWN)  # a vision-language model's prompts' images: sampled from, and trained with
        completions = sample(engine, prompts, self.cfg, tokenizer, seed=seed, vllm=self.vllm, images=shown, private=self.overlapped)
        return self.grouped(prompts, answers, completions, tokenizer, shown)

    def conversed(self, engine: Any, prompts: list[list[int]], answers: list[list[int]], tokenizer: Any,
                  seed: tuple[int, ...]) -> list[Group]:
        """Each prompt's G completions sampled with tools (finetune.methods.tool_calls): a completion that calls one gets
        the result as a tool turn and is sampled on, up to method.max_turns calls; then scored. Turn t's continuations are
        seeded by (*seed, -t): apart from a refill round's (*seed, round)."""
        import dataclasses

        from finetune.methods import tool_calls

        if self.functions is None:
            self.functions = tool_calls.resolve(self.cfg.tools)
        fmt, g = tool_calls.turn_format(tokenizer), self.cfg.generations
        first = sample(engine, prompts, self.cfg, tokenizer, seed=seed, private=self.overlapped, stop=fmt.stop)
        pieces: list[list[tuple[list[int], bool]]] = [[(c, True)] for c in first]  # (tokens, the policy's)
        trajectories: list[list[dict[str, Any]]] = [[] for _ in first]
        calls = [0] * len(first)
        asking = list(range(len(first)))
        for turn in range(1, self.cfg.max_turns + 1):
            called = []
            for i in asking:
                content, made = tool_calls.parse(spoken(tokenizer, pieces[i][-1][0], fmt.stop), fmt.opener)
                if not made:
                    continue
                results = [tool_calls.run(c, self.functions, self.cfg.tool_timeout) for c in made]
                trajectories[i] += [{"role": "assistant", "content": content.strip(), "tool_calls": made},
                                    *({"role": "tool", "name": c["name"], "content": r} for c, r in zip(made, results))]
                context = fmt.after + tool_calls.tool_turn(tokenizer, made, results, turn)
                pieces[i].append((tokenizer.encode(context, add_special_tokens=False), False))
                calls[i] += len(made)
                called.append(i)
            if not called:
                break
            more = sample(engine, [prompts[i // g] + [t for piece, _ in pieces[i] for t in piece] for i in called],
                          dataclasses.replace(self.cfg, generations=1), tokenizer, seed=(*seed, -turn), private=self.overlapped,
                          stop=fmt.stop)
            for i, c in zip(called, more):
                pieces[i].append((c, True))
            asking = called
        finals = [spoken(tokenizer, p[-1][0], fmt.stop) for p in pieces]
        for t, final in zip(trajectories, finals):
            t.append({"role": "assistant", "content": final})
        ended = [ends(p[-1][0], tokenizer, fmt.stop) for p in pieces]
        completions = [[t for piece, _ in p for t in piece] for p in pieces]
        owned = [[mine for piece, mine in p for _ in piece] for p in pieces]
        return self.grouped(prompts, answers, completions, tokenizer, texts=finals, trajectories=trajectories, owned=owned,
                            ended=ended, calls=calls)

    def grouped(self, prompts: list[list[int]], answers: list[list[int]], completions: list[list[int]], tokenizer: Any,
                images: list[list[Any]] | None = None, *, texts: list[str] | None = None,
                trajectories: list[list[dict[str, Any]]] | None = None, owned: list[list[bool]] | None = None,
                ended: list[bool] | None = None, calls: list[int] | None = None) -> list[Group]:
        """The prompts' groups of `completions` (G adjacent per prompt), scored by the rewards; with tools, `texts` (the
        final answers: what the rewards compare) and `trajectories` (the whole exchange) for the rewards, `owned` (which
        tokens are the policy's), `ended` and `calls` per completion."""
        from finetune.methods import rewards

        g = self.cfg.generations
        columns = {"prompts": [p for p in tokenizer.batch_decode(prompts, skip_special_tokens=True) for _ in range(g)],
                   "completions": texts if texts is not None else tokenizer.batch_decode(completions, skip_special_tokens=True),
                   "answers": [a for a in tokenizer.batch_decode(answers, skip_special_tokens=True) for _ in range(g)],
                   "completion_tokens": [sum(o) for o in owned] if owned is not None else [len(c) for c in completions]}
        if trajectories is not None:
            columns["trajectories"] = trajectories
        total, each = rewards.score(self.rewards or [], **columns)
        shown = images or [[] for _ in prompts]

        def part(values: list[Any] | None, i: int) -> list[Any] | None:
            return None if values is None else values[i * g : (i + 1) * g]

        return [Group(list(p), list(a), tuple(im), completions[i * g : (i + 1) * g], total[i * g : (i + 1) * g],
                      {name: values[i * g : (i + 1) * g] for name, values in each.items()}, part(owned, i), part(ended, i),
                      part(calls, i))
                for i, (p, a, im) in enumerate(zip(prompts, answers, shown))]

    def batch_of(self, groups: list[Group], tokenizer: Any) -> dict[str, torch.Tensor]:
        """The training batch of the groups' completions (prompt + completion, labels on the completion), with their
        advantages; each completion shows its prompt's images. Padded, or with `flat` end to end in one row, each
        completion attending to itself alone, SAMPLES saying which each token is (`on_grid` lays what the forward gives
        per token back out as the padded batch's rows)."""
        import torch

        from finetune.data.batches import collate, flat_samples

        examples = [Example(g.prompt + list(c), [IGNORE] * len(g.prompt) + labelled(c, g.owned[k] if g.owned else None),
                            len(g.prompt), "", images=g.images)
                    for g in groups for k, c in enumerate(g.completions)]
        batch = flat_samples(examples) if self.flat else collate(examples, tokenizer.pad_token_id, pictures=pictures_of(tokenizer))
        r = torch.tensor([g.rewards for g in groups], dtype=torch.float32)
        batch["advantages"] = self.advantages(r).reshape(-1)
        if self.cfg.mask_truncated_completions:  # cut before their EOS: no loss
            batch["kept"] = torch.tensor([float(g.ended[k] if g.ended else tokenizer.eos_token_id in c)
                                          for g in groups for k, c in enumerate(g.completions)])
        batch["sum_reward"] = r.view(-1)
        batch["sum_reward_std"] = r.std(dim=1, keepdim=True).expand_as(r).reshape(-1)
        batch["sum_equal_trained"] = torch.tensor([float(g.equal) for g in groups for _ in g.completions])
        if self.cfg.tools:
            batch["sum_tool_calls"] = torch.tensor([float(n) for g in groups for n in (g.calls or [0] * len(g.completions))])
        for name in self.cfg.rewards:
            batch[f"sum_rewards/{name}"] = torch.tensor([v for g in groups for v in g.each[name]], dtype=torch.float32)
        return batch

    def scored(self, prompts: list[list[int]], answers: list[list[int]], completions: list[list[int]], tokenizer: Any,
               images: list[list[Any]] | None = None) -> dict[str, torch.Tensor]:
        """The training batch of `completions` (G adjacent per prompt), scored."""
        return self.batch_of(self.grouped(prompts, answers, completions, tokenizer, images), tokenizer)


def labelled(completion: list[int], owned: list[bool] | None) -> list[int]:
    """A completion's labels: its tokens, or with tools only the policy's (a tool turn's are context)."""
    return list(completion) if owned is None else [t if mine else IGNORE for t, mine in zip(completion, owned)]


def torch_full(rows: int, value: float) -> torch.Tensor:
    import torch

    return torch.full((rows,), value, dtype=torch.float32)


def completion_mask(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """[rows, tokens - 1] (`on_grid`): 1 where a token of a completion carries the loss (its label; under
    mask_truncated_completions, only in a completion that ended with its EOS)."""
    mask = on_grid((batch["labels"][:, 1:] != IGNORE).float(), batch)
    return mask * batch["kept"][:, None].to(mask) if "kept" in batch else mask


def completions(batch: dict[str, torch.Tensor]) -> int:
    """Completions in a rollout batch (padded or padding-free); rows in an evaluation batch."""
    return int(batch["advantages"].shape[0]) if "advantages" in batch else int(batch["input_ids"].shape[0])


def split_rows(batch: dict[str, torch.Tensor]) -> tuple[list[list[int]], list[list[int]]]:
    """Each row's prompt (the tokens before its first label) and its response (the labelled tokens)."""
    prompts, answers = [], []
    for ids, labels in zip(batch["input_ids"].tolist(), batch["labels"].tolist()):
        first = next(i for i, t in enumerate(labels) if t != IGNORE)
        prompts.append(ids[:first])
        answers.append([t for t in labels if t != IGNORE])
    return prompts, answers
