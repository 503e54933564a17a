"""A decoder's decision to fetch a handoff's KV or recompute its prompt at once."""

from __future__ import annotations

import time

import pytest
import torch

from tandem.engine.service.handoff_flow import CLOCK_SKEW_S, HandoffFlow
from tandem.engine.service.kv_transfer import KVLayout
from tandem.engine.service.settings import WorkerSettings
from tandem.protocol import Handoff, Role

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32)


def _decoder() -> HandoffFlow:
    settings = WorkerSettings(
        Role.COMPLETION, "tiny", "decoder-1", "127.0.0.1:1", fingerprint="weights-a"
    )
    return HandoffFlow(settings, [], LAYOUT, block_size=16)


def _handoff(expires_in: float, **changes: object) -> Handoff:
    fields: dict = dict(
        work={"request_id": "r", "model": "tiny", "prompt_token_ids": [1, 2, 3]},
        prompt_token_ids=[1, 2, 3],
        first_token_ids=[7],
        kv_address="10.0.0.1:8200",
        kv_handle="r",
        num_kv_tokens=3,
        fingerprint="weights-a",
        prompt_engine="prefill-1",
        expires_at=time.time() + expires_in,
    )
    return Handoff(**{**fields, **changes})


@pytest.mark.parametrize(
    ("expires_in", "reason"),
    [
        (20.0, None),  # fresh: fetch it
        # The prompt engine's clock a few seconds behind the decoder's: still fetched
        # (its own refusal decides); every handoff was "expired" past the TTL's skew.
        (-(CLOCK_SKEW_S - 2), None),
        (-(CLOCK_SKEW_S + 30), "expired"),  # redelivered long after: surely freed
    ],
)
def test_a_handoff_is_fetched_unless_its_offer_is_surely_gone(expires_in, reason):
    assert _decoder()._recompute_reason(_handoff(expires_in), [7]) == reason


def test_a_handoff_of_other_weights_or_an_older_decoder_is_recomputed():
    decoder = _decoder()
    assert decoder._recompute_reason(_handoff(20, fingerprint="weights-b"), [7]) == "mismatch"
    # An earlier decoder got further (two tokens): the prompt engine's KV is gone.
    assert decoder._recompute_reason(_handoff(20), [7, 9]) == "stale"
