"""The data's and the method's rules: the sources, streaming, the chat template, the method's own rules and the forms it reads, packing
and padding-free rows (finetune.data.rows, which the planner and the ranks read too), an eval set where asked.
"""

from __future__ import annotations

from finetune.config import Config, ConfigError, DataFormat, Reference, Template
from finetune import methods
from finetune.benchmarks import method_problem
from finetune.data.forms import ROW_KEYS
from finetune.data.sources import all_sources, sources


def validate_sources(cfg: Config) -> None:
    """data.train and data.eval: a mixture's entries, each named when malformed; a column map onto a key no row form
    reads."""
    for s in all_sources(cfg.data):  # a mixture's entries, each named when malformed
        for ours, _ in s.columns:
            if ours not in ROW_KEYS:
                raise ConfigError(f"{s.key}.columns.{ours}: no row form reads a key {ours!r}: map the dataset's columns onto "
                                  f"{', '.join(ROW_KEYS)}")


def validate_template(cfg: Config) -> None:
    """data.chat_template replaces the tokenizer's template, which data.template=builtin does not render with."""
    if cfg.data.chat_template and cfg.data.template == Template.builtin:
        raise ConfigError(f"data.chat_template={cfg.data.chat_template} has no effect with data.template=builtin (rows are rendered "
                          "with the built-in template): remove one of them")


def validate_streaming(cfg: Config) -> None:
    """What a stream (data.streaming=true) cannot do, each refused with what to do instead; and its
    shuffle buffer set without one."""
    d, m = cfg.data, cfg.method
    if not d.streaming:
        if d.shuffle_buffer is not None:
            raise ConfigError(f"data.shuffle_buffer={d.shuffle_buffer} applies to data.streaming=true only (otherwise the whole set is "
                              "shuffled by train.seed): remove it, or set data.streaming=true")
        return
    for name in ("cache_dir", "num_proc"):
        if getattr(d, name) is not None:
            raise ConfigError(f"data.{name}={getattr(d, name)} has no effect with data.streaming=true (a stream is tokenized on the fly, "
                              "with no token cache): remove it, or set data.streaming=false")
    srcs = sources(d.train, d.train_split, "data.train")
    for s in srcs:
        if s.rows is not None:
            raise ConfigError(f"{s.key}.rows={s.rows} is an exact count of the source's rows, whose number data.streaming=true does "
                              "not read ahead: give the source a weight instead")
        if s.weight is None and len(srcs) > 1:
            raise ConfigError(f"{s.key}: a streamed mixture draws each next row from a source by its weight (data.streaming=true): "
                              "give every source a weight")
    if len(srcs) > 1 and d.eval is None and d.eval_size:
        raise ConfigError(f"data.eval_size={d.eval_size} with a streamed mixture: data.streaming=true holds out the first rows of one "
                          "source, and a mixture has several: set data.eval")
    method = methods.get(m.name)
    if method.reference(m) == Reference.precomputed:
        raise ConfigError(f"method.reference=precomputed scores every train {method.unit} before training, which a stream cannot "
                          "(data.streaming=true): use method.reference=live (or adapter_disabled with peft), or data.streaming=false")


def validate_method(cfg: Config) -> None:
    """The method's own rules (its finetune.methods record), then what every method's record declares: the data
    forms it reads, whether its rows can be packed."""
    method = methods.get(cfg.method.name)
    method.validate(cfg)
    fmt = cfg.data.format
    if fmt != DataFormat.auto and fmt not in method.forms:
        raise ConfigError(f"method={method.name} reads data.format={' or '.join(f.value for f in method.forms)} rows (or auto): "
                          f"data.format={fmt.value} is not one of them")
    if cfg.data.packing and method.unpacked:
        raise ConfigError(f"data.packing=true cannot run here: {method.unpacked}: set data.packing=false")


def validate_eval(cfg: Config) -> None:
    """train.exact_match_samples and train.sample_prompts need an eval set; the samples need ranks that can generate;
    train.eval_tasks needs a causal LM (finetune.launch checks lm-eval and the task names: finetune.benchmarks.check)."""
    t = cfg.train
    for key, value in (("exact_match_samples", t.exact_match_samples), ("sample_prompts", t.sample_prompts)):
        if value and cfg.data.eval is None and cfg.data.eval_size == 0:
            raise ConfigError(f"train.{key} needs an eval set: set data.eval or data.eval_size")
    if t.sample_prompts and cfg.parallelism.pp > 1:
        raise ConfigError(f"train.sample_prompts={t.sample_prompts} with parallelism.pp={cfg.parallelism.pp}: pipeline stages cannot "
                          "generate while training (exact match is measured on final/ after it); set train.sample_prompts=0")
    if t.eval_tasks and (why := method_problem(cfg.method.name, f"train.eval_tasks=[{','.join(t.eval_tasks)}]")):
        raise ConfigError(f"{why}; set train.eval_tasks=[]")
