"""Waiting for a condition in a test: poll it against a deadline instead of sleeping a fixed time.

`wait_until(predicate, timeout_s)` calls `predicate()` every `interval_s` until it returns something truthy and
returns that value; past the deadline it fails with an AssertionError that says what it waited for. Exceptions of
the types in `retry_on` (say, a connection refused while a server starts) count as "not yet"; the last one is
named in the failure. `wait_until_async` is the same in a coroutine; its predicate may return an awaitable."""
from __future__ import annotations

import asyncio
import inspect
import time
from typing import Any, Callable


def _failure(message, timeout_s: float, last_error: BaseException | None) -> AssertionError:
    text = message() if callable(message) else message
    suffix = f" (last error: {last_error!r})" if last_error is not None else ""
    return AssertionError(f"timed out after {timeout_s:g} s waiting for {text}{suffix}")


def wait_until(predicate: Callable[[], Any], timeout_s: float, interval_s: float = 0.1,
               message: str | Callable[[], str] = "the condition",
               retry_on: tuple[type[BaseException], ...] = ()) -> Any:
    """Poll `predicate` until it is truthy (return its value) or `timeout_s` passes (AssertionError). It is always
    called at least once, and once more at the deadline. `message` may be a callable, called only on failure, so
    that it can describe the last state seen. For a test without an event loop of its own."""
    return asyncio.run(wait_until_async(predicate, timeout_s, interval_s, message, retry_on))


async def wait_until_async(predicate: Callable[[], Any], timeout_s: float, interval_s: float = 0.1,
                           message: str | Callable[[], str] = "the condition",
                           retry_on: tuple[type[BaseException], ...] = ()) -> Any:
    """`wait_until` inside a coroutine: sleeps with asyncio, and awaits the predicate's result if it is awaitable."""
    deadline = time.monotonic() + timeout_s
    while True:
        last_error = None
        try:
            result = predicate()
            if inspect.isawaitable(result):
                result = await result
            if result:
                return result
        except retry_on as e:
            last_error = e
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise _failure(message, timeout_s, last_error)
        await asyncio.sleep(min(interval_s, remaining))
