"""Split planes' fused rotation: a q/k/v product that rotates q's and k's heads as it
stores them (split_linear's rope_columns), bit for bit as rope_ after the product."""

from __future__ import annotations

import pytest
import torch

from tandem.engine.model.split_planes import coded_planes, gated_planes, weight_planes
from tests.engine.test_split_linear import OPS, PLANE_TYPES, coded, needs_amx, rotated, split


@needs_amx
@pytest.mark.parametrize(
    "kind", [PLANE_TYPES[1], PLANE_TYPES[4], None], ids=["Q4_1", "Q8_0", "bfloat16"]
)
@pytest.mark.parametrize("rows", [9, 64, 400])
def test_a_fused_qkv_product_rotates_its_heads_as_rope_does(kind, rows, threads) -> None:
    """q's and k's heads rotated inside the product (rope_columns), bit for bit as rope_
    after it, from codes and from planes, in one block of rows and in several (K 1,536:
    96 rows a block); v's heads untouched; on one thread and on two. 11 heads of 64 are
    22 column pairs: two threads' even split would cut head 5, which the kernel keeps
    whole on one thread."""
    n, k, d = 704, 1536, 64
    if kind is None:
        planes = weight_planes(torch.randn(n, k).bfloat16().float() / 8)
    else:
        planes = coded_planes(coded(n, k, kind, seed=rows)[0])
    x = torch.randn(rows, k)
    angles = torch.randn(rows, 1, d)
    cos, sin = angles.cos(), angles.sin()
    expected = split(x, planes, n)
    q = expected[:, : 6 * d].view(rows, 6, d)
    kv = expected[:, 6 * d : 8 * d].view(rows, 2, d)
    OPS.rope_(q, kv, cos, sin)
    assert torch.equal(rotated(planes, x, n, 8, cos, sin), expected)


@needs_amx
def test_a_fused_rotation_refuses_what_it_cannot_rotate() -> None:
    planes = coded_planes(coded(128, 64)[0])
    x = torch.randn(20, 64)
    cos = torch.randn(20, 1, 64)
    with pytest.raises(RuntimeError, match="cos and sin come together"):
        OPS.split_linear(x, *planes.args(128, None, False), cos=cos, rope_columns=64)
    with pytest.raises(RuntimeError, match="cos and sin come together"):
        OPS.split_linear(x, *planes.args(128, None, False), cos=cos, sin=cos)
    with pytest.raises(RuntimeError, match="must be whole heads of 64"):
        OPS.split_linear(x, *planes.args(128, None, False), cos=cos, sin=cos, rope_columns=96)
    with pytest.raises(RuntimeError, match="must be whole heads of 64 within the 128"):
        OPS.split_linear(x, *planes.args(128, None, False), cos=cos, sin=cos, rope_columns=192)
    odd = torch.randn(20, 1, 48)
    with pytest.raises(RuntimeError, match="heads' dim 48 must be a multiple of 32"):
        OPS.split_linear(x, *planes.args(128, None, False), cos=odd, sin=odd, rope_columns=96)
    with pytest.raises(RuntimeError, match=r"float32 \[rows, \(1,\) head_dim\]"):
        OPS.split_linear(
            x, *planes.args(128, None, False), cos=cos[:10], sin=cos[:10], rope_columns=64
        )
    gated = gated_planes(planes, planes)
    with pytest.raises(RuntimeError, match="gated product takes no rotation"):
        OPS.split_linear(x, *gated.args(128, None, True), cos=cos, sin=cos, rope_columns=64)
