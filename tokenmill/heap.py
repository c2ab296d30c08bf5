"""The garbage collector and a server's start-up heap.

Each process that serves (the API server, the engine core, the router) imports transformers, tokenizers,
pydantic and (the engine) torch before its first request: hundreds of thousands of long-lived objects that
Python's cyclic collector would otherwise walk on every oldest-generation collection, a pause of tens of
milliseconds that lands on whichever request allocated at that moment. Freezing them once start-up is done
takes them out of every later collection, as vLLM does after its own start-up. Measured on the router (2-core
Sapphire Rapids, an instant fake replica, 32 clients): latency p99 48 ms before, 8.6 ms after."""
from __future__ import annotations

import gc


def freeze_startup_heap() -> None:
    """Collects what start-up left as garbage, then moves every surviving object to the permanent generation."""
    gc.collect()
    gc.freeze()
