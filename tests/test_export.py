"""finetune.export: the merged model, the model card, GGUF files read back by transformers and compared logit for
logit, the upload up to the hub's HTTP requests, and the one-line refusals. The commands are the site's (After training), as written."""

from __future__ import annotations

import copy

import base64
import hashlib
import json
import shutil
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from finetune.rank import gguf_file
from finetune.families import FAMILIES

import gguf_cases
from gguf_cases import TINY, tiny_config
from conftest import readme_commands, run_shell, train_here

RUN = "outputs/quickstart_sft"
IDS = torch.tensor([[1, 5, *range(7, 60), 6]])  # <s> <|user|> text <|assistant|>
TOLERANCE = {"f16": 2e-3, "q8_0": 0.1, "q4_0": 2e-3}
"""Largest logit difference a GGUF file may show against the merged model, per unit of the largest logit when that is above
1 (measured on a 20-step quickstart whose logits reach 2.5: 3.8e-4 and 1.1e-2;
on the tiny families: at most 4.3e-4 and 1.3e-2, and 6.4e-2 in q8_0 for qwen2_moe, whose default expert widths are 22x
and 88x its hidden size). q4_0 against the model quantized to torchao's int4 first (what it holds exactly, but for its
fp16 scales and the f16 layers it keeps: f16's tolerance)."""


def command(part: str) -> str:
    """The site's command of finetune.export that contains `part`."""
    found = [c for c in readme_commands("finetune.export") if part in c]
    assert len(found) == 1, f"the site has {len(found)} finetune.export commands with {part!r}"
    return found[0]


def gap(gguf: torch.Tensor, merged: torch.Tensor) -> float:
    """The largest logit difference, per unit of the largest logit when that is above 1 (TOLERANCE)."""
    return (gguf - merged).abs().max().item() / max(1.0, merged.abs().max().item())


def logits(model, ids=IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits.float()


def from_gguf(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


@pytest.mark.slow
def test_readme_export_writes_the_merged_model_its_card_and_a_gguf_that_gives_the_same_logits(shipped):
    from transformers import AutoModelForCausalLM

    out = run_shell(command("--gguf q8_0"), cwd=shipped)
    assert out.returncode == 0, out.stderr[-3000:]
    run, export = shipped / RUN, shipped / RUN / "export"
    assert f"export       {RUN}/export  (merged, fp32, quickstart_sft-q8_0.gguf, README.md)" in out.stdout
    merged = AutoModelForCausalLM.from_pretrained(export).eval()
    final = AutoModelForCausalLM.from_pretrained(run / "final").eval()
    assert torch.equal(logits(merged), logits(final))  # a full fine-tune: the export is final/ itself
    diff = gap(logits(from_gguf(export / "quickstart_sft-q8_0.gguf")), logits(merged))
    assert diff < TOLERANCE["q8_0"], diff
    card = (export / "README.md").read_text()
    train = Path(json.loads(json.dumps(str(run / "config.yaml"))))  # the run's data files, hashed as the card says
    from finetune import config

    cfg = config.load(train)
    assert hashlib.sha256(Path(cfg.data.train).read_bytes()).hexdigest() in card
    assert hashlib.sha256(Path(cfg.data.eval).read_bytes()).hexdigest() in card
    summary = json.loads((run / "summary.json").read_text())
    assert f"| eval_loss | {summary['before']['eval_loss']:.4f} | {summary['after']['eval_loss']:.4f} |" in card
    assert ("python -m finetune.launch +recipe=quickstart_sft train.max_steps=200 optim.warmup_steps=5 train.exact_match_samples=32 "
            f"train.progress_bar=false hydra.run.dir={RUN}") in card
    assert "| optimizer | adamw lr=0.001 cosine schedule, warmup 5 steps" in card and "| ranks | 2 x 1 node(s) |" in card
    assert card.startswith("---\nlibrary_name: transformers\npipeline_tag: text-generation\ntags:\n- finetune\n- sft\n- gguf\n---")


@pytest.mark.slow
def test_export_to_another_directory_in_bf16_with_an_f16_gguf(shipped, tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    out = run_shell(f"python -m finetune.export {RUN} --out {tmp_path / 'x'} --dtype bf16 --gguf f16", cwd=shipped)
    assert out.returncode == 0, out.stderr[-3000:]
    with safe_open(tmp_path / "x/model.safetensors", "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    final = AutoModelForCausalLM.from_pretrained(shipped / RUN / "final").eval()  # the GGUF is made from the fp32 weights
    diff = gap(logits(from_gguf(tmp_path / "x/quickstart_sft-f16.gguf")), logits(final))
    assert diff < TOLERANCE["f16"], diff


class Hub(BaseHTTPRequestHandler):
    """The hub's HTTP API as huggingface_hub's upload uses it, recording each request (no hub is reachable here)."""

    seen: list[dict] = []

    def answer(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        Hub.seen.append({"method": self.command, "path": self.path, "auth": self.headers.get("authorization"), "body": body})
        if self.path == "/api/repos/create":
            asked = json.loads(body)
            reply = {"url": f"http://{self.headers['Host']}/{asked['organization']}/{asked['name']}"}
        elif self.path.endswith("/preupload/main"):  # every file inline in the commit (no LFS, no Xet)
            reply = {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in json.loads(body)["files"]]}
        elif "/commit/" in self.path:
            reply = {"commitUrl": f"http://{self.headers['Host']}/you/quickstart-sft/commit/{'1' * 40}", "commitOid": "1" * 40}
        else:
            reply = {}
        data = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = do_PUT = answer

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def hub():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Hub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    Hub.seen = []
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()


@pytest.mark.slow
def test_readme_push_creates_the_repository_and_commits_the_export_with_the_token(shipped, hub, tmp_path):
    env = {"HF_ENDPOINT": hub, "HF_TOKEN": "hf_test_token", "HF_HUB_OFFLINE": "0", "HF_HOME": str(tmp_path)}
    out = run_shell(command("--push-to-hub"), cwd=shipped, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"pushed       {hub}/you/quickstart-sft/commit/{'1' * 40}" in out.stdout
    create = next(r for r in Hub.seen if r["path"] == "/api/repos/create")
    assert json.loads(create["body"]) == {"name": "quickstart-sft", "organization": "you", "type": "model"}
    commit = next(r for r in Hub.seen if r["path"] == "/api/models/you/quickstart-sft/commit/main")
    assert create["auth"] == commit["auth"] == "Bearer hf_test_token"
    lines = [json.loads(line) for line in commit["body"].decode().splitlines()]
    files = {line["value"]["path"]: base64.b64decode(line["value"]["content"]) for line in lines if line["key"] == "file"}
    export = shipped / RUN / "export"
    assert {"README.md", "config.json", "model.safetensors", "tokenizer.json"} <= set(files)
    assert files["README.md"] == (export / "README.md").read_bytes()
    assert files["model.safetensors"] == (export / "model.safetensors").read_bytes()


@pytest.mark.slow
def test_refusals_are_one_line_with_exit_code_2(shipped, tmp_path):
    def refused(args: str, alone: bool = True, **env) -> str:
        """The refusal's line; `alone`: refused before any weights are loaded, so it is all stderr holds."""
        out = run_shell(f"python -m finetune.export {args}", cwd=shipped, env=env)
        assert out.returncode == 2 and (out.stderr.count("\n") == 1 or not alone), out.stderr
        return out.stderr.strip().splitlines()[-1]

    assert refused("no/such/run") == "error: no/such/run: no such directory: give the directory a launch wrote (hydra.run.dir, or outputs/DATE/TIME)"
    unfinished = tmp_path / "unfinished"
    unfinished.mkdir()
    shutil.copy(shipped / RUN / "config.yaml", unfinished)
    assert refused(str(unfinished)).startswith(f"error: {unfinished} holds no final/: the run has not finished")
    assert refused(f"{RUN} --dtype int4") == ("error: argument --dtype: invalid choice: 'int4' (choose from 'fp32', 'bf16', 'fp16') "
                                             "(python -m finetune.export --help)")
    olmo = tmp_path / "olmo"
    (olmo / "final").mkdir(parents=True)
    shutil.copy(shipped / RUN / "config.yaml", olmo)
    (olmo / "final/config.json").write_text(json.dumps({"model_type": "olmo2"}))
    assert refused(f"{olmo} --gguf f16") == f"error: olmo2 model: {gguf_file.refusal('olmo2')}"
    assert refused(f"{RUN} --push-to-hub you/x", HF_TOKEN="", HF_HOME=str(tmp_path), HF_HUB_OFFLINE="0") == \
        "error: --push-to-hub you/x: no hub token: set HF_TOKEN or run `hf auth login`"
    assert refused(f"{RUN} --push-to-hub you/x", HF_TOKEN="t", HF_HUB_OFFLINE="1") == \
        "error: --push-to-hub you/x: HF_HUB_OFFLINE is set, so huggingface_hub sends nothing: unset it"
    assert refused(f"{RUN} --out {tmp_path / 'x'} --push-to-hub you/x", alone=False, HF_TOKEN="t", HF_HUB_OFFLINE="0",
                   HF_ENDPOINT="http://127.0.0.1:9") == "error: --push-to-hub you/x: cannot reach http://127.0.0.1:9: [Errno 111] Connection refused"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_family_exports_to_gguf_with_the_same_logits_or_is_refused_with_the_reason(family, tmp_path, tok):
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    why = gguf_file.refusal(family)
    if why is not None:
        assert family not in GGUF_SUPPORTED_ARCHITECTURES and (family in why or family in gguf_file.WHY_NOT)
        return
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(family)).eval()
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    for fmt in gguf_file.FORMATS:
        exported, on_grid = model, frozenset()
        if fmt == "q4_0":  # as `finetune.export --quantize int4_weight --gguf q4_0` writes it, against that 4-bit model
            pytest.importorskip("torchao")
            from finetune.rank import qat

            exported = copy.deepcopy(model)
            on_grid = frozenset(f"{n}.weight" for n in qat.quantize(exported, "int4_weight", 32))
            qat.dequantize([n.removesuffix(".weight") for n in on_grid], exported)
            if family == "gpt2":  # Conv1D layers, no nn.Linear that torchao quantizes
                with pytest.raises(ValueError, match="^--gguf q4_0: no weight of this model is on a 4-bit grid"):
                    gguf_file.write(exported, tmp_path, tmp_path / f"{family}-{fmt}.gguf", fmt, family, on_grid)
                continue
        path = gguf_file.write(exported, tmp_path, tmp_path / f"{family}-{fmt}.gguf", fmt, family, on_grid)
        assert gguf_file.unread(path, model) == []
        diff = gap(logits(from_gguf(path)), logits(exported))
        print(f"{family} {fmt}: largest logit difference {diff:.1e} (logits up to {logits(model).abs().max().item():.2f})")
        assert diff < TOLERANCE[fmt], (family, fmt, diff)


def test_a_config_the_loader_cannot_read_back_is_named(tmp_path, tok):
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3", **TINY, head_dim=16))
    path = gguf_file.write(model, Path(tok.name_or_path), tmp_path / "q.gguf", "f16", "q")
    assert gguf_file.unread(path, model) == ["head_dim=128 read back (the model's: 16)"]


def test_the_quickstart_tokenizer_reads_back_from_gguf(tmp_path, tok):
    """A word-level vocabulary of single bytes is a byte-level BPE with no merges: the same tokens."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **TINY))
    path = gguf_file.write(model, Path(tok.name_or_path), tmp_path / "t.gguf", "f16", "t")
    back = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    text = "reverse\nHello, world! ~{}"
    assert back(text, add_special_tokens=False)["input_ids"] == tok(text, add_special_tokens=False)["input_ids"]


LLAMACPP_READS = {"gpt2": {"default", "gpt-2", "llama-bpe", "qwen2"}, "llama": None}
"""tokenizer.ggml.model -> the tokenizer.ggml.pre names llama.cpp's loader takes for it among those this export writes
(llama-vocab.cpp: an unknown name is "unknown pre-tokenizer type"; a SentencePiece model reads none)."""


def gguf_fields(path: Path) -> dict:
    import gguf

    return {k: f.contents() for k, f in gguf.GGUFReader(path).fields.items() if k.startswith("tokenizer.") and "chat" not in k}


@pytest.mark.parametrize("kind", gguf_cases.KINDS)
def test_every_tokenizer_kind_exports_the_vocabulary_llamacpp_reads(kind, tmp_path):
    """A user's BPE or SentencePiece tokenizer: the keys llama.cpp's loader reads, and transformers' GGUF reader tokenizes
    every prompt as the tokenizer does (llama.cpp itself: scripts/llamacpp_check.py, its numbers in docs/after-training.md)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    directory = gguf_cases.make(kind, tmp_path)
    tok = AutoTokenizer.from_pretrained(directory)
    spec = json.loads((directory / "tokenizer.json").read_text())
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **TINY | dict(
        vocab_size=len(tok) + 5, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=None)))
    path = gguf_file.write(model, directory, tmp_path / "m.gguf", "f16", "m")
    got = gguf_fields(path)
    tokens = got["tokenizer.ggml.tokens"]
    assert len(tokens) == len(tok) + 5 and tokens[-1] == f"[PAD{len(tok) + 4}]"
    assert (got["tokenizer.ggml.bos_token_id"], got["tokenizer.ggml.eos_token_id"]) == (tok.bos_token_id, tok.eos_token_id)
    model_name = got["tokenizer.ggml.model"]
    assert model_name == ("llama" if kind.startswith("spm") else "gpt2")
    if model_name == "gpt2":
        assert got["tokenizer.ggml.pre"] == {"bpe-gpt2": "gpt-2", "bpe-llama3": "llama-bpe", "bpe-qwen2": "qwen2"}[kind]
        assert got["tokenizer.ggml.pre"] in LLAMACPP_READS["gpt2"]
        merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
        assert got["tokenizer.ggml.merges"] == merges and len(merges) > 100
        assert all({*m.split(" "), m.replace(" ", "")} <= set(tokens) for m in merges)  # llama.cpp looks merges up by text
    else:
        assert "tokenizer.ggml.pre" not in got
        # byte fallback: llama.cpp's SentencePiece model finds every byte as its <0xXX> token, typed BYTE (6)
        types = got["tokenizer.ggml.token_type"]
        assert all(types[tokens.index(f"<0x{b:02X}>")] == 6 for b in range(256))
        assert got["tokenizer.ggml.add_space_prefix"] == tok.tokenize("a")[0].startswith("\u2581") == (kind == "spm-llama")
        assert got["tokenizer.ggml.unknown_token_id"] == tok.unk_token_id
        # llama.cpp joins the neighbours whose piece scores highest, tokenizers applies the merge of lowest rank: the
        # scores follow the merges (gguf's own vocab scores every piece -1000: llama.cpp then joined the leftmost pair)
        scores, merged = got["tokenizer.ggml.scores"], ["".join(m.split(" ") if isinstance(m, str) else m) for m in spec["model"]["merges"]]
        first = {t: -(i + 1.0) for i, t in reversed(list(enumerate(merged)))}
        assert all(scores[tokens.index(t)] == s for t, s in first.items()) and scores[tokens.index("<0x41>")] == 0.0
    back = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    for text in gguf_cases.PROMPTS:
        assert back(text, add_special_tokens=False)["input_ids"] == tok(text, add_special_tokens=False)["input_ids"], text


def test_what_llamacpp_would_read_as_another_model_is_written_apart_or_named(tmp_path, tok):
    """llama.cpp takes a general.name with "phi3" in it for Phi-3's vocabulary (and fails to load a file without Phi-3's
    tokens), and scales Gemma's attention by 1/sqrt(head_dim) whatever query_pre_attn_scalar says."""
    from transformers import AutoModelForCausalLM

    shipped = Path(tok.name_or_path)
    assert gguf_file.file_name("my-phi3-sft", shipped) == "my-phi_3-sft" and gguf_file.file_name("Phi-3-mini", shipped) == "Phi-_3-mini"
    assert gguf_file.file_name("mistral", shipped) == "mistral-model" and gguf_file.file_name("llama-sft", shipped) == "llama-sft"
    phi = gguf_cases.make("spm-llama", tmp_path / "phi")
    spec = json.loads((phi / "tokenizer.json").read_text())
    spec["added_tokens"].append({**spec["added_tokens"][0], "id": 9999, "content": "<|endoftext|>"})
    (phi / "tokenizer.json").write_text(json.dumps(spec))
    assert gguf_file.file_name("phi3-sft", phi) == "phi3-sft"  # Phi-3's tokens are there: llama.cpp's attributes apply
    gemma = AutoModelForCausalLM.from_config(tiny_config("gemma2", head_dim=16))
    assert gguf_file.llamacpp_differs(gemma) == ["query_pre_attn_scalar=256 (llama.cpp scales attention by 1/sqrt(head_dim=16))"]
    assert gguf_file.llamacpp_differs(AutoModelForCausalLM.from_config(tiny_config("gemma2"))) == []


def test_tokenizers_llamacpp_would_read_differently_are_refused_with_the_reason(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **TINY | dict(vocab_size=410)))
    unigram = gguf_cases.make("unigram", tmp_path / "u")
    with pytest.raises(ValueError) as refused:
        gguf_file.write(model, unigram, tmp_path / "u.gguf", "f16", "u")
    assert str(refused.value) == ("--gguf: the tokenizer is a Unigram model (tokenizer.json), which llama.cpp reads only "
                                  "for families this export does not write (T5's Unigram, BERT's WordPiece): export without --gguf")
    bpe = gguf_cases.make("bpe-llama3", tmp_path / "b")
    spec = json.loads((bpe / "tokenizer.json").read_text())
    spec["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = r"\p{N}{1,4}|\S+|\s+"  # a split llama.cpp has no name for
    (bpe / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(ValueError) as refused:
        gguf_file.write(model, bpe, tmp_path / "b.gguf", "f16", "b")
    assert str(refused.value) == ("--gguf: the tokenizer is a BPE model whose pre-tokenizer llama.cpp does not know by name "
                                  r"(its split: \p{N}{1,4}|\S+|\s+; llama.cpp names gpt-2, llama-bpe, qwen2 here), so llama.cpp "
                                  "would tokenize differently: export without --gguf")


@pytest.mark.parametrize("peft", ["lora", "dora", "qlora"])
def test_adapters_merge_into_the_model_they_trained_with(peft, tmp_path):
    """The merged export computes what the adapter over its base computed (QLoRA: over the 4-bit base)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from finetune.rank import finished

    train_here(["+recipe=quickstart_sft", "parallelism=single", "launcher.nproc_per_node=1", f"peft={peft}", "train.max_steps=3",
                "optim.warmup_steps=0", "train.eval_every=0", "train.exact_match_samples=0", "train.micro_batch_size=4",
                "train.global_batch_size=4", "optim.lr=1e-2"], tmp_path)
    run = finished.locate(str(tmp_path), need_run=True)
    merged, _ = finished.load(run)
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,  # the peft group's defaults
                               bnb_4bit_compute_dtype=torch.float32) if peft == "qlora" else None
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base", quantization_config=quant, dtype=torch.float32)
    adapted = PeftModel.from_pretrained(base, tmp_path / "final").eval()
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32).eval()
    diff = (logits(merged) - logits(adapted)).abs().max().item()
    if peft != "qlora":
        assert diff < 1e-4, diff
    else:  # bitsandbytes' 4-bit forward is not the dequantized weights' to the last bit; the original weights are further off
        original = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32),
                                             tmp_path / "final").merge_and_unload().eval()
        off = (logits(original) - logits(adapted)).abs().max().item()
        print(f"qlora: merged into the dequantized base {diff:.1e} from the 4-bit model, into the original {off:.1e}")
        assert diff < 1e-2 and diff < off / 2, (diff, off)
    assert (logits(merged) - logits(plain)).abs().max().item() > 1e-3  # the adapter changed the model


@pytest.mark.slow
def test_an_export_is_never_written_over_a_runs_results_or_other_files(shipped, tmp_path, capsys, monkeypatch):
    """--out into the run's final/ or checkpoints/, the run directory itself, or a directory of other files: refused in
    one line before anything is loaded, the run's files untouched; an earlier export's directory may be written again."""
    from finetune import rundir
    from finetune.rank import export

    monkeypatch.chdir(shipped)
    run = (shipped / RUN).resolve()
    before = {p: p.stat().st_mtime_ns for p in (run / "final").iterdir()}

    def refused(out: Path) -> str:
        with pytest.raises(SystemExit) as ended:
            export.main([RUN, "--out", str(out)])
        assert ended.value.code == 2
        return capsys.readouterr().err.strip()

    writes = "the export (config.json, model files, tokenizer files, README.md)"
    assert refused(run / "final") == (f"error: --out {run / 'final'} is inside the run's final ({run}): {writes} would replace "
                                      f"what the run made; give a directory of its own (the default: {run / 'export'})")
    assert refused(run / "checkpoints" / "x").startswith(f"error: --out {run / 'checkpoints' / 'x'} is inside the run's checkpoints")
    assert refused(run) == (f"error: --out {run} is a run directory: {writes} would go beside the run's own files; give a "
                            f"directory of its own (the default is inside the run: {run / 'export'})")
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "README.md").write_text("my notes\n")
    assert refused(notes) == f"error: --out {notes} holds other files (README.md): {writes} would replace same-named ones; give " \
                             "a new or empty directory"
    assert {p: p.stat().st_mtime_ns for p in (run / "final").iterdir()} == before and (notes / "README.md").read_text() == "my notes\n"
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    (earlier / "README.md").write_text("---\nlibrary_name: transformers\ntags:\n- finetune\n- sft\n---\n# an export\n")
    assert rundir.output_refusal(earlier, "--out", writes, ours=export.is_export) is None
    assert rundir.output_refusal(tmp_path / "new", "--out", writes, ours=export.is_export) is None
