"""Data at scale on this machine: one Markdown table of tokenizing, caching, start-up, RAM and packing.

    python scripts/benchmark_data.py                          # 1k, 10k, 100k conversations
    python scripts/benchmark_data.py --sizes 1000000 --no-baseline   # the 1M row, by hand (minutes)

Everything is made here, with no download: N synthetic multi-turn conversations (chat rows of random
pseudo-words), and a BPE tokenizer (8k vocabulary) with a chat template, trained by `tokenizers` on them.
Per N, each measured in a fresh process:
- in memory (before the cache; `data.cache=false`): finetune.data.examples.load_split, rows/s on one core;
- first preparation: finetune.data.cache (what `python -m finetune.prepare` and a first launch run),
  `datasets.map` over every core, with the Arrow files written: seconds, rows/s and rows/s per core;
- cached start: a new process that finds the cache entry (hashing the data file for the key) and
  opens it: seconds from its start to the data being ready, imports included;
- RSS per rank: 2 processes reading their share of 20 steps of batches (dp_size=2), from the cache vs
  in memory (each rank tokenizing everything, as before the cache): the peak (ru_maxrss), and the
  private part (RssAnon). A cached rank's RSS also counts the pages of the memory-mapped Arrow file it
  has touched: page cache, shared by the node's ranks and dropped by the kernel under pressure;
- packing: first fit over the N samples plus building the packed Arrow rows.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORDS = 3000
TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'user' %}<|user|>{{ m['content'] }}\n"
            "{% elif m['role'] == 'assistant' %}<|assistant|>{{ m['content'] }}</s>{% else %}<|system|>{{ m['content'] }}\n{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def make_rows(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    vocab = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) for _ in range(WORDS)]
    weights = [1 / (rank + 1) for rank in range(WORDS)]  # Zipf, as words in text are
    cumulative = list(itertools.accumulate(weights))
    rows = []
    for _ in range(n):
        messages = []
        for _turn in range(rng.randint(1, 3)):
            messages.append({"role": "user", "content": " ".join(rng.choices(vocab, cum_weights=cumulative, k=rng.randint(8, 60)))})
            messages.append({"role": "assistant", "content": " ".join(rng.choices(vocab, cum_weights=cumulative, k=rng.randint(10, 120)))})
        rows.append({"messages": messages})
    return rows


def make_tokenizer(rows: list[dict], out: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=8000, special_tokens=["<unk>", "<s>", "</s>", "<pad>", "<|user|>", "<|assistant|>", "<|system|>"])
    tok.train_from_iterator((m["content"] for r in rows[:5000] for m in r["messages"]), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>")
    fast.chat_template = TEMPLATE
    fast.save_pretrained(out)


CHILD = r'''
import json, os, resource, sys, time
t0 = time.perf_counter()
from transformers import AutoTokenizer
from finetune.config import DataConfig
from finetune.data.batches import TrainBatches
from finetune.data.examples import load_split
spec = json.loads(sys.argv[1])
cfg = DataConfig(train=spec["train"], max_length=1024, cache_dir=spec["cache"], num_proc=spec.get("num_proc"), packing=spec.get("packing", False))
tok = AutoTokenizer.from_pretrained(spec["tokenizer"])
out = {}
if spec["what"] == "memory":
    t = time.perf_counter(); train, _, _ = load_split(cfg, tok, 0, "sft"); out["seconds"] = time.perf_counter() - t
else:
    from finetune.data import cache
    t = time.perf_counter()
    train, *_ = cache.load(cfg, tok, 0, "sft", builder=spec["what"] == "build", progress=False, say=lambda line: None)
    out["seconds"] = time.perf_counter() - t
out["since_start"] = time.perf_counter() - t0
if spec.get("steps"):
    batches = TrainBatches(train, global_batch=16, micro_batch=4, dp_rank=spec["rank"], dp_size=2, seed=0, pad_id=0)
    for step in range(spec["steps"]):
        batches.micro_batches(step)
out["rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
status = dict(line.split(":", 1) for line in open("/proc/self/status") if ":" in line)
out["anon_mib"] = int(status["RssAnon"].split()[0]) / 1024  # private memory; the rest of RSS is shared file pages
print(json.dumps(out))
'''


def child(spec: dict) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, json.dumps(spec)], capture_output=True, text=True,
                          env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    if done.returncode:
        raise SystemExit(f"benchmark child failed ({spec['what']}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def two_ranks(spec: dict) -> tuple[float, float]:
    """(peak RSS, private RSS) of the larger of 2 ranks, in MiB."""
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, json.dumps({**spec, "rank": r, "steps": 20})], stdout=subprocess.PIPE,
                              text=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"}) for r in range(2)]
    outs = [json.loads(p.communicate()[0].strip().splitlines()[-1]) for p in procs]
    return max(o["rss_mib"] for o in outs), max(o["anon_mib"] for o in outs)


def packing_seconds(spec: dict) -> float:
    from finetune.data import cache

    train = cache.open_split(next(Path(spec["cache"]).glob("*/train.arrow")))
    t = time.perf_counter()
    cache.pack_split(train.table, 1024, seed=0)
    return time.perf_counter() - t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000, 100000])
    parser.add_argument("--no-baseline", action="store_true", help="skip the in-memory columns (slow at large N)")
    parser.add_argument("--out", type=Path, default=None, help="also write the table here")
    args = parser.parse_args()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    lines = [f"Data benchmark: {cores} cores, synthetic chat rows (1-3 turns, ~200 tokens), 8k BPE tokenizer, max_length 1024.", "",
             "| conversations | in memory rows/s (1 core) | first preparation s | rows/s | rows/s/core | cached start s (data ready, imports incl.) "
             "| RSS/rank in memory MiB (private) | RSS/rank cached MiB (private) | packing s |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        rows = make_rows(max(args.sizes))
        make_tokenizer(rows, root / "tokenizer")
        for n in args.sizes:
            path = root / f"train_{n}.jsonl"
            with open(path, "w") as f:
                for row in rows[:n]:
                    f.write(json.dumps(row) + "\n")
            spec = {"train": str(path), "tokenizer": str(root / "tokenizer"), "cache": str(root / f"cache_{n}"), "num_proc": cores}
            memory = None if args.no_baseline else child({**spec, "what": "memory"})
            built = child({**spec, "what": "build"})
            cached = child({**spec, "what": "cached"})
            rss_cached = two_ranks({**spec, "what": "cached"})
            rss_memory = None if args.no_baseline else two_ranks({**spec, "what": "memory"})
            rss = lambda pair: f"{pair[0]:,.0f} ({pair[1]:,.0f})" if pair else "-"  # noqa: E731
            packing = packing_seconds(spec)
            rate = n / built["seconds"]
            cells = [f"{n:,}", f"{n / memory['seconds']:,.0f}" if memory else "-", f"{built['seconds']:.1f}", f"{rate:,.0f}",
                     f"{rate / cores:,.0f}", f"{cached['since_start']:.1f}", rss(rss_memory), rss(rss_cached), f"{packing:.2f}"]
            lines.append("| " + " | ".join(cells) + " |")
            print(lines[-1], file=sys.stderr, flush=True)
    table = "\n".join(lines)
    print(table)
    if args.out:
        args.out.write_text(table + "\n")


if __name__ == "__main__":
    main()
