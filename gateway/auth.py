"""API keys: who is calling, which models they may use, and their quotas.

Keys come from a file (`--api-keys-file`, YAML or JSON: a list of
{key | key_sha256, name, models, rpm, tpm, max_in_flight, prefix_cache, max_priority})
and from TANDEM_API_KEYS (plain
keys separated by commas: every model, no quota). Only SHA-256 digests are
kept, so a memory dump or a log of the store never shows a key.

The file is read again when it changes (looked at every RELOAD_EVERY_S at most, as
requests come), so a key revoked from a mounted Secret stops working without a
restart; a file that no longer reads keeps the keys in use, and says why in the log.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import logging
import os
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tandem import strict_yaml
from tandem.gateway.errors import forbidden, unauthorized

log = logging.getLogger(__name__)

ENV_VAR = "TANDEM_API_KEYS"
# How stale the keys may be: a Secret's update reaches its pods within a minute or
# two (the kubelet's sync), then within this many seconds the gateway's answers.
RELOAD_EVERY_S = 5.0
_NAME = re.compile(r"^[A-Za-z0-9_.@:-]{1,64}$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_FIELDS = {
    "key", "key_sha256", "name", "models", "rpm", "tpm", "max_in_flight", "prefix_cache",
    "max_priority",
}  # fmt: skip
# An unknown field shown by name: a word a field could be, not an API key's shape.
_FIELD_LIKE = re.compile(r"^[a-z_][a-z0-9_]{0,23}$")
# Quoted in a YAML error: three characters or more could be (part of) a key.
_QUOTED = re.compile(r"'[^'\s][^']+[^'\s]'|\"[^\"\s][^\"]+[^\"\s]\"")
_PRIORITY_NAMES = ("high", "normal", "low")
_PREFIX_CACHES = ("shared", "own")


@dataclass(frozen=True, slots=True)
class ApiKey:
    """A caller: its name (for quotas and logs, never the key), models and limits."""

    name: str
    # None: every model.
    models: frozenset[str] | None = None
    # Requests and tokens per minute; None: unlimited.
    rpm: int | None = None
    tpm: int | None = None
    # Its requests being answered at once, on every replica (in_flight.py); None: any.
    max_in_flight: int | None = None
    # Its prompts share the engines' prefix cache only among themselves (prefix_cache:
    # own): no other caller can tell from cached_tokens or speed what it sent.
    own_prefix_cache: bool = False
    # The highest priority its requests may ask for (max_priority: a tenant's requests
    # otherwise jump every other's queue); None: any.
    max_priority: str | None = None

    def allows(self, model: str) -> bool:
        return self.models is None or model in self.models


ANONYMOUS = ApiKey("anonymous")


class KeyStore:
    """Digest -> ApiKey; `open_access()` lets everyone in as ANONYMOUS (--no-auth)."""

    def __init__(
        self,
        keys: Mapping[bytes, ApiKey],
        *,
        open_access: bool = False,
        source: _KeyFile | None = None,
    ) -> None:
        if not keys and not open_access and source is None:
            raise ValueError(
                "no API keys configured: pass --api-keys-file, set TANDEM_API_KEYS, "
                "or run with --no-auth on a trusted network"
            )
        self._keys = dict(keys)
        self.open_access = open_access
        self._source = source  # None: the keys never change
        # The file's last change could not be read: the keys before it stay in use.
        self.stale = False

    @classmethod
    def open(cls) -> KeyStore:
        return cls({}, open_access=True)

    @classmethod
    def load(
        cls,
        path: str | None,
        env_value: str | None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> KeyStore:
        """Keys from a file and/or the TANDEM_API_KEYS value; ValueError if none or bad.
        A file is read again once it changes; `clock` times the looks at it."""
        if not path:
            return cls(_read_keys(None, env_value))
        source = _KeyFile(Path(path), env_value, clock)
        keys = source.read()
        if not keys:  # `[]`: every key revoked, as in a reload; a restart must not crash-loop
            log.warning("API keys read from %s: none, every request gets 401", path)
        return cls(keys, source=source)

    def _refresh(self) -> None:
        if self._source is None:
            return
        try:
            keys = self._source.read_if_changed()
        except ValueError as exc:  # mid-edit, or a mistake: refusing everyone helps no one
            log.error("API keys not reloaded, the %d in use stay: %s", len(self._keys), exc)
            self.stale = True
            return
        if keys is not None:
            self.stale = False
            if keys:
                log.info("API keys reloaded from %s: %d keys", self._source.path, len(keys))
            else:  # the file's [] with no TANDEM_API_KEYS: every key revoked
                log.warning(
                    "API keys reloaded from %s: none, every request gets 401", self._source.path
                )
            self._keys = keys

    def __len__(self) -> int:
        return len(self._keys)

    def caller(self, authorizations: Sequence[str]) -> ApiKey:
        """The caller of a request's Authorization headers (all of them), or a 401."""
        if len(authorizations) > 1 and not self.open_access:  # --no-auth takes everyone
            # Which one counts would be this server's guess (a proxy's added one, or the
            # client's?): the first let a good key pass beside a bad one, the order decided.
            raise unauthorized(
                f"{len(authorizations)} Authorization headers: send one, "
                "'Authorization: Bearer <key>'",
                "invalid_api_key",
            )
        return self.authenticate(authorizations[0] if authorizations else None)

    def authenticate(self, authorization: str | None) -> ApiKey:
        """The caller of an `Authorization: Bearer <key>` header, or a 401."""
        if self.open_access:
            return ANONYMOUS
        self._refresh()
        words = (authorization or "").split(None, 1)  # a tab after the scheme is space too
        if len(words) < 2 or words[0].lower() != "bearer":
            # No key as OpenAI reads it (a Basic credential too). The header itself is
            # not quoted: "Bearersk-..." holds a key.
            other = ""
            if words and words[0].lower() != "bearer":
                other = " (the Authorization header holds no Bearer credential)"
            raise unauthorized(
                f"Missing API key{other}: send it as 'Authorization: Bearer <key>'",
                "missing_api_key",
            )
        token = words[1].strip()
        digest = _digest(token)
        # Every stored digest is compared, in constant time and without stopping at
        # a match, so the answer's timing says nothing about which bytes matched.
        # Linear in the number of keys: a key file holds tens or hundreds.
        found: ApiKey | None = None
        for stored, key in self._keys.items():
            if hmac.compare_digest(digest, stored):
                found = key
        if found is None:
            raise unauthorized("Incorrect API key provided", "invalid_api_key")
        return found


class _KeyFile:
    """An API keys file (and the TANDEM_API_KEYS value beside it), read again once it
    changes: its inode (a Secret's volume swaps a symlink), size or mtime."""

    def __init__(self, path: Path, env_value: str | None, clock: Callable[[], float]) -> None:
        self.path, self._env_value, self._clock = path, env_value, clock
        self._stamp: tuple[int, int, int] | None = None
        self._looked_at = clock()

    def read(self) -> dict[bytes, ApiKey]:
        """The keys now; ValueError if they do not read."""
        self._stamp = self._stat()
        return _read_keys(self.path, self._env_value)

    def read_if_changed(self) -> dict[bytes, ApiKey] | None:
        """The keys, if the file changed since it was read (looked at every
        RELOAD_EVERY_S at most); None if not. ValueError if they do not read (once
        per change: the next look waits for another)."""
        now = self._clock()
        if now - self._looked_at < RELOAD_EVERY_S:
            return None
        self._looked_at = now
        stamp = self._stat()
        if stamp == self._stamp:
            return None
        return self.read()

    def _stat(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None  # gone: read() says so
        return st.st_ino, st.st_size, st.st_mtime_ns


def _read_keys(path: Path | None, env_value: str | None) -> dict[bytes, ApiKey]:
    entries: list[tuple[bytes, ApiKey]] = []
    if path is not None:
        entries += parse_key_file(path)
    if env_value and env_value.strip():
        entries += parse_env_keys(env_value)
    keys: dict[bytes, ApiKey] = {}
    names: set[str] = set()
    for digest, key in entries:
        if digest in keys:
            raise ValueError(f"API key of {key.name!r} is listed twice")
        if key.name in names:
            taken = (
                f" ({ENV_VAR}'s keys are named env-1, env-2, ...)"
                if key.name.startswith("env-")
                else ""
            )
            raise ValueError(
                f"API key name {key.name!r} is used twice: names must be unique{taken}"
            )
        keys[digest] = key
        names.add(key.name)
    return keys  # empty where neither lists one (a store refuses that at start)


def check_model(key: ApiKey, model: str) -> None:
    """403 unless the key may use the model."""
    if not key.allows(model):
        raise forbidden(f"API key {key.name!r} is not allowed to use model {model!r}")


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


# ------------------------------------------------------------------ parsing


def parse_env_keys(value: str) -> list[tuple[bytes, ApiKey]]:
    keys = [k.strip() for k in value.split(",") if k.strip()]
    for i, key in enumerate(keys):
        _check_sendable(f"TANDEM_API_KEYS: key #{i + 1}", key)
    return [(_digest(k), ApiKey(f"env-{i + 1}")) for i, k in enumerate(keys)]


def _check_sendable(where: str, key: str) -> None:
    # An HTTP header reaches the server as Latin-1 bytes: a key beyond ASCII loads, and
    # its holder is refused whatever they send.
    if not key.isascii() or not key.isprintable():
        raise ValueError(f"{where}: a key must be printable ASCII (it travels in a header)")


def parse_key_file(path: Path) -> list[tuple[bytes, ApiKey]]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise ValueError(f"cannot read API keys file {path}: {exc.strerror}") from None
    data = _load(path, text)
    if isinstance(data, dict) and "keys" in data:
        data = data["keys"]
    if data is None:  # an empty file: more likely one mid-edit than a wish to revoke all
        raise ValueError(f"{path}: holds no list of keys (to revoke every key: [])")
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a list of keys")
    return [_entry(path, i, item) for i, item in enumerate(data)]


def _load(path: Path, text: str) -> Any:
    if path.suffix.lower() == ".json":
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON: {exc}") from None
    if text.lstrip().startswith(("[", "{")):  # JSON, or YAML's flow style: [{key: ...}]
        with contextlib.suppress(json.JSONDecodeError):
            return json.loads(text)
    try:
        return strict_yaml.load(text)
    except yaml.YAMLError as exc:  # never PyYAML's excerpt: the line may hold a key
        # Nor the tokens its words quote (an undefined alias, an unknown tag: a key
        # that begins with * or !), but for a character or two (',' or '\t').
        said = _QUOTED.sub(_field_or_dots, strict_yaml.problem(exc))
        raise ValueError(f"{path}: not valid YAML: {said}") from None


def _field_or_dots(quoted: re.Match[str]) -> str:
    """A quoted word of a YAML error, kept where it reads as a field name ('rpm')."""
    word = quoted.group(0)[1:-1]
    plain = _FIELD_LIKE.match(word) or re.fullmatch(r"<[a-z ]+>", word)  # PyYAML's <stream end>
    return quoted.group(0) if plain else "'...'"


def _entry(path: Path, index: int, item: Any) -> tuple[bytes, ApiKey]:
    where = f"{path}: key #{index + 1}"
    if not isinstance(item, dict):
        raise ValueError(f"{where}: expected a mapping, got {type(item).__name__}")
    unknown = set(item) - _FIELDS
    if unknown:
        # Named where they read as a misspelt field ('rmp'); a key written where a field
        # goes (`- sk-...: x`) must not reach the log.
        shown = sorted(str(f) for f in unknown if _FIELD_LIKE.match(str(f)))
        others = len(unknown) - len(shown)
        said = ", ".join([*map(repr, shown), *([f"{others} not shown"] if others else [])])
        raise ValueError(f"{where}: unknown fields [{said}]; known: {sorted(_FIELDS)}")
    name = item.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"{where}: name must be 1-64 of A-Z a-z 0-9 _ . @ : -, got {name!r}")
    where = f"{path}: key {name!r}"
    if ("key" in item) == ("key_sha256" in item):
        raise ValueError(f"{where}: give exactly one of key or key_sha256")
    if "key" in item:
        if not isinstance(item["key"], str) or not item["key"].strip():
            raise ValueError(f"{where}: key must be a non-empty string")
        _check_sendable(where, item["key"].strip())
        digest = _digest(item["key"].strip())
    else:
        hexed = item["key_sha256"]
        if not isinstance(hexed, str) or not _HEX64.match(hexed.lower()):
            raise ValueError(f"{where}: key_sha256 must be 64 hex digits")
        digest = bytes.fromhex(hexed)
    return digest, ApiKey(
        name,
        _models(where, item.get("models", "*")),
        _limit(where, "rpm", item.get("rpm")),
        _limit(where, "tpm", item.get("tpm")),
        _limit(where, "max_in_flight", item.get("max_in_flight")),
        _prefix_cache(where, item.get("prefix_cache", "shared")),
        _max_priority(where, item.get("max_priority")),
    )


def _models(where: str, value: Any) -> frozenset[str] | None:
    if value == "*" or value == ["*"]:
        return None
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value or not all(isinstance(m, str) and m for m in value):
        raise ValueError(f'{where}: models must be "*" or a non-empty list of model names')
    if "*" in value:
        raise ValueError(f'{where}: models lists "*" among names; use "*" alone')
    return frozenset(value)


def _prefix_cache(where: str, value: Any) -> bool:
    """Whether prefix_cache is "own"."""
    if value not in _PREFIX_CACHES:
        raise ValueError(f'{where}: prefix_cache must be "shared" or "own", got {value!r}')
    return value == "own"


def _max_priority(where: str, value: Any) -> str | None:
    if value is None or value == "high":
        return None
    if value not in _PRIORITY_NAMES:
        raise ValueError(f"{where}: max_priority must be high, normal or low, got {value!r}")
    return value


def _limit(where: str, name: str, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{where}: {name} must be a positive integer (or absent: unlimited)")
    return value
