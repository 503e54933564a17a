"""CostModel: how long one engine step takes on a device, from a roofline.

    step = max(C, M) + (1 - overlap) x min(C, M)
           + tensor-parallel all-reduces + fixed and per-sequence overhead
    C = FLOPs / achieved FLOP/s,  M = bytes / achieved bandwidth

On a GPU overlap is 1: the roofline's max(). On this CPU it is 0 (one thread
computes and streams in turn), and a step of more than one token reads the
weights `repack_passes` more times (BLAS packs them per call).

FLOPs: 2 per weight per token through the body, 2 per LM-head weight per
sampled row (the runner computes logits only for rows it samples), and
attention: 4 x layers x heads x head_dim per (query, key) pair, causal inside a
prompt chunk. Bytes: the weights once per step (a MoE reads the experts its
tokens touch), the cached KV every sequence attends to, and the KV written.
Prefill (chunks with their cached context) and decode (batch, drafts,
contexts) go through the same formula with different inputs (StepInputs).
Tensor parallelism splits FLOPs and bytes over `tp` devices and adds two
all-reduces per layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from operator import attrgetter

from tandem.engine.plan import StepPlan
from tandem.sim.devices import Device
from tandem.sim.model_shapes import ModelShape

_start_pos = attrgetter("start_pos")


@dataclass(frozen=True)
class StepInputs:
    """What a step computes, independent of the device."""

    tokens: int
    # Rows that get logits (the last prompt token of a finished prompt; every decode row).
    sampled: int
    # (query, key) pairs attention computes.
    attention_pairs: int
    # Cached tokens whose KV the step reads.
    kv_read_tokens: int
    seqs: int

    @classmethod
    def prefill(cls, chunks: Sequence[int], cached: Sequence[int] | None = None) -> StepInputs:
        """One chunk per sequence, each after `cached` tokens of context; all sample."""
        cached = list(cached) if cached is not None else [0] * len(chunks)
        if len(cached) != len(chunks):
            raise ValueError("chunks and cached must have one entry per sequence")
        if any(n < 1 for n in chunks) or any(s < 0 for s in cached):
            raise ValueError("chunks must be >= 1 token and cached >= 0")
        pairs = sum(n * s + n * (n + 1) // 2 for n, s in zip(chunks, cached, strict=True))
        return cls(sum(chunks), len(chunks), pairs, sum(cached), len(chunks))

    @classmethod
    def decode(cls, contexts: Sequence[int], drafts: int = 0) -> StepInputs:
        """Each sequence's last token plus `drafts` drafts, after `contexts` cached tokens."""
        if drafts < 0 or any(c < 0 for c in contexts):
            raise ValueError("drafts and contexts must be >= 0")
        n, seqs = 1 + drafts, len(contexts)
        pairs = sum(n * c + n * (n + 1) // 2 for c in contexts)
        return cls(n * seqs, n * seqs, pairs, sum(contexts), seqs)


@dataclass(frozen=True)
class StepCost:
    """One step's time, split by what bounds it (seconds)."""

    compute_s: float
    memory_s: float
    comm_s: float
    overhead_s: float
    # Share of the shorter of compute and memory hidden under the longer (Device.overlap).
    overlap: float = 1.0

    @property
    def total_s(self) -> float:
        c, m = self.compute_s, self.memory_s
        return max(c, m) + (1.0 - self.overlap) * min(c, m) + self.comm_s + self.overhead_s

    @property
    def bound(self) -> str:
        return "compute" if self.compute_s >= self.memory_s else "memory"


def tensor_parallel_sizes(shape: ModelShape, device: Device) -> list[int]:
    """The tensor-parallel sizes an engine of `shape` runs with on `device`, as vLLM
    allows them: attention heads split evenly, KV heads split evenly or each one
    replicated over tp / kv ranks, all within one node."""
    heads, kv = shape.config.num_attention_heads, shape.config.num_key_value_heads
    return [
        tp
        for tp in range(1, device.gpus_per_node + 1)
        if heads % tp == 0 and (kv % tp == 0 or tp % kv == 0)
    ]


@dataclass(frozen=True)
class CostModel:
    device: Device
    shape: ModelShape
    # Devices one engine spans with tensor parallelism.
    tp: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.tp, bool) or not isinstance(self.tp, int) or self.tp < 1:
            raise ValueError(f"tp must be an integer >= 1, got {self.tp!r}")
        if self.tp > 1 and self.device.link_bandwidth <= 0:
            raise ValueError(f"tp={self.tp} needs a device with link_bandwidth (an interconnect)")
        sizes = tensor_parallel_sizes(self.shape, self.device)
        if self.tp not in sizes:
            c, dev = self.shape.config, self.device
            raise ValueError(
                f"--tp {self.tp}: {self.shape.name} on {dev.name} takes --tp "
                f"{', '.join(map(str, sizes))} (its {c.num_attention_heads} attention heads and "
                f"{c.num_key_value_heads} KV heads split evenly, over at most the "
                f"{dev.gpus_per_node} devices of one node)"
            )

    # ------------------------------------------------------------ capacity

    @property
    def kv_capacity_bytes(self) -> float:
        usable = self.tp * self.device.memory_bytes * self.device.usable_memory_fraction
        return usable - self.shape.weight_bytes

    def kv_blocks(self, block_size: int) -> int:
        """KV blocks of `block_size` tokens the engine's memory holds after the weights."""
        blocks = int(self.kv_capacity_bytes // (self.shape.kv_bytes_per_token * block_size))
        if blocks < 1:
            raise ValueError(
                f"{self.shape.name} needs {self.shape.weight_bytes / 1e9:.1f} GB of weights; "
                f"{self.tp} x {self.device.name} leave no room for a KV cache: raise tp"
            )
        return blocks

    # ---------------------------------------------------------------- steps

    def work(self, step: StepInputs) -> tuple[float, float]:
        """(FLOPs, bytes) of a step on the whole engine, before the tensor-parallel split."""
        shape = self.shape
        flops = (
            2.0 * shape.body_params * step.tokens
            + 2.0 * shape.lm_head_params * step.sampled
            + shape.attention_flops_per_pair * step.attention_pairs
        )
        kv_bytes = shape.kv_bytes_per_token * (step.kv_read_tokens + step.tokens)
        weights = shape.weight_bytes_read(step.tokens)
        if step.tokens > 1:
            weights *= 1.0 + self.device.repack_passes
        return flops, weights + kv_bytes

    def cost(self, step: StepInputs) -> StepCost:
        dev, tp = self.device, self.tp
        flops, memory = self.work(step)
        comm = 0.0
        if tp > 1 and step.tokens:
            # Two all-reduces per layer of the tokens' hidden states (ring: 2(tp-1)/tp).
            cfg = self.shape.config
            size = step.tokens * cfg.hidden_size * self.shape.dtype_bytes * 2 * (tp - 1) / tp
            comm = 2 * cfg.num_hidden_layers * (dev.link_latency_s + size / dev.link_bandwidth)
        overhead = dev.step_overhead_s + dev.seq_overhead_s * step.seqs if step.seqs else 0.0
        return StepCost(
            compute_s=flops / (tp * dev.achieved_flops),
            memory_s=memory / (tp * dev.achieved_bandwidth),
            comm_s=comm,
            overhead_s=overhead,
            overlap=dev.overlap,
        )

    def seconds(self, step: StepInputs) -> float:
        return self.cost(step).total_s

    def plan_seconds(self, plan: StepPlan) -> float:
        """Seconds of the step a StepPlan describes (the simulator's hot path)."""
        seqs = plan.seqs
        if not seqs:
            return 0.0
        if not plan.is_prefill and len(seqs) == plan.total_tokens:
            # Plain decode, one token per sequence: C-level sums, no Python loop.
            n = len(seqs)
            read = sum(map(_start_pos, seqs))
            return self.seconds(StepInputs(n, n, read + n, read, n))
        tokens = sampled = pairs = read = 0
        for seq in seqs:
            n, s = len(seq.token_ids), seq.start_pos
            tokens += n
            read += s
            pairs += n * s + n * (n + 1) // 2
            if seq.sample:
                sampled += 1 if plan.is_prefill else n
        return self.seconds(StepInputs(tokens, sampled, pairs, read, len(seqs)))
