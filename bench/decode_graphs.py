"""Decode on a GPU: steps replayed from CUDA graphs against the same engine op by op.

    python bench/decode_graphs.py [--model random:smollm2-135m] [--new-tokens 80]
        [--batches 1 64] [--drafts 0 3] [--prompt-tokens 64]

Baseline: the same LLM over the same loaded weights with decode_graphs=False (every
step launched op by op, as before decode_graphs.py). For each number of n-gram
drafts and each batch: tokens/s of the batch generating --new-tokens tokens each,
prefill included, the second of two runs (the first records the graphs' shapes).
Prompts of --prompt-tokens random tokens; with drafts, one 8-token phrase
repeated to that length, which a random model tends to continue in a loop: most
drafts are accepted, an upper bound on what speculation gives. bfloat16. Figures
are recorded in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from tandem.engine import LLM, SamplingParams
from tandem.engine.model.loader import load_model


def tokens_per_second(llm: LLM, prompts: list[list[int]], new_tokens: int) -> tuple[float, int]:
    """The batch's tokens/s from the first request added to the last token, and steps."""
    engine = llm.engine
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        rid = f"b{i}-{time.monotonic_ns()}"
        engine.add_request(rid, prompt_token_ids=prompt, sampling_params=params)
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    return len(prompts) * new_tokens / (time.perf_counter() - start), steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random:smollm2-135m")
    parser.add_argument("--new-tokens", type=int, default=80)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--drafts", type=int, nargs="+", default=[0, 3])
    parser.add_argument("--prompt-tokens", type=int, default=64)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("decode graphs are recorded on a CUDA device; this machine has none")
    loaded = load_model(args.model, dtype="bfloat16", device="cuda")
    vocab = loaded.config.vocab_size
    rng = random.Random(0)

    length = args.prompt_tokens

    def prompts(batch: int, drafts: int) -> list[list[int]]:
        if drafts:
            phrases = [[rng.randrange(vocab) for _ in range(8)] for _ in range(batch)]
            return [(p * -(-length // 8))[:length] for p in phrases]
        return [[rng.randrange(vocab) for _ in range(length)] for _ in range(batch)]

    print(f"{'drafts':>6} {'batch':>5} {'op by op':>9} {'graphs':>9} {'ratio':>6}  (tok/s)")
    for drafts in args.drafts:
        speeds: dict[int, list[float]] = {batch: [] for batch in args.batches}
        for graphs in (False, True):
            llm = LLM(
                loaded,
                max_model_len=2048,
                enable_prefix_caching=False,
                decode_graphs=graphs,
                num_speculative_tokens=drafts,
            )
            for batch in args.batches:
                tokens_per_second(llm, prompts(batch, drafts), args.new_tokens)  # records
                tps, _ = tokens_per_second(llm, prompts(batch, drafts), args.new_tokens)
                speeds[batch].append(tps)
            totals = llm.engine.totals
            if drafts and graphs:
                accepted = totals.drafts_accepted / max(totals.drafts_proposed, 1)
                print(f"  ({drafts} drafts: {accepted:.0%} accepted)")
            del llm
        for batch, (eager, graphed) in speeds.items():
            print(f"{drafts:>6} {batch:>5} {eager:>9.0f} {graphed:>9.0f} {graphed / eager:>5.1f}x")


if __name__ == "__main__":
    main()
