"""The tests' own polling helper: returns the first truthy value, fails with a clear message at the deadline."""
from __future__ import annotations

import asyncio
import time

import pytest

from helpers import wait_until, wait_until_async


def test_returns_the_first_truthy_value():
    calls = []

    def ready():
        calls.append(1)
        return len(calls) >= 3 and "done"

    assert wait_until(ready, timeout_s=5, interval_s=0.001) == "done"
    assert len(calls) == 3


def test_fails_at_the_deadline_with_the_message_and_the_last_error():
    start = time.monotonic()
    with pytest.raises(AssertionError, match=r"timed out after 0.05 s waiting for the span"):
        wait_until(lambda: None, timeout_s=0.05, interval_s=0.01, message=lambda: "the span")
    assert 0.05 <= time.monotonic() - start < 2

    def refused():
        raise ConnectionRefusedError("not yet")

    with pytest.raises(AssertionError, match=r"last error: ConnectionRefusedError\('not yet'\)"):
        wait_until(refused, timeout_s=0.02, interval_s=0.01, retry_on=(ConnectionRefusedError,))
    with pytest.raises(ValueError):  # other errors are not swallowed
        wait_until(lambda: int("x"), timeout_s=1, retry_on=(ConnectionRefusedError,))


def test_async_awaits_the_predicate():
    calls = []

    async def ready():
        calls.append(1)
        await asyncio.sleep(0)
        return len(calls) >= 2

    assert asyncio.run(wait_until_async(ready, timeout_s=5, interval_s=0.001)) is True
    with pytest.raises(AssertionError, match="waiting for nothing"):
        asyncio.run(wait_until_async(lambda: 0, timeout_s=0.02, interval_s=0.01, message="nothing"))
