"""ObjectLocks: passes of one object never overlap, and unused locks are dropped."""

from __future__ import annotations

import asyncio

import pytest

from tandem.operator.object_locks import ObjectLocks

pytestmark = pytest.mark.asyncio


async def test_passes_of_one_object_take_turns_and_leave_nothing_behind():
    locks = ObjectLocks()
    inside: list[str] = []
    most = 0
    beside_m: list[str] = []  # what of "m" was inside as "c" came in

    async def pass_(key: str, who: str) -> None:
        nonlocal most
        async with locks.hold(key):
            if who == "c":
                beside_m.extend(inside)
            inside.append(who)
            most = max(most, inside.count("a") + inside.count("b"))
            await asyncio.sleep(0.01)
            inside.remove(who)

    # Three passes of one object (the last of a new object of its name, after a
    # deletion), one of another that need not wait.
    await asyncio.gather(pass_("m", "a"), pass_("m", "b"), pass_("m", "a"), pass_("n", "c"))
    assert most == 1  # never two of "m" at once
    assert beside_m == ["a"]  # "n" ran beside "m": one slow model holds up no other
    assert len(locks) == 0  # the object gone, so is its lock


async def test_an_exception_inside_still_lets_the_next_pass_in():
    locks = ObjectLocks()
    with pytest.raises(RuntimeError):
        async with locks.hold("m"):
            raise RuntimeError("a failing pass")
    async with asyncio.timeout(1):
        async with locks.hold("m"):
            pass
    assert len(locks) == 0
