"""LlamaForCausalLM: the Llama-family decoder over the paged KV cache.

Parameter names equal Hugging Face transformers' LlamaForCausalLM state_dict
names, so a checkpoint's tensors load by name (load_weights); q/k/v and gate/up
stay separate parameters, and only their packed copies are fused.

On CPU in inference (no_grad / inference_mode) the forward uses the C++ kernels of
cpu_kernels.py when they build: each residual add fused into the RMSNorm after it,
RoPE in place on q and k, SiLU(gate) * up in one pass, and the paged decode
attention kernel; its projections multiply through pre-packed weights once the
loader has packed them (pack_projections, linear.py), in float32 with SiLU(gate) * up
inside the gate/up product. When every projection is packed so, the layers run
as flat records of their packed panels (packed_decoder.py), the same kernels
without the modules' Python between them. Otherwise (accelerators, autograd,
TANDEM_CPU_KERNELS=0, no compiler) it runs the torch modules below, which define
the semantics.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from tandem.engine.model import cpu_kernels
from tandem.engine.model.attention import paged_attention
from tandem.engine.model.attention_metadata import AttentionMetadata
from tandem.engine.model.coded_weight import CodedWeight
from tandem.engine.model.greedy_head import GreedyHead
from tandem.engine.model.linear import (
    FusedLinears,
    GatedLinears,
    Linear,
    pack_linears,
    packing_fits,
    unpack_linears,
)
from tandem.engine.model.model_config import ModelConfig
from tandem.engine.model.packed_decoder import PackedDecoder
from tandem.engine.model.rope import apply_rope, rope_inv_freq


def _cpu_kernels(x: torch.Tensor) -> object | None:
    """torch.ops.tandem_cpu when x's forward can use them, else None (the torch path).

    Only for inference (no_grad or inference_mode): besides having no backward, some
    kernels write in place, which would corrupt what autograd saved of the weights.
    """
    return None if torch.is_grad_enabled() else cpu_kernels.for_tensors(x)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # In float32, cast back before the weight: what HF does, so bf16 matches bit for bit.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class LlamaAttention(nn.Module):
    qkv: FusedLinears | None = None  # q/k/v as one packed product (pack_projections)

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = self.head_dim**-0.5
        hidden, q_size = config.hidden_size, self.heads * self.head_dim
        kv_size = self.kv_heads * self.head_dim
        self.q_proj = Linear(hidden, q_size, bias=False)
        self.k_proj = Linear(hidden, kv_size, bias=False)
        self.v_proj = Linear(hidden, kv_size, bias=False)
        self.o_proj = Linear(q_size, hidden, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        ops: object | None = None,
    ) -> torch.Tensor:
        rows = x.shape[0]
        if self.qkv is not None and self.qkv.applies(x):
            q, k, v = self.qkv(x)  # row-strided views, which the kernels read in place
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(rows, self.heads, self.head_dim)
        k = k.view(rows, self.kv_heads, self.head_dim)
        v = v.view(rows, self.kv_heads, self.head_dim)
        if ops is None:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        else:
            ops.rope_(q, k, cos, sin)  # in place, one pass for both
        out = paged_attention(q, k, v, kv_cache, meta, self.scale)
        return self.o_proj(out.reshape(rows, self.heads * self.head_dim))


class LlamaMLP(nn.Module):
    # One packed product each (pack_projections): silu(gate) * up where the panel kernel
    # runs it (float32), else gate/up with silu_mul after.
    gated: GatedLinears | None = None
    gate_up: FusedLinears | None = None

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden, inner = config.hidden_size, config.intermediate_size
        self.gate_proj = Linear(hidden, inner, bias=False)
        self.up_proj = Linear(hidden, inner, bias=False)
        self.down_proj = Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor, ops: object | None = None) -> torch.Tensor:
        if self.gated is not None and self.gated.applies(x):
            return self.down_proj(self.gated(x))
        if self.gate_up is not None and self.gate_up.applies(x):
            gate, up = self.gate_up(x)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        if ops is None:
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(ops.silu_mul(gate, up))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        # Given its (meta) weight, the embedding skips its random init: normal_ on the
        # meta device runs a Python decomposition that imports torch._dynamo, ~1 s of
        # every engine's start.
        shape = (config.vocab_size, config.hidden_size)
        self.embed_tokens = nn.Embedding(*shape, _weight=torch.empty(shape))
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


def _materialise(module: nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """Every parameter of a module built on the meta device, as uninitialised memory of
    `dtype` on `device`. (Module.to and to_empty run Python meta decompositions that
    import sympy and torch._dynamo, ~1.5 s of every engine's start; torch.empty does
    not.)"""
    for sub in module.modules():
        for name, param in sub.named_parameters(recurse=False):
            empty = torch.empty(param.shape, dtype=dtype, device=device)
            setattr(sub, name, nn.Parameter(empty, requires_grad=param.requires_grad))


class LlamaForCausalLM(nn.Module):
    """A Llama-family decoder. Weights start as zeros (norms as ones) until load_weights."""

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        self.config = config
        # Built on the meta device, then materialised: skips the random init of every
        # matrix, which for billions of parameters costs longer than loading them.
        with torch.device("meta"):
            self.model = LlamaModel(config)
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        _materialise(self, dtype, torch.device(device))
        # Tied after materialising (which unties), before the fill (which would touch the
        # discarded head's pages).
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # Greedy rows' LM head and the layers' fast path (pack_projections), plain
        # attributes as the packed copies they hold.
        self.greedy_head: GreedyHead | None = None
        self.packed_decoder: PackedDecoder | None = None
        with torch.no_grad():
            for name, param in self.named_parameters():
                param.fill_(1.0 if name.endswith("norm.weight") else 0.0)
        if torch.device(device).type == "cpu":
            cpu_kernels.load()  # build (once per machine) at load time, not mid-request
        # float32 whatever the weights' dtype: bf16 would round positions' angles.
        inv_freq = rope_inv_freq(config, device)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] (final norm applied) for the step's flat tokens."""
        if len(kv_caches) != len(self.model.layers):
            raise ValueError(f"{len(kv_caches)} KV caches for {len(self.model.layers)} layers")
        x = self.model.embed_tokens(input_ids)
        # cos/sin once per step, shared by every layer.
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        ops = _cpu_kernels(x)
        if ops is not None and self.packed_decoder is not None and self.packed_decoder.applies(x):
            return self.packed_decoder(x, cos, sin, kv_caches, meta)
        if ops is None:
            for layer, cache in zip(self.model.layers, kv_caches, strict=True):
                x = layer(x, cos, sin, cache, meta)
            return self.model.norm(x)
        # The same computation with the C++ kernels (cpu_kernels.py): each residual add
        # fused with the RMSNorm after it, RoPE in place, SiLU and product in one pass.
        layers = self.model.layers
        first = layers[0].input_layernorm
        h = ops.rms_norm(x, first.weight, first.eps)
        for i, (layer, cache) in enumerate(zip(layers, kv_caches, strict=True)):
            attn = layer.self_attn(h, cos, sin, cache, meta, ops)
            post = layer.post_attention_layernorm
            h = ops.add_rms_norm_(x, attn, post.weight, post.eps)  # x += attn; h = post(x)
            mlp = layer.mlp(h, ops)
            norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.model.norm
            h = ops.add_rms_norm_(x, mlp, norm.weight, norm.eps)
        return h

    def pack_projections(self) -> int:
        """Packed copies of the projections for the CPU's fast path (linear.py): q/k/v and
        gate/up (with SiLU where it can) each fused into one product, o/down and the LM
        head alone. Returns how many products are packed (none off the CPU, with
        TANDEM_CPU_KERNELS=0, or when the copies would not fit in memory: packing_fits
        warns then).

        Codes from load_codes go into the packed copies and leave the modules (their
        copy would only hold ~1.25 bytes a weight of memory): packing again, e.g. after
        new weights, uses the float32 panels alone."""
        self.unpack_projections()
        if not packing_fits(self):
            return 0
        count = pack_linears(self.lm_head)
        self.greedy_head = GreedyHead.pack(self.lm_head)
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            attn.qkv = FusedLinears.pack(attn.q_proj, attn.k_proj, attn.v_proj)
            mlp.gated = GatedLinears.pack(mlp.gate_proj, mlp.up_proj)
            if mlp.gated is None:
                mlp.gate_up = FusedLinears.pack(mlp.gate_proj, mlp.up_proj)
            count += (attn.qkv is not None) + (mlp.gated is not None or mlp.gate_up is not None)
            count += pack_linears(attn.o_proj) + pack_linears(mlp.down_proj)
        self.packed_decoder = PackedDecoder.build(self)
        for module in self.modules():
            if isinstance(module, Linear):
                module.coded = None
        return count

    def unpack_projections(self) -> None:
        """Drop every packed copy (the torch path again), e.g. before the weights change."""
        unpack_linears(self)
        self.greedy_head = self.packed_decoder = None
        for layer in self.model.layers:
            layer.self_attn.qkv = None
            layer.mlp.gated = layer.mlp.gate_up = None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [N, vocab] for the rows being sampled."""
        return self.lm_head(hidden).float()

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """argmax(compute_logits(hidden)) per row without the logits, where the greedy
        head is packed (greedy_head.py) and can take hidden; else None."""
        head = self.greedy_head
        # With autograd on, the head runs F.linear (linear.py), not the panels.
        if (
            head is None
            or hidden.dtype != torch.float32
            or hidden.device.type != "cpu"
            or torch.is_grad_enabled()
        ):
            return None
        return head(hidden)

    def load_codes(self, named_codes: Iterable[tuple[str, CodedWeight]]) -> None:
        """Give projections their checkpoint's code forms (Hugging Face weight names), for
        pack_projections to multiply by where they give exactly the loaded weights."""
        modules = dict(self.named_modules())
        for name, coded in named_codes:
            module = modules.get(name.removesuffix(".weight"))
            if not isinstance(module, Linear) or tuple(coded.shape) != tuple(module.weight.shape):
                raise ValueError(f"codes {name!r} {tuple(coded.shape)} match no projection")
            module.coded = coded

    def load_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], strict: bool = True
    ) -> set[str]:
        """Copy checkpoint tensors (Hugging Face names) into the parameters.

        Returns the names loaded. With strict, a parameter no tensor filled is a
        ValueError (pass strict=False when loading one shard at a time).
        """
        self.unpack_projections()  # packed copies would keep the old weights
        params = dict(self.named_parameters(remove_duplicate=False))
        tied = self.config.tie_word_embeddings
        loaded: set[str] = set()
        for name, tensor in named_tensors:
            if name.endswith("rotary_emb.inv_freq"):
                continue  # recomputed from the config
            if tied and name == "lm_head.weight":
                continue  # the embedding is the head; some tied checkpoints carry a copy
            param = params.get(name)
            if param is None:
                raise ValueError(
                    f"checkpoint tensor {name!r} has no parameter in {self.config.name!r} "
                    f"(Llama parameter names, e.g. model.layers.0.self_attn.q_proj.weight)"
                )
            if tuple(tensor.shape) != tuple(param.shape):
                raise ValueError(
                    f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                    f"the model expects {tuple(param.shape)}"
                )
            with torch.no_grad():
                param.copy_(tensor)
            loaded.add(name)
        if tied:
            loaded.add("lm_head.weight")
        missing = sorted(set(params) - loaded)
        if strict and missing:
            shown = ", ".join(missing[:5]) + (", ..." if len(missing) > 5 else "")
            raise ValueError(
                f"checkpoint for {self.config.name!r} lacks {len(missing)} tensors: {shown}"
            )
        return loaded
