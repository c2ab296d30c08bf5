"""Publishes the engine's KV events over ZMQ as vLLM does: PUB [topic, seq, batch], and a ROUTER socket that
resends buffered batches from a sequence number (a subscriber that sees a gap in seq asks for it).

The engine loop only encodes a batch and hands it over an inproc socket; a thread owns the PUB and ROUTER
sockets, numbers the batches and answers replays, so a slow replay request never stalls a step. The first
batch of a (re)started engine is AllBlocksCleared at seq 0: a router drops what it knew of the old process."""
from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque

import zmq

from tokenmill.config import KVEventsConfig
from tokenmill.engine.kv_events import AllBlocksCleared, KVEvent, KVEventBatch, encode_batch

logger = logging.getLogger("tokenmill.engine.kv_event_publisher")

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)  # vLLM's marker: replay done


def _binds(endpoint: str) -> bool:
    """vLLM's rule: a wildcard address (or ipc/inproc) is bound, a concrete one connected to."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqEventPublisher:
    def __init__(self, config: KVEventsConfig):
        self.config = config
        self.ctx = zmq.Context()
        self.ctx.setsockopt(zmq.LINGER, 0)  # every socket: exiting never waits on a slow subscriber
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.set_hwm(config.hwm)
        (self.pub.bind if _binds(config.endpoint) else self.pub.connect)(config.endpoint)
        self.replay = None
        if config.replay_endpoint:
            self.replay = self.ctx.socket(zmq.ROUTER)
            self.replay.bind(config.replay_endpoint)
        inbox_address = f"inproc://kv-events-{id(self)}"
        self.inbox = self.ctx.socket(zmq.PAIR)
        self.inbox.bind(inbox_address)
        self.outbox = self.ctx.socket(zmq.PAIR)  # used by the engine thread only
        self.outbox.set_hwm(config.max_queue_size)
        self.outbox.connect(inbox_address)
        self.topic = config.topic.encode()
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self.thread = threading.Thread(target=self._run, name="kv-event-publisher", daemon=True)
        self.thread.start()
        self.publish([AllBlocksCleared()])

    def publish(self, events: list[KVEvent]) -> None:
        """Called from the engine loop after a step; blocks only if max_queue_size batches are waiting."""
        self.outbox.send(encode_batch(KVEventBatch(time.time(), events)))

    def shutdown(self) -> None:
        self.outbox.send(b"")  # an empty frame stops the thread once the batches before it are out
        self.thread.join(timeout=2)
        self.ctx.destroy(linger=0)

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.inbox, zmq.POLLIN)
        if self.replay is not None:
            poller.register(self.replay, zmq.POLLIN)
        seqs = itertools.count()
        while True:
            ready = dict(poller.poll())
            if self.replay in ready:
                try:
                    self._serve_replay()
                except zmq.ZMQError:
                    logger.exception("KV event replay failed")
            if self.inbox in ready:
                payload = self.inbox.recv()
                if not payload:
                    return
                seq = next(seqs)
                self.pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
                self.buffer.append((seq, payload))

    def _serve_replay(self) -> None:
        """A request is [identity, b"", start seq]; each buffered batch from there goes back as
        [identity, b"", seq, payload], then [identity, b"", -1, b""]."""
        frames = self.replay.recv_multipart()
        if len(frames) != 3:
            logger.warning("ignoring a malformed KV event replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self.buffer):
            if seq >= start_seq:
                self.replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self.replay.send_multipart((client, b"", END_OF_REPLAY, b""))


def make_publisher(config: KVEventsConfig | None) -> ZmqEventPublisher | None:
    if config is None or not config.publishes:
        return None
    publisher = ZmqEventPublisher(config)
    logger.info("publishing KV events on %s (replay: %s, topic %r)", config.endpoint, config.replay_endpoint,
                config.topic)
    return publisher
