"""Browser pages of the origins --allowed-origin names may call the API (CORS); by
default none may. A live gateway and a real engine, as the other gateway tests."""

from __future__ import annotations

import httpx
import pytest

from tandem.gateway.settings import GatewaySettings

from .live import API_KEY

PAGE = "https://chat.example.com"
BODY = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


def _preflight(client: httpx.Client, origin: str) -> httpx.Response:
    headers = {
        "Origin": origin,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os",
    }
    return client.options("/v1/chat/completions", headers=headers)


def test_a_page_of_an_allowed_origin_may_call_the_api(start_gateway, engines):
    # Without it, apps in a browser (the OpenAI JS SDK's) could not call the gateway:
    # the preflight got a 405, and no answer carried the headers a browser needs.
    engines("normal")
    gateway = start_gateway(allowed_origins=(PAGE,))
    with httpx.Client(base_url=gateway.url, timeout=60) as client:
        preflight = _preflight(client, PAGE)
        assert preflight.status_code == 200
        assert preflight.headers["access-control-allow-origin"] == PAGE
        assert "x-stainless-os" in preflight.headers["access-control-allow-headers"]
        auth = {"Authorization": f"Bearer {API_KEY}", "Origin": PAGE}
        answer = client.post("/v1/chat/completions", json=BODY, headers=auth)
        assert answer.status_code == 200, answer.text
        assert answer.headers["access-control-allow-origin"] == PAGE
        # The JS SDK's `_request_id`: a page reports it to whoever runs the gateway.
        exposed = answer.headers["access-control-expose-headers"].lower().split(", ")
        assert "x-request-id" in exposed and answer.headers["x-request-id"]
        assert "retry-after-ms" in exposed  # a 429's wait, to the millisecond
        assert "x-ratelimit-remaining-tokens" in exposed  # a browser client paces itself
        # An error too: the page can read why (here, no key).
        refused = client.post("/v1/chat/completions", json=BODY, headers={"Origin": PAGE})
        assert refused.status_code == 401
        assert refused.headers["access-control-allow-origin"] == PAGE
        other = _preflight(client, "https://evil.example.com")
        assert "access-control-allow-origin" not in other.headers


def test_no_origin_is_allowed_by_default(start_gateway):
    gateway = start_gateway()
    with httpx.Client(base_url=gateway.url, timeout=30) as client:
        assert "access-control-allow-origin" not in _preflight(client, PAGE).headers


def test_an_allowed_origin_is_kept_as_a_browser_sends_it():
    # Compared as a string: these passed, and no page of theirs was ever allowed.
    given = ("HTTPS://Chat.Example.com:443", "http://[::1]:80", "http://Dev.local:8080", "*")
    settings = GatewaySettings(allowed_origins=given)
    assert settings.allowed_origins == (
        "https://chat.example.com",
        "http://[::1]",
        "http://dev.local:8080",
        "*",
    )


@pytest.mark.parametrize(
    "origin",
    ["chat.example.com", "https://chat.example.com/", "", "https://x.com:99999", "http://x:"],
)
def test_an_allowed_origin_must_be_an_origin(origin):
    with pytest.raises(ValueError, match="is not an origin: give scheme://host"):
        GatewaySettings(allowed_origins=(origin,))
