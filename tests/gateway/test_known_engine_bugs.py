"""Engine bugs found through the gateway, kept as regression tests.

(The other one, a half character lost at the prefill/decode handoff, is in
test_disaggregated.py, next to its engines.)
"""

from __future__ import annotations

from .live import API_KEY


def test_a_tiny_top_p_is_served_not_fatal(start_gateway, engines):
    # 5e-324 is valid for the API (0 < top_p <= 1) but rounds to 0 in float32: top-p
    # must still keep the most likely token (it once indexed -1 and killed the engine).
    engine = engines("normal")
    gateway = start_gateway()
    with gateway.http(API_KEY) as client:
        reply = client.post(
            "/v1/chat/completions",
            json={
                "model": "tiny",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2,
                "top_p": 5e-324,
            },
            headers={"X-Tandem-Timeout": "3"},
        )
    alive = engine.process.poll() is None
    assert reply.status_code == 200 and alive, (reply.status_code, alive)
