"""ModelDirectory: which models are served, from the registry and the catalog, briefly cached.

A model is served when it has live engines (the registry), had some moments
ago (RECENTLY_SERVED_S), or a controller declares it (tandem/catalog.py: scaled
to zero, its engines start on queued work); requests for any other name are
answered 404.

A model no controller declares is only as good as its live engines: prompt
engines without a decode (completion) engine, or the reverse, can never finish
a request, and nobody will start the missing role, so admission refuses those
up front (`missing_role`) instead of queueing work that can only time out. A
declared model is queued whatever its engines: its controller brings them,
possibly one role after the other.

Asking the registry and the catalog costs a few round trips; a request path that did so every
time would spend them for an answer that changes every few seconds at most
(an engine's entry lives 10 s past its last heartbeat). Concurrent requests
share one refresh.
"""

from __future__ import annotations

import asyncio
import time

from redis.exceptions import RedisError

from tandem.gateway.auth import ApiKey
from tandem.gateway.broker import Broker
from tandem.gateway.metrics import UNKNOWN_MODEL
from tandem.protocol import Role
from tandem.registry_entry import ENGINE_TTL_SECONDS, EngineInfo

# A model missing from the cache triggers a refresh, at most this often: an
# engine that just started is found at once, unknown names cost little.
_MISS_REFRESH_S = 0.1
# A model whose engines were live this recently still counts as served: its
# requests are queued, not 404. Twice an engine entry's TTL, from the last time the
# registry showed them, or the last time it could not be read: after a Redis
# outage the entries have expired (or were lost) until each engine beats again.
RECENTLY_SERVED_S = 2 * ENGINE_TTL_SECONDS
# After a refresh that failed, requests fail with its error this long rather than
# each try again in turn (a burst queued on the lock held them seconds each).
_FAILED_REFRESH_S = 0.5


class ModelDirectory:
    def __init__(self, broker: Broker, ttl_s: float) -> None:
        self.broker = broker
        self.ttl_s = ttl_s
        self._models: dict[str, list[EngineInfo]] = {}
        self._declared: set[str] = set()
        self._fetched_at = -float("inf")
        self._lock = asyncio.Lock()
        # Model -> time.monotonic() when its engines were last known live.
        self._last_served: dict[str, float] = {}
        self._failed: tuple[float, Exception] | None = None

    async def models(self, *, max_age: float | None = None) -> dict[str, list[EngineInfo]]:
        """Live engines by served model name; a declared model without any maps to []."""
        max_age = self.ttl_s if max_age is None else max_age
        if time.monotonic() - self._fetched_at <= max_age:
            return self._models
        async with self._lock:
            if time.monotonic() - self._fetched_at > max_age:  # nobody refreshed meanwhile
                await self._refresh()
        return self._models

    async def _refresh(self) -> None:
        if self._failed is not None and time.monotonic() - self._failed[0] < _FAILED_REFRESH_S:
            raise self._failed[1]
        try:
            declared = await self.broker.declared_models()
            engines = await self.broker.live_engines()
        except (RedisError, OSError) as exc:
            now = time.monotonic()
            self._failed = (now, exc)
            # Unknown now, not gone: what was served counts as served until it can tell.
            self._last_served = dict.fromkeys(self._last_served, now)
            raise
        self._failed = None
        by_model: dict[str, list[EngineInfo]] = {name: [] for name in declared}
        for info in engines:
            by_model.setdefault(info.model, []).append(info)
        now = time.monotonic()
        self._last_served.update((model, now) for model, infos in by_model.items() if infos)
        self._last_served = {
            model: at for model, at in self._last_served.items() if now - at < RECENTLY_SERVED_S
        }
        self._models = by_model
        self._declared = declared
        self._fetched_at = now

    async def served_for(self, caller: ApiKey) -> list[str]:
        """The models served that `caller` may use, sorted (what GET /v1/models lists)."""
        return sorted(name for name in await self.models() if caller.allows(name))

    async def is_served(self, model: str) -> bool:
        if model in await self.models():
            return True
        if model in await self.models(max_age=_MISS_REFRESH_S):
            return True
        # Its engines were live moments ago (restarting, or not yet beaten again after a
        # Redis outage): queue, as for a declared model, rather than refuse.
        since = self._last_served.get(model)
        return since is not None and time.monotonic() - since < RECENTLY_SERVED_S

    async def missing_role(self, model: str) -> tuple[str, str] | None:
        """(missing role, present role) when `model` is not declared and its live
        engines (draining included, as for being served) are prompt engines without
        a completion engine or the reverse; None when a request can be finished."""
        if self._missing_role(model) is None:
            return None
        # An engine of the missing role may have just registered: look again.
        await self.models(max_age=_MISS_REFRESH_S)
        return self._missing_role(model)

    def _missing_role(self, model: str) -> tuple[str, str] | None:
        if model in self._declared:
            return None
        roles = {info.role for info in self._models.get(model, ())}
        if not roles or Role.NORMAL in roles or {Role.PROMPT, Role.COMPLETION} <= roles:
            return None
        if Role.PROMPT in roles:
            return Role.COMPLETION.value, Role.PROMPT.value
        if Role.COMPLETION in roles:
            return Role.PROMPT.value, Role.COMPLETION.value
        return None  # roles of a newer engine this gateway does not know: let it try

    def context_length(self, model: str) -> int | None:
        """The longest context any of `model`'s live engines serves (as of the last
        refresh): a request longer fits none of them. None when an engine does not say
        (one from before the field), or none is live (scaled to zero)."""
        lengths = [info.max_model_len for info in self._models.get(model, ())]
        if not lengths or None in lengths:
            return None
        return max(lengths)  # type: ignore[type-var]

    def renders_chat_options(self, model: str) -> bool:
        """Whether every live engine of `model` that takes work items renders their chat
        template options (as of the last refresh; decoders take the prompt's token ids);
        True when none is live (scaled to zero)."""
        engines = self._models.get(model, ())
        return all(info.chat_options for info in engines if info.role != Role.COMPLETION)

    def salts_prefix_cache(self, model: str) -> bool:
        """Whether every live engine of `model` keeps a work item's cache_salt apart in
        its prefix cache (as of the last refresh); True when none is live. One from
        before the salt reads the item without it and shares cached prompts across
        tenants. No entry says so itself: chat options came after the salt, so an engine
        that renders them keeps it."""
        return all(info.chat_options for info in self._models.get(model, ()))

    async def stall(self, model: str, *, taken: bool) -> str:
        """Why a request for `model` may have run out of time, as far as the (cached)
        registry tells; "" when it tells nothing. `taken`: an engine had started it."""
        roles = {i.role for i in (await self.models()).get(model, ()) if not i.draining}
        if not taken:
            if Role.NORMAL not in roles and Role.PROMPT not in roles:
                return (
                    f": no engine that takes new requests (normal or prompt) was live for "
                    f"{model!r} at the deadline, and none took it from the queue"
                )
            # (An engine may hold it unstarted, behind others: it writes nothing until then.)
            return ": no engine had started it: it waited in the queue or in a busy engine"
        if roles & {Role.NORMAL, Role.COMPLETION}:
            return ""  # still generating, or its engine died and nobody took it over yet
        if Role.PROMPT in roles:
            return (
                f": a prompt engine started it, but no decode (completion) engine was live "
                f"for {model!r} at the deadline to finish it"
            )
        return f": an engine started it, but no engine was live for {model!r} at the deadline"

    def label(self, model: str) -> str:
        """The model's name for metric labels if it is served, else "unknown"."""
        return model if model in self._models else UNKNOWN_MODEL
