"""Ship a finished run: a merged model with its model card, optionally a GGUF file, optionally uploaded to the hub.

    python -m finetune.export RUN_DIR [--step N] [--out DIR] [--dtype bf16|fp16|fp32] [--gguf f16|q8_0|q4_0]
                              [--quantize none|int4_weight|...] [--group-size N] [--push-to-hub REPO]

Writes into DIR (default RUN_DIR/export): the model with any adapter merged into its base (finetune.rank.finished),
saved by save_pretrained in --dtype (default: the run's precision), its tokenizer, README.md (the model card: base
model, data and its fingerprints, method, strategies, hyper-parameters, final metrics, the command that reproduces
the run) and with --gguf RUN_NAME-FORMAT.gguf (finetune.rank.gguf_file). --quantize SCHEME (default: the run's train.qat)
writes the model quantized by torchao instead (finetune.rank.qat), with its TorchAoConfig for transformers; --gguf q4_0
writes those 4-bit weights. --push-to-hub REPO uploads DIR to the hub
(huggingface_hub: create_repo, then upload_folder), with the token huggingface_hub finds (HF_TOKEN, or
`hf auth login`). --step N exports checkpoint N instead of final/ (a finished run or not; default DIR
RUN_DIR/export_step_N): its transformers form RUN_DIR/checkpoints/step_N/hf/, as train.save_hf wrote it or converted
now from the engine's own checkpoint (finetune.rank.step_export). A mistake is one line and exit code 2: no run directory,
no final/, no checkpoint of step N (the steps there are listed), a family or tokenizer GGUF cannot hold here, no token
for the upload.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml

from finetune.data.images import save_tokenizer
from finetune import rundir
from finetune.config import Config, PeftMethod, Precision
from finetune.rank.finished import DTYPES, Finished, Refusal, load, locate

QAT_SCHEMES = ("int4_weight", "int8_dynamic_int4_weight", "int3_weight", "int2_weight")
"""--quantize's schemes: train.qat's (finetune.rank.qat.SCHEMES; spelt here too, so `--help` imports no torch)."""
from finetune.methods.base import CAUSAL_LM, IMAGE_TEXT

PRECISION_DTYPE = {Precision.bf16: "bf16", Precision.bf16_pure: "bf16", Precision.fp16: "fp16"}
"""The default --dtype: what the run computed in (fp32 otherwise)."""


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m finetune.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", help="the run directory (its config.yaml and final/)")
    parser.add_argument("--step", type=int, help="export checkpoint N (RUN_DIR/checkpoints/step_N) instead of final/")
    parser.add_argument("--out", type=Path, help="where to write (default: RUN_DIR/export, RUN_DIR/export_step_N with --step)")
    parser.add_argument("--dtype", choices=list(DTYPES), help="weights' dtype (default: the run's precision, fp32 for fp32 runs)")
    parser.add_argument("--gguf", choices=["f16", "q8_0", "q4_0"], help="also write a GGUF file in this format (pip install -e "
                        "'.[ship]'); q4_0: the 4-bit weights of --quantize int4 (group size 32)")
    parser.add_argument("--quantize", choices=["none", *QAT_SCHEMES], help="write the model quantized by torchao in this scheme "
                        "(transformers loads it through its TorchAoConfig); default: the run's train.qat, else none")
    parser.add_argument("--group-size", type=int, help="--quantize's weights per scale (default: the run's train.qat_group_size, else 32)")
    parser.add_argument("--push-to-hub", metavar="REPO", help="upload the export to this hub repository (user/name)")
    parser.error = lambda message: _fail(f"{message} (python -m finetune.export --help)")  # one line, exit 2
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    try:
        run = locate(args.run_dir, need_run=True) if args.step is None else at_step(args.run_dir, args.step)
        assert run.run_dir is not None and run.config is not None
        model_type = check(run, args)
        out = args.out or run.run_dir / ("export" if args.step is None else f"export_step_{args.step}")
        refused = rundir.output_refusal(out, "--out", "the export (config.json, model files, tokenizer files, README.md)",
                                        ours=is_export) if args.out else None
        if refused:
            raise Refusal(refused)
        dtype = args.dtype or PRECISION_DTYPE.get(run.config.precision.name, "fp32")
        scheme, group = quantization(run, args)
        model, tokenizer = load(run, "fp32")  # merged in fp32: the GGUF is made from these weights, then the cast is saved
        out.mkdir(parents=True, exist_ok=True)
        if scheme:
            gguf, words = write_quantized(model, tokenizer, run, out, args, scheme, group, model_type)
        else:
            gguf = write_gguf(model, run, out, args.gguf, model_type) if args.gguf else None
            model.to(getattr(__import__("torch"), DTYPES[dtype])).save_pretrained(out)
            words = dtype
        save_tokenizer(tokenizer, out)
        card(run, tokenizer, dtype=words, gguf=gguf).save(out / "README.md")
        print(f"export       {out}  (merged, {words}{', ' + gguf.name if gguf else ''}, README.md)")
        if args.push_to_hub:
            print(f"pushed       {push(out, args.push_to_hub)}")
    except Refusal as e:
        _fail(str(e))
    return 0


def quantization(run: Finished, args: argparse.Namespace) -> tuple[str | None, int]:
    """(the torchao scheme the export quantizes in, or None; its group size): --quantize, else the run's train.qat. A
    --gguf q4_0 needs int4 weights in groups of 32 (Q4_0's blocks)."""
    assert run.config is not None
    qat, qat_group = run.config.train.qat, run.config.train.qat_group_size
    scheme = (None if args.quantize == "none" else args.quantize) if args.quantize else (qat.value if qat is not None else None)
    group = args.group_size or (qat_group if qat is not None else 32)
    if args.gguf == "q4_0" and (scheme is None or group != 32):
        raise Refusal("--gguf q4_0 holds 4-bit weights in blocks of 32: " + (
            f"this export's groups are {group} weights: use --group-size 32 (and train with train.qat_group_size=32)" if scheme else
            "add --quantize int4_weight (post-training quantization), or train with train.qat=int4_weight"))
    if args.group_size and scheme is None:
        raise Refusal("--group-size applies to --quantize (or a run trained with train.qat): add --quantize int4_weight")
    return scheme, group


def write_quantized(model: Any, tokenizer: Any, run: Finished, out: Path, args: argparse.Namespace, scheme: str, group: int,
                    model_type: str) -> tuple[Path | None, str]:
    """The merged model quantized by torchao in `scheme` (finetune.rank.qat.quantize: what QAT trained for, or
    post-training quantization), saved with its TorchAoConfig for transformers; with --gguf q4_0 the same 4-bit
    weights as Q4_0 blocks. Returns (the GGUF file, the card's words for the weights)."""
    import tempfile

    from transformers import AutoModelForCausalLM, TorchAoConfig

    from finetune.rank import qat

    if args.dtype not in (None, "fp32"):
        raise Refusal(f"--dtype {args.dtype} with --quantize {scheme}: the quantized layers hold int4 weights and fp32 scales, "
                      "the rest stays fp32: leave --dtype out")
    if run.model_class != CAUSAL_LM:
        raise Refusal(f"--quantize {scheme}: {run.run_dir} is not a causal language model: export it without --quantize")
    quantized, kept = qat.chosen(model, group)
    if not quantized:
        raise Refusal(f"--quantize {scheme}: no linear layer (nn.Linear) of this {model_type} model takes inputs in whole groups of "
                      f"{group} weights: export without --quantize")
    with tempfile.TemporaryDirectory(prefix="finetune-export-") as merged:  # transformers quantizes it as it loads it
        model.save_pretrained(merged)
        saved = AutoModelForCausalLM.from_pretrained(merged, dtype="float32", quantization_config=TorchAoConfig(
            qat.ptq_config(scheme, group), modules_to_not_convert=list(kept)))
    saved.save_pretrained(out)
    gguf = None
    if args.gguf:
        qat.dequantize(qat.quantize(model, scheme, group), model)  # the 4-bit grid as float values, for the GGUF writer
        gguf = write_gguf(model, run, out, args.gguf, model_type, on_grid=frozenset(f"{n}.weight" for n in quantized))
    return gguf, f"{scheme} (torchao, groups of {group}: {len(quantized)} linear layers; {len(kept)} and the rest fp32)"


def is_export(directory: Path) -> bool:
    """Whether `directory` holds an earlier export (its model card names finetune), which an export may replace."""
    try:
        return "\n- finetune\n" in (directory / "README.md").read_text().split("\n---", 1)[0]
    except OSError:
        return False


def at_step(where: str, step: int) -> Finished:
    """A run directory's checkpoint `step` in transformers' form (converted if train.save_hf did not write it)."""
    from finetune.rank import step_export
    from finetune.config import load as load_config

    path = Path(where).expanduser()
    if not (path / "config.yaml").is_file():
        locate(where, need_run=True)  # its refusal: no such directory, or not a run directory
    cfg = load_config(path / "config.yaml")
    hf = step_export.converted(path, cfg, step)
    print(f"step {step}      {hf}")
    return Finished(str(hf), path, cfg)


def _fail(line: str) -> None:
    print(f"error: {line}", file=sys.stderr)
    sys.exit(2)


def check(run: Finished, args: argparse.Namespace) -> str:
    """The checks that need no weights, before any are loaded: GGUF support for the family, a token for the upload.
    Returns the model_type."""
    source = Path(run.base or run.model)
    model_type = json.loads((source / "config.json").read_text())["model_type"] if (source / "config.json").is_file() else ""
    if args.gguf:
        from finetune.rank import gguf_file

        if run.model_class == IMAGE_TEXT:
            raise Refusal(f"--gguf {args.gguf}: {run.run_dir or run.model} is a vision-language model ({model_type}): llama.cpp reads "
                          "one as a text model's GGUF plus its vision tower and projector in a separate mmproj file, which "
                          "finetune does not write: export it without --gguf (transformers' AutoModelForImageTextToText and "
                          "AutoProcessor load the export)")
        if run.model_class != CAUSAL_LM:
            raise Refusal(f"--gguf {args.gguf}: {run.run_dir} is a reward model (a sequence classifier), and GGUF holds causal language "
                          "models for llama.cpp: export it without --gguf")
        try:
            import gguf  # noqa: F401
        except ImportError:
            raise Refusal("--gguf needs the gguf package: pip install -e '.[ship]' (or pip install gguf)") from None
        why = gguf_file.refusal(model_type)
        if why:
            raise Refusal(f"{model_type} model: {why}")
    if args.push_to_hub:
        from huggingface_hub import constants, get_token

        if constants.HF_HUB_OFFLINE:
            raise Refusal(f"--push-to-hub {args.push_to_hub}: HF_HUB_OFFLINE is set, so huggingface_hub sends nothing: unset it")
        if get_token() is None:
            raise Refusal(f"--push-to-hub {args.push_to_hub}: no hub token: set HF_TOKEN or run `hf auth login`")
    return model_type


def write_gguf(model: Any, run: Finished, out: Path, fmt: str, model_type: str, on_grid: frozenset[str] = frozenset()) -> Path:
    """RUN_NAME-FMT.gguf in `out`; a warning when transformers' GGUF loader would read it as another model."""
    from finetune.rank import gguf_file

    assert run.run_dir is not None
    try:
        path = gguf_file.write(model, Path(run.model), out / f"{run.run_dir.name}-{fmt}.gguf", fmt, run.run_dir.name, on_grid)
    except ValueError as e:
        raise Refusal(str(e)) from None
    unread = gguf_file.unread(path, model)
    if unread:
        print(f"warning: {path.name}: transformers' GGUF loader has no key for some of this {model_type} model's config, so "
              f"it would build another model from it ({'; '.join(unread)}); llama.cpp reads the file's own keys, "
              "which this export did not check", file=sys.stderr)
    differs = gguf_file.llamacpp_differs(model)
    if differs:
        print(f"warning: {path.name}: llama.cpp computes this {model_type} model differently from its config "
              f"({'; '.join(differs)}): its outputs there will not be this model's", file=sys.stderr)
    return path


def push(out: Path, repo: str) -> str:
    """Upload `out` to the hub model repository `repo` (created if missing) in one commit; returns the commit's URL."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    api = HfApi()  # the endpoint (HF_ENDPOINT) and token (HF_TOKEN, or the login's) as huggingface_hub finds them
    try:
        api.create_repo(repo, repo_type="model", exist_ok=True)
        commit = api.upload_folder(folder_path=out, repo_id=repo, repo_type="model", commit_message=f"finetune.export of {out.parent.name}")
    except HfHubHTTPError as e:
        raise Refusal(f"--push-to-hub {repo}: the hub refused the upload: {str(e).splitlines()[0]}") from None
    except Exception as e:  # a transport error of the HTTP client huggingface_hub uses (httpx or its fork), after its retries
        if "TransportError" not in {c.__name__ for c in type(e).__mro__}:
            raise
        raise Refusal(f"--push-to-hub {repo}: cannot reach {api.endpoint}: {e}") from None
    return commit.commit_url


def reproduce(run_dir: Path) -> str:
    """The command that made the run: the launcher plus the overrides Hydra recorded (RUN_DIR/.hydra)."""
    hydra_dir = run_dir / ".hydra"
    if not (hydra_dir / "overrides.yaml").is_file():
        return f"# not recorded (no {hydra_dir}/overrides.yaml): the run's resolved config is config.yaml"
    task = yaml.safe_load((hydra_dir / "overrides.yaml").read_text()) or []
    hydra = yaml.safe_load((hydra_dir / "hydra.yaml").read_text())["hydra"] if (hydra_dir / "hydra.yaml").is_file() else {}
    config_dir = [f"--config-dir {s['path']}" for s in hydra.get("runtime", {}).get("config_sources", []) if s.get("provider") == "command-line"]
    own = [o for o in hydra.get("overrides", {}).get("hydra", []) if not o.startswith("hydra.mode=")]
    return " ".join(["python -m finetune.launch", *config_dir, *task, *own])


def data_fingerprints(cfg: Config, tokenizer: Any) -> dict[str, Any]:
    """What the token cache keys the run's data by (finetune.data.cache.key_inputs): each source's sha256 (a hub
    dataset: its id, split and `datasets` fingerprint), the tokenizer's hash, and the cache key itself."""
    from finetune.data import cache

    inputs = cache.key_inputs(cfg.data, tokenizer, cfg.method.name, cfg.train.seed)
    return {"sources": inputs["sources"], "tokenizer": inputs["tokenizer"], "cache_key": cache.key_of(inputs)}


def card(run: Finished, tokenizer: Any, *, dtype: str, gguf: Path | None) -> Any:
    """The model card (huggingface_hub.ModelCard): metadata the hub reads, then what trained the model, in words."""
    from huggingface_hub import ModelCard, ModelCardData

    cfg, run_dir = run.config, run.run_dir
    assert cfg is not None and run_dir is not None
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").is_file() else {}
    base = cfg.model.path
    hub_base = base if base and not cfg.model.from_scratch and not Path(base).expanduser().exists() else None
    data = data_fingerprints(cfg, tokenizer)
    hub_data = [e["hub"] for e in data["sources"].values() if "hub" in e]
    tags = ["finetune", cfg.method.name, *([cfg.peft.name.value] if cfg.peft.name != PeftMethod.none else []), *(["gguf"] if gguf else [])]
    meta = ModelCardData(base_model=hub_base, datasets=hub_data or None, library_name="transformers",
                         pipeline_tag="image-text-to-text" if run.model_class == IMAGE_TEXT else "text-generation",
                         tags=tags)
    lines = [f"# {run_dir.name}", "",
             f"Fine-tuned with finetune from {_base_words(cfg)}; method `{cfg.method.name}`"
             f"{_adapter_words(cfg)}. Weights: {dtype} safetensors{f', and {gguf.name} (GGUF)' if gguf else ''}.", "",
             "## Data", "", "| source | fingerprint (sha256, as the token cache keys it) |", "|---|---|"]
    for key, entry in data["sources"].items():
        files = entry.get("files") or {f"{entry['hub']} ({entry['split']})": entry.get("fingerprint") or "hub dataset, not cached here"}
        lines += [f"| `{key}` {path} | `{digest}` |" for path, digest in files.items()]
    lines += ["", f"Tokenizer hash `{data['tokenizer']}`; token cache key `{data['cache_key']}` (finetune/data/cache.py). "
              f"Format {cfg.data.format.value}, template {cfg.data.template.value}, max_length {cfg.data.max_length}, "
              f"packing {str(cfg.data.packing).lower()}, system prompt {cfg.data.system_prompt!r}.", "",
              "## Training", "", "| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in _settings(cfg).items()), "",
              "## Metrics", "", "From `summary.json`:", "", "| metric | before | after |", "|---|---|---|"]
    before, after = summary.get("before", {}), summary.get("after", {})
    lines += [f"| {k} | {_num(before.get(k))} | {_num(after.get(k))} |" for k in dict.fromkeys([*before, *after])]
    lines += ["", "## Reproduce", "", "```bash", reproduce(run_dir), "```", "",
              "The resolved config the ranks read is in the run directory as `config.yaml`.", ""]
    return ModelCard(f"---\n{meta.to_yaml()}\n---\n\n" + "\n".join(lines))


def _base_words(cfg: Config) -> str:
    if cfg.model.path and cfg.model.from_scratch:
        return f"random weights (seed 0) in the architecture of `{cfg.model.path}`'s config.json"
    if cfg.model.path:
        return f"`{cfg.model.path}`" + (f" (revision {cfg.model.revision})" if cfg.model.revision else "")
    init = cfg.model.init
    assert init is not None
    return f"a random-init {init.model_type} ({init.num_hidden_layers} layers, hidden {init.hidden_size}, seed {init.seed})"


def _adapter_words(cfg: Config) -> str:
    p = cfg.peft
    if p.name == PeftMethod.none:
        return ", all weights trained"
    into = "the 4-bit base dequantized (the weights it trained against)" if p.name == PeftMethod.qlora else "the base"
    return f", {p.name.value} adapter (r={p.r}, alpha={p.alpha}, targets {', '.join(p.target_modules)}) merged into {into}"


def _settings(cfg: Config) -> dict[str, Any]:
    o, t, par = cfg.optim, cfg.train, cfg.parallelism
    method = {k: v for k, v in vars(cfg.method).items() if k != "name"}  # the method's own keys (none for sft)
    return {
        "method": cfg.method.name + (f" ({', '.join(f'{k}={_value(v)}' for k, v in method.items())})" if method else ""),
        "steps": t.max_steps, "batch": f"{t.global_batch_size} sequences ({t.micro_batch_size} per micro-batch)", "seed": t.seed,
        "optimizer": f"{_value(o.name)} lr={o.lr} {_value(o.scheduler)} schedule, warmup {o.warmup_steps} steps, weight decay "
                     f"{o.weight_decay}, betas {tuple(o.betas)}, max grad norm {o.max_grad_norm}",
        "precision": _value(cfg.precision.name), "activation checkpointing": _value(cfg.checkpointing.name),
        "layout": f"{_value(par.strategy)}, tp={par.tp} pp={par.pp} cp={par.cp}" + (f", ZeRO stage {cfg.zero.stage}" if cfg.zero.stage else ""),
        "ranks": f"{cfg.launcher.nproc_per_node} x {cfg.launcher.nnodes} node(s)",
    }


def _value(v: Any) -> Any:
    return getattr(v, "value", v)


def _num(v: Any) -> str:
    return "" if v is None else f"{v:.4f}" if isinstance(v, float) else str(v)


if __name__ == "__main__":
    sys.exit(main())
