"""Narrow panels and split planes: products and decode steps from a checkpoint's codes,
against float32 panels.

    python bench/narrow_panels.py [--model smollm2] [--threads 2] [--rounds 4] [--quick]

Baseline: the same engine and model with the float32 panels alone (the narrow
panels dropped from the packed decoder and the LM head), in the same process. A
GGUF model's quantised projections keep their codes beside the float32 panels, and
products of few rows widen them in the kernel (coded_weight.py, up to
csrc/panel_linear.cpp's WIDEN_ROWS, 32); where the CPU has AMX, products of more than
SPLIT_ROWS run on its tiles from the same codes (split_planes.py,
csrc/split_linear.cpp). This measures what both buy, two ways:
- the model's own products, a layer's four chained through all its layers, by rows:
  the packed decoder's kernels for that many rows (split planes past SPLIT_ROWS where
  there are any, else narrow panels widened up to 32 rows) against float32 panels;
- decode steps, paired: narrow then float32 (or the reverse) each round, at batch 1
  greedy, batch 1 sampled (the LM head's full logits from its codes) and batch 64.
Figures are recorded in docs/benchmarks.md ("Narrow panels").
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import time

import torch
from counts import count  # bench/ is on sys.path when run as a script

from tandem.engine import LLM, SamplingParams
from tandem.engine.model.loader import load_model
from tandem.engine.model.packed_decoder import PackedDecoder
from tandem.engine.model.split_planes import SPLIT_ROWS


def chained_products_ms(decoder: PackedDecoder, rows: int, rounds: int) -> float:
    """Best time of every layer's four products, each fed a fixed input of `rows` rows."""
    first, large = decoder.layers[0], rows > SPLIT_ROWS
    hidden = torch.randn(rows, first.qkv[0][1][0].shape[1]) / 8  # panels [P, in, columns]
    inner = torch.randn(rows, first.down[0][1][0].shape[1]) / 8
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for layer in decoder.layers:
            for kernels, x in (
                (layer.qkv, hidden),
                (layer.o, hidden),
                (layer.gated, hidden),
                (layer.down, inner),
            ):
                linear, args = kernels[large]
                linear(x, *args)
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def decode_tps(
    llm: LLM, batch: int, new_tokens: int, temperature: float, rng, prompt_tokens: int = 64
) -> float:
    engine, vocab = llm.engine, llm.engine.config.vocab_size
    params = SamplingParams(
        max_tokens=new_tokens + 1, temperature=temperature, seed=1, ignore_eos=True
    )
    for i in range(batch):
        prompt = [rng.randrange(vocab) for _ in range(prompt_tokens)]
        engine.add_request(
            f"n{i}-{time.monotonic_ns()}", prompt_token_ids=prompt, sampling_params=params
        )
    engine.step()  # the prefill, not timed
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return batch * new_tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=count, default=4)
    parser.add_argument("--quick", action="store_true", help="fewer steps and sizes (tests)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model, dtype="float32", device="cpu")
    model = loaded.model
    narrow = model.packed_decoder
    if narrow is None or narrow.narrow_bytes() is None:
        raise SystemExit(f"{args.model}: its projections have no narrow panels to measure")
    wide = narrow.float32_only()
    head_narrow = model.lm_head.packed
    head_wide = dataclasses.replace(head_narrow, narrow=None, split=None)
    split = narrow.on_tiles()
    print(
        f"{args.model}: narrow panels {narrow.narrow_bytes() / 1e6:.0f} MB, {args.threads} threads;"
        f" products of more than {SPLIT_ROWS} rows on "
        + ("split planes (AMX)" if split else "the float32 panels (no AMX here)")
    )

    print(f"\n{'rows':>5} {'narrow ms':>10} {'float32 ms':>11} {'ratio':>7}")
    with torch.inference_mode():
        for rows in (1, 32, 64) if args.quick else (1, 8, 16, 32, 48, 64, 1024):
            ours = chained_products_ms(narrow, rows, args.rounds)
            theirs = chained_products_ms(wide, rows, args.rounds)
            print(f"{rows:>5} {ours:>10.2f} {theirs:>11.2f} {theirs / ours:>6.2f}x")

    llm = LLM(loaded, max_model_len=2048, enable_prefix_caching=False)
    rng = random.Random(0)
    # Quick: short prompts too, as the batch-64 prefills took most of a quick run.
    new_tokens, prompt_tokens = (4, 16) if args.quick else (32, 64)
    print(f"\n{'decode (tok/s, medians)':<28} {'narrow':>8} {'float32':>8}  paired ratios")
    for name, batch, temperature in (
        ("batch 1 greedy", 1, 0.0),
        ("batch 1 sampled", 1, 0.8),
        ("batch 64 greedy", 64, 0.0),
    ):
        decode_tps(llm, batch, 2, temperature, rng, prompt_tokens)  # warm
        tps = {"narrow": [], "float32": []}
        for r in range(args.rounds):
            order = ("narrow", "float32") if r % 2 == 0 else ("float32", "narrow")
            for which in order:
                model.packed_decoder = narrow if which == "narrow" else wide
                model.lm_head.packed = head_narrow if which == "narrow" else head_wide
                tps[which].append(
                    decode_tps(llm, batch, new_tokens, temperature, rng, prompt_tokens)
                )
        ratios = [a / b for a, b in zip(tps["narrow"], tps["float32"], strict=True)]
        print(
            f"{name:<28} {statistics.median(tps['narrow']):>8.1f} "
            f"{statistics.median(tps['float32']):>8.1f}  " + " ".join(f"{r:.3f}" for r in ratios)
        )
    model.packed_decoder, model.lm_head.packed = narrow, head_narrow


if __name__ == "__main__":
    main()
