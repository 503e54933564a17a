"""KV handoff: a PROMPT engine serves a prefilled request's KV, a COMPLETION engine fetches it.

The PROMPT engine runs a KVServer beside its step loop; the Handoff names its address,
the handle, the handle's token and the fingerprint. The COMPLETION engine reserves
blocks, runs fetch_kv() off its main thread, and marks the request decodable only once
fetch_kv returned: a failed fetch raises KVTransferError and leaves nothing usable,
so the caller counts the reason and recomputes the prompt. This module holds what any
transport shares; TCP (kv_tcp.py) is the one here. An RDMA transport (NIXL, Mooncake)
would be a second server and fetch function keeping KVServer's callbacks and
fetch_kv's errors, picked in main.py and handoff_flow.py.

TCP wire format, version WIRE_VERSION (control messages in JSON, KV as raw bytes):
    message = magic b"TKVM", u32 length, a JSON object of that length
    client -> {"v", "op": "fetch", "handle", "token", "fingerprint", "num_tokens", "layout"}
    server -> {"v", "ok": true, "layout", "num_tokens", "frame_tokens", "byteorder"}
              or {"v", "ok": false, "reason", "error"}, and it closes
    server -> frames, layer by layer, frame_tokens tokens each (the last fewer):
              u32 layer, u32 first token, u32 tokens, u64 xxh3 hash of the payload, then the
              payload: K then V rows of those tokens, [2, tokens, kv_heads, head_dim]
    server -> {"v", "ok": true}: the rows were still pinned when read
    client -> {"v", "op": "ack", "handle"}: only now may the server free the KV
A decoder that will not fetch (it recomputes the prompt) frees the offer instead:
    client -> {"v", "op": "release", "handle", "token"}
    server -> {"v", "ok": true}, or {"v", "ok": false, "reason"} (gone already, another
              wire version)

The token is a random secret made for each offer and sent only in its Handoff, through
Redis: a peer that reaches the KV port without reading Redis cannot fetch a request's
KV (its prompt, in effect) by guessing or learning the request id. A wrong token is
refused as an unknown handle is, so that a guess does not learn which handles exist.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import torch

Lookup = Callable[[str], "PinnedKV | None"]
OnFetched = Callable[[str], None]


class Reason(StrEnum):
    """Why a fetch failed; a StrEnum, so `error.reason == "timeout"` holds."""

    UNREACHABLE = "unreachable"  # could not connect, or the connection dropped
    REFUSED = "refused"  # the server does not (or no longer) hold the handle
    MISMATCH = "mismatch"  # fingerprint, token count or layout differ
    CHECKSUM = "checksum"  # a frame arrived corrupted
    TIMEOUT = "timeout"  # the deadline passed
    PROTOCOL = "protocol"  # the peer spoke something else (version, framing)
    SKIPPED = "skipped"  # not tried: a fetch from that peer timed out moments ago


class KVTransferError(Exception):
    """A fetch failed; `reason` (a Reason) is for counting failures by cause."""

    def __init__(self, reason: str, message: str, *, unanswered: bool = False) -> None:
        super().__init__(f"KV transfer failed ({reason}): {message}")
        self.reason = Reason(reason)
        self.detail = message
        # The peer never answered the fetch (no connection, or no reply to it): stalled
        # or gone, unlike one whose frames stopped midway.
        self.unanswered = unanswered


@dataclass(frozen=True)
class KVLayout:
    """What a KV cache holds per token; both ends must agree on it exactly."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"KVLayout.{name} must be a positive int, got {self!r}")
        if not isinstance(self.dtype, torch.dtype):
            raise ValueError(f"KVLayout.dtype must be a torch.dtype, got {self.dtype!r}")

    @classmethod
    def of(cls, kv_caches: list[torch.Tensor]) -> KVLayout:
        """The layout of per-layer kv[2, blocks, block_size, kv_heads, head_dim] caches."""
        if not kv_caches or kv_caches[0].dim() != 5:
            raise ValueError("expected per-layer kv[2, blocks, block_size, heads, dim] caches")
        first = kv_caches[0]
        layout = cls(len(kv_caches), first.shape[3], first.shape[4], first.dtype)
        layout.check_caches(kv_caches)
        return layout

    @property
    def layer_token_bytes(self) -> int:
        """Bytes of one token's K and V in one layer."""
        return 2 * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def bytes_per_token(self) -> int:
        return self.num_layers * self.layer_token_bytes

    def to_dict(self) -> dict[str, Any]:
        dtype = str(self.dtype).removeprefix("torch.")
        return {
            "layers": self.num_layers,
            "kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "dtype": dtype,
        }

    def check_caches(self, kv_caches: list[torch.Tensor]) -> None:
        """ValueError unless kv_caches are contiguous per-layer caches of this layout."""
        if len(kv_caches) != self.num_layers:
            raise ValueError(f"{len(kv_caches)} KV caches for a {self.num_layers}-layer layout")
        want = (2, self.num_kv_heads, self.head_dim, self.dtype, True)
        for i, cache in enumerate(kv_caches):
            if (cache.shape[0], *cache.shape[3:], cache.dtype, cache.is_contiguous()) != want:
                raise ValueError(
                    f"KV cache of layer {i} is a {cache.dtype} {tuple(cache.shape)} tensor; "
                    f"the layout needs contiguous {self.dtype} [2, blocks, block_size, "
                    f"{self.num_kv_heads}, {self.head_dim}]"
                )


@dataclass(frozen=True)
class PinnedKV:
    """A prefilled request's KV as the PROMPT engine keeps it for a fetch."""

    handle: str
    slots: torch.Tensor  # long [num_tokens]: flat cache slot of each position, in order
    fingerprint: str
    token: str  # the secret a fetch must present (sent only in the Handoff)


@dataclass(frozen=True)
class TransferStats:
    bytes: int
    seconds: float
    layers: int
