"""Engine throughput: Tandem against Hugging Face generate, same model, same run.

    python bench/engine_throughput.py [--model smollm2] [--threads 2] [--rounds 3] [--quick]
    python bench/engine_throughput.py --device cuda [--model random:smollm2-135m]

Baseline: transformers' LlamaForCausalLM holding the very weights Tandem
loads, run with `generate` (greedy). Each figure is the best of --rounds runs,
Tandem's and HF's taken in turn. Reported: tokens/s for decode at batch 64
and batch 1 and for a 1,024-token prefill, the ratio to HF, and the fraction
of this machine's roofline (matmul peak and memory read bandwidth, probed in
turn with each case's own rounds, the best probe kept); then a
continuous-batching run (Poisson arrivals, mixed lengths) against HF static
batching, with TTFT and TPOT percentiles. The decode rounds are greedy: where
the CPU has AVX512-BF16, Tandem screens the LM head in bfloat16 (greedy_head.py,
the float32 head's tokens), while the roofline counts the head in float32.
On CUDA (--device cuda) both run in bfloat16 and the roofline is the GPU's bfloat16
matmul peak and HBM read bandwidth (roofline.CudaProbe).
Figures are recorded in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import dataclass, replace

import torch
from counts import count  # bench/ is on sys.path when run as a script
from roofline import (  # bench/ is on sys.path when run as a script
    CudaProbe,
    MachineProbe,
    best_machine,
    decode_roofline,
    figures,
    interleaved,
    matmul_params,
    prefill_flops,
)

from tandem.engine import LLM, SamplingParams
from tandem.engine.model.loader import LoadedModel, load_model
from tandem.engine.model.split_planes import SPLIT_ROWS

# ---------------------------------------------------------------- the models


def hf_model(loaded: LoadedModel):
    import transformers

    config = transformers.LlamaConfig(
        **loaded.config.to_hf_dict(), bos_token_id=None, eos_token_id=None, pad_token_id=0
    )
    model = transformers.LlamaForCausalLM(config).eval()
    model.load_state_dict(dict(loaded.source.iter_weights()), strict=False)
    model.tie_weights()
    return model.to(loaded.device, loaded.dtype)


def token_clock():
    """A LogitsProcessor that notes when generate reaches each token: after that
    token's forward, before it is picked."""
    import transformers

    class Clock(transformers.LogitsProcessor):
        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids, scores):
            self.times.append(time.perf_counter())
            return scores

    return Clock()


def hf_decode_tps(model, prompts, new_tokens: int) -> float:
    """Decode tokens/s: generate N+1 tokens, timed from the first token (the prefill's)
    to the last, as Tandem's steps after its prefill are. (Until the eleventh session:
    a whole generate minus a prefill-only one; on this noisy machine that difference
    swung by seconds, and the best of the rounds kept the luckiest swing.)"""
    import transformers

    ids = torch.tensor(prompts, device=model.device)
    clock = token_clock()
    with torch.inference_mode():
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens + 1,
            min_new_tokens=new_tokens + 1,
            do_sample=False,
            logits_processor=transformers.LogitsProcessorList([clock]),
        )
    if len(clock.times) != new_tokens + 1:
        raise RuntimeError(f"generate made {len(clock.times)} tokens, not {new_tokens + 1}")
    return len(prompts) * new_tokens / (clock.times[-1] - clock.times[0])


def tandem_decode_tps(llm: LLM, prompts, new_tokens: int) -> float:
    engine = llm.engine
    params = SamplingParams(max_tokens=new_tokens + 1, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(
            f"d{i}-{time.monotonic_ns()}", prompt_token_ids=prompt, sampling_params=params
        )
    engine.step()  # the prefill
    start = time.perf_counter()
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    assert steps == new_tokens
    return len(prompts) * new_tokens / (time.perf_counter() - start)


def tandem_prefill_seconds(llm: LLM, prompt: list[int]) -> float:
    engine = llm.engine
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    engine.add_request(f"p-{time.monotonic_ns()}", prompt_token_ids=prompt, sampling_params=params)
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - start


def hf_prefill_seconds(model, prompt: list[int]) -> float:
    """HF's forward over the prompt, the last token's logits only (as generate runs it)."""
    ids = torch.tensor([prompt], device=model.device)
    with torch.inference_mode():
        start = time.perf_counter()
        model(ids, logits_to_keep=1)
        if ids.is_cuda:  # the launch is asynchronous: time the GPU's work done
            torch.cuda.synchronize(ids.device)
    return time.perf_counter() - start


# --------------------------------------------------------- continuous batching


@dataclass
class Arrival:
    at: float  # seconds after the start
    prompt: list[int]
    output_len: int


def poisson_workload(n: int, rate: float, vocab: int, seed: int = 0) -> list[Arrival]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(32, 256))]
        out.append(Arrival(t, prompt, rng.randint(16, 96)))
    return out


@dataclass
class Served:
    ttft: list[float]
    tpot: list[float]
    tokens: int
    seconds: float

    def row(self, name: str) -> str:
        p = _percentiles
        return (
            f"{name:<22} {self.tokens / self.seconds:>8.1f} "
            f"{p(self.ttft, 50):>9.2f} {p(self.ttft, 90):>9.2f} "
            f"{p(self.tpot, 50) * 1e3:>9.1f} {p(self.tpot, 90) * 1e3:>9.1f}"
        )


def _percentiles(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if values else 0.0


def tandem_continuous(llm: LLM, workload: list[Arrival]) -> Served:
    engine = llm.engine
    start = time.perf_counter()
    pending = list(workload)
    first: dict[str, float] = {}
    arrival: dict[str, float] = {}
    ttft, tpot, tokens = [], [], 0
    while pending or engine.has_unfinished_requests():
        now = time.perf_counter() - start
        while pending and pending[0].at <= now:
            a = pending.pop(0)
            rid = f"c{len(arrival)}-{time.monotonic_ns()}"
            params = SamplingParams(max_tokens=a.output_len, temperature=0.0, ignore_eos=True)
            engine.add_request(rid, prompt_token_ids=a.prompt, sampling_params=params)
            arrival[rid] = a.at
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, pending[0].at - now))
            continue
        for out in engine.step():
            t = time.perf_counter() - start
            if out.request_id not in first and out.new_token_ids:
                first[out.request_id] = t
                ttft.append(t - arrival[out.request_id])
            if out.finished:
                tokens += out.num_output_tokens
                if out.num_output_tokens > 1:
                    tpot.append((t - first[out.request_id]) / (out.num_output_tokens - 1))
    return Served(ttft, tpot, tokens, time.perf_counter() - start)


def hf_static(model, workload: list[Arrival], max_batch: int) -> Served:
    """HF generate over static batches: whatever has arrived, up to max_batch, left-padded."""
    import transformers

    start = time.perf_counter()
    pending = list(workload)
    ttft, tpot, tokens = [], [], 0
    while pending:
        now = time.perf_counter() - start
        if pending[0].at > now:
            time.sleep(pending[0].at - now)
            continue
        batch = [a for a in pending[:max_batch] if a.at <= now]
        del pending[: len(batch)]
        width = max(len(a.prompt) for a in batch)
        ids = torch.tensor([[0] * (width - len(a.prompt)) + a.prompt for a in batch])
        mask = torch.tensor([[0] * (width - len(a.prompt)) + [1] * len(a.prompt) for a in batch])
        ids, mask = ids.to(model.device), mask.to(model.device)
        clock = token_clock()
        new = max(a.output_len for a in batch)
        with torch.inference_mode():
            model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                logits_processor=transformers.LogitsProcessorList([clock]),
            )
        for a in batch:
            times = [t - start for t in clock.times[: a.output_len]]
            ttft.append(times[0] - a.at)
            if len(times) > 1:
                tpot.append((times[-1] - times[0]) / (len(times) - 1))
            tokens += a.output_len
    return Served(ttft, tpot, tokens, time.perf_counter() - start)


# ---------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="fewer tokens, for a smoke run")
    parser.add_argument("--rounds", type=count, default=3, help="best of, for each measure")
    parser.add_argument(
        "--enforce-eager", action="store_true", help="on CUDA: decode steps without CUDA graphs"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    new_tokens = 8 if args.quick else 32
    rng = random.Random(0)

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    probe = MachineProbe() if device.type == "cpu" else CudaProbe(device, dtype)
    machine = best_machine([probe.measure() for _ in range(5)])
    print(
        f"machine: {'fp32' if dtype == torch.float32 else 'bf16'} matmul "
        f"{machine.matmul_flops / 1e9:.0f} GFLOP/s, read {machine.read_bytes / 1e9:.1f} GB/s, "
        f"{args.threads} threads"
    )
    loaded = load_model(args.model, dtype=dtype, device=device)
    config = loaded.config
    graphs = False if args.enforce_eager else None  # None: on CUDA (decode_graphs.py)
    llm = LLM(loaded, max_model_len=2048, enable_prefix_caching=False, decode_graphs=graphs)
    hf = hf_model(loaded)
    if llm.engine.runner.model.greedy_head is not None:
        print("greedy LM head: screened in bfloat16 (the roofline counts it in float32)")

    def prompts(batch: int, length: int) -> list[list[int]]:
        return [[rng.randrange(config.vocab_size) for _ in range(length)] for _ in range(batch)]

    # Each case's roofline comes from probes taken in turn with its own rounds: this
    # machine's speed drifts by 5-15 % over minutes, and a peak from another stretch
    # would move the fraction by as much.
    print(
        f"\n{'case':<28} {'tandem':>9} {'hf':>9} {'ratio':>7} {'roofline':>9} {'of roof':>8}"
        f" {'GFLOP/s':>8} {'GB/s':>6}"
    )
    # What a step streams of the weights, where it is not the float32 panels: narrow
    # panels for up to SPLIT_ROWS rows, split planes' codes past that (AMX), and the LM
    # head in bfloat16 where the greedy head screens it.
    model = llm.engine.runner.model
    decoder = model.packed_decoder
    head_bytes = config.vocab_size * config.hidden_size * (2 if model.greedy_head else 4)
    float32_bytes = matmul_params(config) * 4
    streamed = {}
    if decoder is not None:
        for batch in (64, 1):
            weights = decoder.weight_bytes(batch) + head_bytes
            if weights < float32_bytes * 0.9:
                streamed[batch] = weights
    split = decoder is not None and decoder.on_tiles()
    if split:
        print(
            f"products of more than {SPLIT_ROWS} rows: float32 on AMX tiles from the codes"
            " (split planes)"
        )
    narrow_shares, fma_shares = [], []
    for batch in (64, 1):
        batch_prompts = prompts(batch, 64)
        ours, theirs, probes = interleaved(
            args.rounds,
            lambda: tandem_decode_tps(llm, batch_prompts, new_tokens),  # noqa: B023
            lambda: hf_decode_tps(hf, batch_prompts, new_tokens),  # noqa: B023
            probe.measure,
        )
        ours, theirs, window = max(ours), max(theirs), best_machine(probes)
        roof = decode_roofline(
            config, window, batch, 64 + new_tokens // 2, element_bytes=dtype.itemsize
        )
        print(
            f"{f'decode batch {batch} (tok/s)':<28} {ours:>9.1f} {theirs:>9.1f} "
            f"{ours / theirs:>6.2f}x {roof:>9.1f} {ours / roof:>7.0%} {figures(window)}"
        )
        if split:  # the share the FMA units' peak alone would give
            fma = decode_roofline(
                config, replace(window, matmul_flops=window.fma_flops), batch, 64 + new_tokens // 2
            )
            fma_shares.append(f"batch {batch} {ours / fma:.0%}")
        if batch in streamed:
            narrow = decode_roofline(config, window, batch, 64 + new_tokens // 2, streamed[batch])
            megabytes = streamed[batch] / 1e6
            narrow_shares.append(
                f"batch {batch} {megabytes:.0f} MB, {narrow:.1f} tok/s ({ours / narrow:.0%})"
            )
    if narrow_shares:
        print(
            f"  (the steps stream fewer bytes of weights than the {float32_bytes / 1e6:.0f} MB "
            f"of float32; the roofline counting those: {'; '.join(narrow_shares)})"
        )
    prompt = prompts(1, 1024)[0]
    ours, theirs, probes = interleaved(
        args.rounds,
        lambda: tandem_prefill_seconds(llm, prompts(1, 1024)[0]),  # new: no cache hit
        lambda: hf_prefill_seconds(hf, prompt),
        probe.measure,
    )
    ours, theirs, window = min(ours), min(theirs), best_machine(probes)
    peak_share = prefill_flops(config, 1024) / ours / window.matmul_flops
    print(
        f"{'prefill 1024 (tok/s)':<28} {1024 / ours:>9.1f} {1024 / theirs:>9.1f} "
        f"{theirs / ours:>6.2f}x {'':>9} {peak_share:>7.0%} {figures(window)}"
    )
    hf_share = prefill_flops(config, 1024) / theirs / window.matmul_flops
    print(f"  (HF prefill reaches {hf_share:.0%} of the matmul peak)")
    if split:
        fma_shares.append(f"prefill {prefill_flops(config, 1024) / ours / window.fma_flops:.0%}")
        print(
            f"  (against the FMA units' peak alone, {window.fma_flops / 1e9:.0f} GFLOP/s, "
            f"without the split planes: {', '.join(fma_shares)})"
        )

    n, rate = (16, 16.0) if args.quick else (48, 3.0)
    workload = poisson_workload(n, rate, config.vocab_size)
    print(f"\ncontinuous batching: {n} requests, Poisson {rate}/s, prompts 32-256, outputs 16-96")
    heads = ("tok/s", "TTFT p50", "TTFT p90", "TPOT p50", "TPOT p90")
    print(f"{'server':<22} " + " ".join(f"{h:>{8 if h == 'tok/s' else 9}}" for h in heads))
    tandem = tandem_continuous(llm, workload)
    static = hf_static(hf, workload, max_batch=16)
    if llm.engine.runner.decode_graphs is not None:
        shapes = llm.engine.runner.decode_graphs.shapes
        print(f"decode graphs recorded in the whole run: {len(shapes)} of (seqs, queries, width)")
    print(tandem.row("tandem (continuous)"))
    print(static.row("hf generate (static)"))
    print(
        f"throughput ratio {tandem.tokens / tandem.seconds / (static.tokens / static.seconds):.2f}x"
        " (TTFT in s, TPOT in ms)"
    )


if __name__ == "__main__":
    main()
