"""PackedDecoder: the decoder layers' CPU fast path, as flat records of packed panels.

Where every layer's projections run on the float32 panel kernel (q/k/v fused, SiLU
inside the gate/up product, o and down alone: linear.py), a step needs nothing of
the torch modules but their packed copies and norm weights. This walks the layers
over records of exactly those, calling the kernels directly:

    h = rms_norm(x); per layer: qkv -> RoPE -> paged attention -> o;
    x += o, h = norm(x); x += down(silu(gate(h)) * up(h)), h = next norm(x)

It computes what LlamaForCausalLM.forward's kernel branch computes, with the same
kernels in the same order, so the results are equal bit for bit (tests). What it
saves is the modules' Python between the kernels: ~5 ms of a ~110 ms batch-64
SmolLM2 decode step on 2 threads (docs/model-runtime.md). The Python ran after each
kernel had streamed a layer's weights through the caches, so every attribute lookup
and module call paid misses.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from tandem.engine.model.attention import paged_attention
from tandem.engine.model.attention_metadata import AttentionMetadata
from tandem.engine.model.linear import PackedWeight
from tandem.engine.model.split_planes import PANEL_WIDEN_ROWS, SPLIT_ROWS


@dataclass(frozen=True, slots=True)
class _Layer:
    """One decoder layer, as its kernels take it."""

    # Per product, PackedWeight.kernels(): (kernel, its arguments after x) for steps of
    # up to SPLIT_ROWS rows, and for more.
    qkv: tuple  # q, k and v's fused product
    q_size: int  # heads * head_dim: q's columns, then k's and v's kv_size each
    kv_size: int  # kv_heads * head_dim
    heads: int
    kv_heads: int
    head_dim: int
    scale: float  # the attention's softmax scale
    # Whether the qkv kernel for more than SPLIT_ROWS rows rotates q and k itself
    # (split_linear's rope_columns: the heads while they are in cache, not rope_ after).
    fused_rope: bool
    o: tuple  # o_proj's
    gated: tuple  # gate and up's (the product is silu(gate) * up)
    down: tuple  # down_proj's
    post_norm: torch.Tensor  # post_attention_layernorm's weight
    post_eps: float
    next_norm: torch.Tensor  # the next layer's input norm, the final norm after the last
    next_eps: float


class PackedDecoder:
    """The layers of one model as _Layer records; built by pack_projections."""

    def __init__(self, first_norm: torch.Tensor, first_eps: float, layers: list[_Layer]) -> None:
        self.first_norm = first_norm  # layer 0's input_layernorm weight
        self.first_eps = first_eps
        self.layers = layers

    @classmethod
    def build(cls, model: torch.nn.Module) -> PackedDecoder | None:
        """The fast path of a LlamaForCausalLM whose projections are all packed into
        float32 panels (pack_projections), else None (its modules' forward serves)."""
        layers = model.model.layers
        records = []
        for i, layer in enumerate(layers):
            attn, mlp = layer.self_attn, layer.mlp
            qkv = attn.qkv.packed if attn.qkv is not None else None
            gated = mlp.gated.packed if mlp.gated is not None else None
            o, down = attn.o_proj.packed, mlp.down_proj.packed
            # (No biases to carry: the model's projections have none.)
            if not all(_float32_panels(p) for p in (qkv, gated, o, down)):
                return None
            after = layers[i + 1].input_layernorm if i + 1 < len(layers) else model.model.norm
            records.append(
                _Layer(
                    qkv=qkv.kernels(),
                    q_size=attn.heads * attn.head_dim,
                    kv_size=attn.kv_heads * attn.head_dim,
                    heads=attn.heads,
                    kv_heads=attn.kv_heads,
                    head_dim=attn.head_dim,
                    scale=attn.scale,
                    fused_rope=_is_split(qkv.kernels()[1][0]) and attn.head_dim % 32 == 0,
                    o=o.kernels(),
                    gated=gated.kernels(),
                    down=down.kernels(),
                    post_norm=layer.post_attention_layernorm.weight,
                    post_eps=layer.post_attention_layernorm.eps,
                    next_norm=after.weight,
                    next_eps=after.eps,
                )
            )
        if not records:
            return None
        first = layers[0].input_layernorm
        return cls(first.weight, first.eps, records)

    def narrow_bytes(self) -> int | None:
        """Bytes of the projections' narrow panels (codes with their scales and offsets,
        or 16-bit floats): what a decode step streams of them; None where some product
        has none."""
        products = [
            p for layer in self.layers for p in (layer.qkv, layer.o, layer.gated, layer.down)
        ]
        narrow = [
            p[0][1][4:7] for p in products
        ]  # panel_args: ..., codes, scales, offsets, code_low
        if any(codes is None for codes, _, _ in narrow):
            return None
        return sum(t.numel() * t.element_size() for n in narrow for t in n if t is not None)

    def on_tiles(self) -> bool:
        """Whether products of more than SPLIT_ROWS rows run on AMX tiles (split_linear)."""
        return _is_split(self.layers[0].qkv[1][0])

    def float32_only(self) -> PackedDecoder:
        """The same layers on the float32 panels alone, at every row count: the narrow
        panels (panel_args' last four) and the split planes dropped (benches, tests)."""

        def wide(kernels: tuple) -> tuple:
            (linear, args), _ = kernels
            small = (linear, (*args[:4], None, None, None, None))
            return small, small

        layers = [
            dataclasses.replace(
                r,
                qkv=wide(r.qkv),
                fused_rope=False,
                o=wide(r.o),
                gated=wide(r.gated),
                down=wide(r.down),
            )
            for r in self.layers
        ]
        return PackedDecoder(self.first_norm, self.first_eps, layers)

    def weight_bytes(self, rows: int) -> int:
        """Bytes of weights the projections of a step of `rows` rows read: the narrow
        panels where the kernel widens them, the split planes (or their codes) where
        they serve, else the float32 panels."""
        total = 0
        for layer in self.layers:
            for kernels in (layer.qkv, layer.o, layer.gated, layer.down):
                kernel, args = kernels[rows > SPLIT_ROWS]
                if _is_split(kernel):
                    weights = [t for t in args if isinstance(t, torch.Tensor)]
                elif args[4] is not None and rows <= PANEL_WIDEN_ROWS:  # widened codes
                    weights = [t for t in args[4:] if isinstance(t, torch.Tensor)]
                else:
                    weights = [args[0]]
                total += sum(t.numel() * t.element_size() for t in weights)
        return total

    def applies(self, x: torch.Tensor) -> bool:
        """Whether this step can take the fast path: float32 on the CPU, no autograd."""
        return x.dtype == torch.float32 and x.device.type == "cpu" and not torch.is_grad_enabled()

    def __call__(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """The final hidden states [T, hidden] (final norm applied); x, the embeddings
        [T, hidden], is the residual stream, updated in place."""
        ops = torch.ops.tandem_cpu
        # The overloads themselves: the packets would resolve them on every call.
        rope, add_rms_norm = ops.rope_.default, ops.add_rms_norm_.default
        rows = x.shape[0]
        large = rows > SPLIT_ROWS  # which of each product's kernels
        h = ops.rms_norm.default(x, self.first_norm, self.first_eps)
        for layer, cache in zip(self.layers, kv_caches, strict=True):
            linear, args = layer.qkv[large]
            kv_end = layer.q_size + layer.kv_size
            fused = large and layer.fused_rope
            if fused:
                qkv = linear(h, *args, cos=cos, sin=sin, rope_columns=kv_end)
            else:
                qkv = linear(h, *args)
            # Column views of the product, which the kernels read in place.
            q = qkv[:, : layer.q_size].view(rows, layer.heads, layer.head_dim)
            k = qkv[:, layer.q_size : kv_end].view(rows, layer.kv_heads, layer.head_dim)
            v = qkv[:, kv_end:].view(rows, layer.kv_heads, layer.head_dim)
            if not fused:
                rope(q, k, cos, sin)
            out = paged_attention(q, k, v, cache, meta, layer.scale)
            linear, args = layer.o[large]
            o = linear(out.reshape(rows, layer.q_size), *args)
            h = add_rms_norm(x, o, layer.post_norm, layer.post_eps)  # x += o; h = norm(x)
            linear, args = layer.gated[large]
            gated = linear(h, *args)
            linear, args = layer.down[large]
            down = linear(gated, *args)
            h = add_rms_norm(x, down, layer.next_norm, layer.next_eps)
        return h


def _is_split(kernel) -> bool:
    return kernel is torch.ops.tandem_cpu.split_linear.default


def _float32_panels(packed: PackedWeight | None) -> bool:
    return packed is not None and packed.panels and packed.dtype == torch.float32
