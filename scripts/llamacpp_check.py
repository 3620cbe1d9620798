"""What llama.cpp itself makes of the GGUF files `finetune.export --gguf` writes, through llama-cpp-python (not on these
machines by default: `pip install llama-cpp-python` builds llama.cpp from its source distribution, about 11 minutes on
two cores).

For every family the export writes (tiny models, the shipped tokenizer) and every tokenizer kind a user's model brings
(a tiny llama with each of tests/gguf_cases.py's tokenizers), in f16, q8_0 and q4_0 (the model quantized to torchao's int4
in groups of 32 first, as `finetune.export --quantize int4_weight --gguf q4_0` does, and compared with that 4-bit model):
whether llama.cpp loads the file; whether
its tokens equal the tokenizer's on every prompt; its logits against the Hugging Face model's on the same ids (the largest
gap per unit of the largest logit, as tests/test_export.py measures transformers' reader, and the share of positions whose
argmax agrees); and whether greedy decoding gives the same tokens. With --run DIR, also the trained model of a run
(DIR/final, e.g. outputs/quickstart_sft), whose logits are peaked as a real model's are.

    python scripts/llamacpp_check.py [--run outputs/quickstart_sft] [--new 16] [--out table.md]

Prints one markdown row per file; exits 1 if a file does not load or tokenizes a prompt differently. A prompt with
characters the tokenizer's vocabulary lacks (the shipped one has 99 characters) is left out of the comparison:
transformers gives <unk>, llama.cpp leaves their bytes out. Greedy decoding is reported, not required: on a random
model two logits can be nearer than f16's rounding (the trained model of --run is the fair comparison).
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import gguf_cases  # noqa: E402

from finetune.rank import gguf_file, qat  # noqa: E402
from finetune.config import ASSETS  # noqa: E402
from finetune.families import FAMILIES  # noqa: E402


def hf_greedy(model, ids: list[int], new: int) -> list[int]:
    out = model.generate(torch.tensor([ids]), max_new_tokens=new, do_sample=False, pad_token_id=0, eos_token_id=None,
                         attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    return out[0, len(ids):].tolist()


def llama_greedy(llm, ids: list[int], new: int) -> list[int]:
    llm.reset()
    llm.eval(ids)
    out = []
    for _ in range(new):
        out.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        llm.eval([out[-1]])
    return out


def check(name: str, fmt: str, model, tokenizer_dir: Path, work: Path, new: int) -> dict:
    """One file: export, load in llama.cpp, compare."""
    from llama_cpp import Llama
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    on_grid: frozenset[str] = frozenset()
    if fmt == "q4_0":  # as finetune.export --quantize int4_weight --gguf q4_0 writes it: compared with the 4-bit model
        model = copy.deepcopy(model)
        layers = qat.quantize(model, "int4_weight", 32)
        qat.dequantize(layers, model)
        on_grid = frozenset(f"{n}.weight" for n in layers)
    row = {"file": f"{name} {fmt}", "loads": False}
    try:
        path = gguf_file.write(model, tokenizer_dir, work / f"{name}-{fmt}.gguf", fmt, name, on_grid)
    except ValueError as e:  # the export refuses it too (GPT-2's Conv1D layers are no nn.Linear that torchao quantizes)
        return row | {"error": f"not written: {e}", "ok": True}
    try:
        llm = Llama(model_path=str(path), n_ctx=512, logits_all=True, verbose=False, n_threads=2, seed=0)
    except Exception as e:  # noqa: BLE001 - the row says what llama.cpp said
        row["error"] = str(e).splitlines()[0][:100]
        return row
    row["loads"] = True
    same_tokens = gaps = agree = positions = same_greedy = unknown = 0
    for text in gguf_cases.PROMPTS:
        ours = tok(text, add_special_tokens=False)["input_ids"]
        theirs = llm.tokenize(text.encode(), add_bos=False, special=False)
        if tok.unk_token_id is not None and tok.unk_token_id in ours:  # characters the vocabulary lacks: transformers
            unknown += 1  # gives <unk>, llama.cpp leaves their bytes out (no token for them); not compared
            continue
        same_tokens += ours == theirs
        ids = ([tok.bos_token_id] if tok.bos_token_id is not None else []) + ours
        with torch.no_grad():
            hf = model(torch.tensor([ids])).logits[0].float().numpy()
        llm.reset()
        llm.eval(ids)
        lc = np.asarray(llm.scores[:len(ids)], dtype=np.float32)
        gaps = max(gaps, float(np.abs(lc - hf).max() / max(1.0, np.abs(hf).max())))
        agree += int((lc.argmax(-1) == hf.argmax(-1)).sum())
        positions += len(ids)
        same_greedy += hf_greedy(model, ids, new) == llama_greedy(llm, ids, new)
    n = len(gguf_cases.PROMPTS) - unknown
    row.update(tokens=f"{same_tokens}/{n}" + (f" (+{unknown} out of vocabulary)" if unknown else ""), gap=f"{gaps:.1e}",
               argmax=f"{agree}/{positions}", greedy=f"{same_greedy}/{n}", ok=same_tokens == n)
    del llm
    return row


def cases(work: Path, run: Path | None):
    """(name, model, tokenizer directory) for every file to check."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    shipped = ASSETS / "tokenizer"
    if run is not None:
        yield run.name, AutoModelForCausalLM.from_pretrained(run / "final", dtype=torch.float32).eval(), run / "final"
    for family in FAMILIES:
        if gguf_file.refusal(family) is None:
            torch.manual_seed(0)
            # a wider initialisation than the default 0.02: logits with clear winners, so greedy decoding is a comparison
            # of the computation rather than of rounding between near-equal logits
            yield family, AutoModelForCausalLM.from_config(gguf_cases.tiny_config(family, initializer_range=0.2)).eval(), shipped
    for kind in gguf_cases.KINDS:
        directory = gguf_cases.make(kind, work / kind)
        tok = AutoTokenizer.from_pretrained(directory)
        torch.manual_seed(0)
        config = gguf_cases.tiny_config("llama", vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                                        eos_token_id=tok.eos_token_id, pad_token_id=None, initializer_range=0.2)
        yield f"llama+{kind}", AutoModelForCausalLM.from_config(config).eval(), directory


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", type=Path, help="a run directory whose final/ model is checked too")
    parser.add_argument("--new", type=int, default=16, help="greedy tokens compared per prompt")
    parser.add_argument("--out", type=Path, help="also write the table here")
    args = parser.parse_args()
    import llama_cpp

    lines = [f"llama.cpp through llama-cpp-python {llama_cpp.__version__}; {len(gguf_cases.PROMPTS)} prompts, "
             f"{args.new} greedy tokens each", "",
             "| file | loads | tokens equal | largest logit gap | argmax equal | greedy equal |", "|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for name, model, tokenizer_dir in cases(Path(tmp), args.run):
            for fmt in gguf_file.FORMATS:
                r = check(name, fmt, model, tokenizer_dir, Path(tmp), args.new)
                line = (f"| {r['file']} | yes | {r['tokens']} | {r['gap']} | {r['argmax']} | {r['greedy']} |" if r["loads"]
                        else f"| {r['file']} | no: {r['error']} | | | | |")
                failed += not r.get("ok")
                lines.append(line)
                print(line, flush=True)
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")
    print(f"{failed} file(s) failed" if failed else "every file loads and tokenizes every prompt as the tokenizer does")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
