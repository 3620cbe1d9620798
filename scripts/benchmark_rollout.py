"""GRPO's rollout against transformers' own `model.generate` with its KV cache, on the same batch.

    python scripts/benchmark_rollout.py                              # CPU, a tiny Llama (h 256, 4 blocks), 16 x 8 rows
    python scripts/benchmark_rollout.py --device cuda --dtype bf16 --hidden 1024 --layers 8

The rollout (finetune.methods.sampling.sample: left-padded prompts, G completions each, seeded sampling through the
engine's inference, completions cut after EOS) and a plain `model.generate(..., num_return_sequences=G)` call
sample the same number of tokens from the same prompts (min_new_tokens = max_new_tokens, so neither stops early);
each is timed as the median of --repeats (interleaved) after one warm-up. Prints generated tokens per second of each and
their ratio (the rollout's per-token cost over generate's: 1.0 is the same). --vllm adds GRPO's rollout through vLLM
(method.vllm: finetune.methods.vllm_rollout, GPU; its rate counts the tokens it sampled, since it may stop at EOS).
"""

from __future__ import annotations

import argparse
import statistics
import time


class Engine:
    """What the rollout reads of an engine, on one process: the model to generate with, in eval mode."""

    lockstep, dp_rank = False, 0

    def __init__(self, model, dtype):
        self.generation_model, self.dtype = model, dtype

    def inference(self, fn, batch):
        import torch

        self.generation_model.eval()
        device = next(self.generation_model.parameters()).device
        with torch.autocast(device.type, dtype=self.dtype, enabled=self.dtype != torch.float32):
            return fn(self.generation_model, {k: v.to(device) for k, v in batch.items()})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--vllm", action="store_true", help="also GRPO's rollout through vLLM (needs vLLM and a GPU)")
    args = parser.parse_args(argv)

    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from finetune.config import ASSETS
    from finetune.methods.grpo import GrpoConfig
    from finetune.methods.sampling import sample

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(ASSETS / "tokenizer")
    config = LlamaConfig(vocab_size=len(tok), hidden_size=args.hidden, intermediate_size=3 * args.hidden, num_hidden_layers=args.layers,
                         num_attention_heads=4, num_key_value_heads=4, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    model = LlamaForCausalLM(config).to(args.device).eval()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    prompts = [[int(t) for t in torch.randint(5, len(tok), (args.prompt_tokens,))] for _ in range(args.prompts)]
    cfg = GrpoConfig(generations=args.generations, completion_tokens=args.new_tokens)
    model.generation_config.min_new_tokens = args.new_tokens  # both sample exactly new_tokens per row
    engine = Engine(model, dtype)
    ids = torch.tensor(prompts, device=args.device)

    def rollout() -> None:
        sample(engine, prompts, cfg, tok, seed=(0, 1, 0, 0))

    def generate() -> None:
        with torch.no_grad(), torch.autocast(ids.device.type, dtype=dtype, enabled=dtype != torch.float32):
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, top_k=0, max_new_tokens=args.new_tokens,
                           num_return_sequences=args.generations, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)

    tokens = {name: args.prompts * args.generations * args.new_tokens for name in ("model.generate", "grpo rollout", "vllm rollout")}
    runs = {"model.generate": generate, "grpo rollout": rollout}
    if args.vllm:
        from finetune.methods.vllm_rollout import VllmSampler

        sampler = VllmSampler(engine, tok, GrpoConfig(generations=args.generations, completion_tokens=args.new_tokens,
                                                        vllm=True, vllm_memory=0.3), prompt_tokens=args.prompt_tokens)
        sampler.sync(engine)

        def through_vllm() -> None:
            tokens["vllm rollout"] = sum(map(len, sample(engine, prompts, cfg, tok, seed=(0, 1, 0, 0), vllm=sampler)))

        runs["vllm rollout"] = through_vllm
    times: dict[str, list[float]] = {name: [] for name in runs}
    for fn in runs.values():
        fn()  # warm-up
    for _ in range(args.repeats):  # interleaved, so that a busy machine slows both alike
        for name, fn in runs.items():
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            tic = time.perf_counter()
            fn()
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - tic)
    rates = {name: tokens[name] / statistics.median(t) for name, t in times.items()}
    print(f"| rows | new tokens | {' | '.join(rates)} | rollout / generate |" + (" vllm / generate |" if args.vllm else ""))
    print(f"| {args.prompts} x {args.generations} | {args.new_tokens} | "
          + " | ".join(f"{r:,.0f} tokens/s" for r in rates.values())
          + f" | {rates['grpo rollout'] / rates['model.generate']:.2f}x |"
          + (f" {rates['vllm rollout'] / rates['model.generate']:.2f}x |" if args.vllm else ""))


if __name__ == "__main__":
    main()
