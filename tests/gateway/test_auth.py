"""API keys: the file formats, the environment, and what a request's header gets."""

from __future__ import annotations

import hashlib
import json

import pytest

from tandem.gateway.auth import ANONYMOUS, KeyStore, check_model
from tandem.gateway.errors import GatewayError


def _store(tmp_path, text: str, name: str = "keys.json") -> KeyStore:
    path = tmp_path / name
    path.write_text(text)
    return KeyStore.load(str(path), None)


def test_json_and_yaml_files_give_the_same_keys(tmp_path):
    digest = hashlib.sha256(b"sk-hashed").hexdigest()
    entries = [
        {"key": "sk-plain", "name": "alice", "models": ["tiny"], "rpm": 10, "tpm": 1000},
        {"key_sha256": digest, "name": "bob", "models": "*", "prefix_cache": "own"},
        {"key": "sk-low", "name": "carol", "max_priority": "low", "max_in_flight": 4},
    ]
    yaml_text = (
        "- key: sk-plain\n  name: alice\n  models: [tiny]\n  rpm: 10\n  tpm: 1000\n"
        f"- key_sha256: {digest}\n  name: bob\n  models: '*'\n  prefix_cache: own\n"
        "- key: sk-low\n  name: carol\n  max_priority: low\n  max_in_flight: 4\n"
    )
    for store in (_store(tmp_path, json.dumps(entries)), _store(tmp_path, yaml_text, "k.yaml")):
        alice = store.authenticate("Bearer sk-plain")
        assert (alice.name, alice.models, alice.rpm, alice.tpm) == ("alice", {"tiny"}, 10, 1000)
        bob = store.authenticate("bearer   sk-hashed ")
        assert bob.name == "bob" and bob.models is None and bob.rpm is None
        assert bob.own_prefix_cache and not alice.own_prefix_cache  # shared by default
        assert alice.allows("tiny") and not alice.allows("big") and bob.allows("big")
        assert store.authenticate("Bearer sk-low").max_priority == "low"
        assert alice.max_priority is None  # any
        assert store.authenticate("Bearer sk-low").max_in_flight == 4
        assert alice.max_in_flight is None  # any


def test_a_yaml_file_in_flow_style_is_yaml(tmp_path):
    # Read as JSON for its first "[": "not valid JSON", though the docs say YAML or JSON.
    store = _store(tmp_path, "[{key: sk-flow, name: flow, rpm: 3}]\n", "keys.yaml")
    assert store.authenticate("Bearer sk-flow").rpm == 3


def test_the_store_keeps_no_plain_key(tmp_path):
    store = _store(tmp_path, json.dumps([{"key": "sk-secret-123", "name": "a"}]))
    assert "sk-secret-123" not in repr(vars(store))


@pytest.mark.parametrize(
    ("header", "code"),
    [
        (None, "missing_api_key"),
        ("", "missing_api_key"),
        ("Basic c2stcGxhaW4=", "missing_api_key"),
        ("Bearer ", "missing_api_key"),
        ("Bearersk-plain", "missing_api_key"),  # not quoted back: it holds the key
        ("Bearer sk-wrong", "invalid_api_key"),
        ("Bearer sk-plai", "invalid_api_key"),
    ],
)
def test_a_missing_or_unknown_key_is_a_401(tmp_path, header, code):
    store = _store(tmp_path, json.dumps([{"key": "sk-plain", "name": "a"}]))
    with pytest.raises(GatewayError) as caught:
        store.authenticate(header)
    assert caught.value.status == 401 and caught.value.code == code
    assert "sk-plain" not in caught.value.message


def test_a_tab_after_bearer_reads_as_a_space(tmp_path):
    # RFC 9110's whitespace: "Bearer\tsk-..." was told its key was missing.
    store = _store(tmp_path, json.dumps([{"key": "sk-plain", "name": "a"}]))
    assert store.authenticate("Bearer\tsk-plain").name == "a"
    assert store.authenticate("bearer   sk-plain ").name == "a"


def test_environment_keys_allow_every_model_and_combine_with_the_file(tmp_path):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps([{"key": "sk-file", "name": "file", "models": ["a"]}]))
    store = KeyStore.load(str(path), " sk-env-1, ,sk-env-2 ")
    assert len(store) == 3
    assert store.authenticate("Bearer sk-env-2").models is None
    with pytest.raises(GatewayError) as caught:
        check_model(store.authenticate("Bearer sk-file"), "b")
    assert caught.value.status == 403 and caught.value.param == "model"


def test_an_environment_key_beyond_ascii_is_refused_by_its_place():
    with pytest.raises(ValueError, match="TANDEM_API_KEYS: key #2: a key must be printable"):
        KeyStore.load(None, "sk-one,sk-clé")


def test_open_access_lets_everyone_in_as_anonymous():
    store = KeyStore.open()
    assert store.authenticate(None) is ANONYMOUS and store.authenticate("Bearer x") is ANONYMOUS


@pytest.mark.parametrize(
    ("entries", "message"),
    [
        ({"key": "x"}, "expected a list of keys"),
        ([{"key": "x"}], "name must be"),
        ([{"key": "x", "name": "has space"}], "name must be"),
        ([{"name": "a"}], "exactly one of key or key_sha256"),
        ([{"name": "a", "key": "x", "key_sha256": "0" * 64}], "exactly one of"),
        ([{"name": "a", "key_sha256": "abc"}], "64 hex digits"),
        ([{"name": "a", "key": "x", "rpm": 0}], "rpm must be a positive integer"),
        ([{"name": "a", "key": "x", "tpm": "many"}], "tpm must be a positive integer"),
        ([{"name": "a", "key": "x", "max_in_flight": 0}], "max_in_flight must be a positive"),
        ([{"name": "a", "key": "x", "models": []}], "models must be"),
        ([{"name": "a", "key": "x", "models": ["a", "*"]}], '"*" alone'),
        ([{"name": "a", "key": "x", "rmp": 3}], "unknown fields ['rmp']"),
        ([{"name": "a", "key": "x", "prefix_cache": "private"}], 'must be "shared" or "own"'),
        ([{"name": "a", "key": "x"}, {"name": "a", "key": "y"}], "used twice"),
        ([{"name": "a", "key": "x"}, {"name": "b", "key": "x"}], "listed twice"),
        ([{"name": "a", "key": "x", "max_priority": "urgent"}], "max_priority must be high"),
        # A header arrives as Latin-1 bytes: such a key loaded, and nobody could use it.
        ([{"name": "a", "key": "sk-clé"}], "a key must be printable ASCII"),
        ([{"name": "a", "key": "sk-\x07bell"}], "a key must be printable ASCII"),
    ],
)
def test_a_bad_key_file_is_a_clear_error_at_start(tmp_path, entries, message):
    with pytest.raises(ValueError) as caught:
        _store(tmp_path, json.dumps(entries))
    assert message in str(caught.value)


def test_a_key_file_listing_none_starts_a_gateway_that_lets_no_one_in(tmp_path):
    # `[]` revokes every key of a running gateway (as documented); the next start refused
    # to run, telling its user to pass the --api-keys-file they had passed: a restarted
    # pod crash-looped.
    store = _store(tmp_path, "[]")
    with pytest.raises(GatewayError) as refused:
        store.authenticate("Bearer sk-anything")
    assert refused.value.status == 401 and not store.open_access


def test_no_keys_at_all_is_refused_unless_open(tmp_path):
    with pytest.raises(ValueError, match="--no-auth"):
        KeyStore.load(None, None)
    with pytest.raises(ValueError, match="cannot read"):
        KeyStore.load(str(tmp_path / "missing.json"), None)
    with pytest.raises(ValueError, match="not valid JSON"):
        _store(tmp_path, "[{")
    # A YAML key written twice: PyYAML kept the second (here: a limit silently dropped).
    with pytest.raises(ValueError, match="key 'rpm' is given twice"):
        _store(tmp_path, "- key: sk-a\n  name: a\n  rpm: 10\n  rpm: \n", "k.yaml")


@pytest.mark.parametrize(
    "text, says",
    [
        # PyYAML's message quoted the offending line: the key in plain text in the log.
        ("- name: bob\n  key: sk-live-bob:secret: 2\n", "mapping values are not allowed here at"),
        ("- {name: al, key: sk-live-al\n", "expected ',' or '}', but got"),
        ("- name: al\n  key: sk-live-al\n  key: sk-live-al-2\n", "key 'key' is given twice"),
        # Tokens PyYAML's own words quote: a key that begins with * or !.
        ("- key: *sk-live-alias\n  name: a\n", "found undefined alias '...' at"),
        ("- key: !sk-live-tag x\n  name: a\n", "constructor for the tag '...' at"),
    ],
)
def test_a_keys_file_that_is_not_yaml_is_named_without_quoting_a_key(tmp_path, text, says):
    with pytest.raises(ValueError) as refused:
        _store(tmp_path, text, "k.yaml")
    message = str(refused.value)
    assert says in message and " at line " in message, message
    assert "sk-live" not in message and "\n" not in message


def test_a_key_written_where_a_field_goes_is_not_named_a_misspelt_field_is(tmp_path):
    with pytest.raises(ValueError) as refused:
        _store(tmp_path, "- {sk-live-flow: 1, name: a, rmp: 2}\n", "k.yaml")
    message = str(refused.value)
    assert "unknown fields ['rmp', 1 not shown]" in message and "sk-live" not in message


def test_a_file_key_named_like_an_environment_key_says_whose_name_it_is(tmp_path):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps([{"name": "env-1", "key": "from-file"}]))
    with pytest.raises(ValueError, match=r"'env-1' is used twice.*TANDEM_API_KEYS's keys"):
        KeyStore.load(str(path), "from-env")


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _allowed(store: KeyStore, key: str) -> bool:
    try:
        store.authenticate(f"Bearer {key}")
    except GatewayError:
        return False
    return True


def test_a_changed_keys_file_is_read_again_without_a_restart(tmp_path, caplog):
    # A key revoked from a mounted Secret must stop working without rolling the gateway.
    path, clock = tmp_path / "keys.yaml", _Clock()
    path.write_text("- {key: sk-old, name: old}\n- {key: sk-kept, name: kept}\n")
    store = KeyStore.load(str(path), "sk-env", clock=clock)
    path.write_text("- {key: sk-kept, name: kept, rpm: 5}\n- {key: sk-new, name: new}\n")
    assert _allowed(store, "sk-old") and not _allowed(store, "sk-new")  # looked at 5 s apart
    clock.now += 5
    assert not _allowed(store, "sk-old") and _allowed(store, "sk-new")
    assert store.authenticate("Bearer sk-kept").rpm == 5  # its limits changed with it
    assert _allowed(store, "sk-env")  # the environment's keys stay beside the file's
    # Mid-edit or mistaken: the keys in use stay, and the log says why.
    path.write_text("- {key: sk-new, name: new, rpm: many}\n")
    clock.now += 5
    assert not store.stale
    assert _allowed(store, "sk-new") and _allowed(store, "sk-kept")
    assert "rpm must be a positive integer" in caplog.text
    assert "API keys not reloaded" in caplog.text
    # Said by a metric too (tandem_gateway_api_keys_stale): one line, and a key the
    # edit revoked kept working with nothing else to show it.
    assert store.stale
    path.unlink()
    clock.now += 5
    assert _allowed(store, "sk-new")
    assert "cannot read API keys file" in caplog.text
    # A Secret's volume swaps a symlink to a new file: a new inode, read again.
    (tmp_path / "v2.yaml").write_text("- {key: sk-v2, name: v2}\n")
    path.symlink_to(tmp_path / "v2.yaml")
    clock.now += 5
    assert _allowed(store, "sk-v2") and not _allowed(store, "sk-new")
    assert not store.stale


def test_a_keys_file_emptied_to_a_list_of_none_revokes_every_key(tmp_path, caplog):
    # `[]` read as a mistake: every key kept working, the obvious "revoke all" failed open.
    path, clock = tmp_path / "keys.yaml", _Clock()
    path.write_text("- {key: sk-one, name: one}\n")
    beside = KeyStore.load(str(path), "sk-env", clock=clock)
    alone = KeyStore.load(str(path), None, clock=clock)
    path.write_text("")  # truncated mid-edit: the keys in use stay
    clock.now += 5
    assert _allowed(beside, "sk-one") and _allowed(alone, "sk-one")
    assert "holds no list of keys (to revoke every key: [])" in caplog.text
    path.write_text("keys: []\n")
    clock.now += 5
    assert not _allowed(beside, "sk-one") and _allowed(beside, "sk-env")
    assert not _allowed(alone, "sk-one")
    assert "none, every request gets 401" in caplog.text


def test_a_keys_file_that_no_longer_reads_shows_on_metrics(start_gateway, tmp_path):
    path, clock = tmp_path / "keys.yaml", _Clock()
    path.write_text("- {key: sk-a, name: a}\n")
    live = start_gateway(KeyStore.load(str(path), None, clock=clock))
    with live.http("sk-a") as http:
        assert http.get("/v1/models").status_code == 200
        assert live.metric("tandem_gateway_api_keys_stale") == 0
        path.write_text("- {key: sk-a, name: a, rmp: 5}\n")  # a mistake
        clock.now += 5
        assert http.get("/v1/models").status_code == 200  # the key in use stays
        assert "tandem_gateway_api_keys_stale 1.0" in http.get("/metrics").text
