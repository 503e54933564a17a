"""Two asyncio Redis clients, as two gateway replicas hold: for the Redis scripts that
must agree across replicas (quotas, requests in flight)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

import redis.asyncio as aioredis

T = TypeVar("T")


def run_on_two_clients(
    redis_url: str, work: Callable[[aioredis.Redis, aioredis.Redis], Awaitable[T]]
) -> T:
    """work(a, b) run to its end on two clients of the Redis at redis_url."""

    async def main() -> T:
        clients = [aioredis.Redis.from_url(redis_url) for _ in range(2)]
        try:
            return await work(*clients)
        finally:
            for client in clients:
                await client.aclose()

    return asyncio.run(main())
