"""Disaggregated prefill/decode over TCP (`--kv-transfer-config` with TCPConnector): a prefill instance hands a
prompt's KV blocks to a decode instance.

Prefill side (kv_producer, kv_both): a request with kv_transfer_params `do_remote_decode` that ends at its length
limit (vLLM's rule: max_tokens 1, as its proxy sends) keeps its full prompt blocks pinned (a reference held, so the
pool hands none out) in a KVBlockServer, and its last output carries the kv_transfer_params a decode instance needs
(vLLM's NixlConnector keys). A thread of the engine process serves the pinned blocks' bytes on a ZMQ ROUTER socket
bound to kv_ip:kv_port: each block read from the pool behind a header with the layout key, its block hash and a
CRC-32 (kv_blocks.BlockLayout.entries). The pin ends when the decode instance says it is done (its fetch carries
`release`), or abort_request_timeout seconds after the request finished (vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT):
the step loop frees the blocks (take_released), never the server thread.

Decode side (kv_consumer, kv_both): a request with `do_remote_prefill` is admitted like a request whose prefix a
KV tier holds (scheduler.py `_load_from_remote`, kv_offload.py): its blocks past the pool's own prefix hits are
allocated and a LoadJob goes to the offloader's worker thread, which fetches them with a KVBlockClient and writes
them into the fresh blocks in place; the request waits outside every step until finish_load. So no step waits
on the network, and a prefix the decode instance already caches is never fetched (counted: blocks_skipped).

Checks: a connection starts with a Hello carrying the layout key (a digest of the model's checkpoint, dtypes,
backend layout, block size and KV scales) and the layout's identity; a prefill instance with another layout
refuses it, naming what differs. Each block is checked again on arrival (kv_blocks.unpack: layout, block hash,
length, checksum), and the block hash is the decode instance's own (engine/block_hash.py), so a prompt that is not
the one the prefill instance computed never gets its blocks. Whatever fails (the prefill instance gone, its pin
expired, a timeout, a refused layout, a damaged block) costs recomputation of the blocks not received
(kv_load_failure_policy "recompute"), one log line, and a counter by reason."""
from __future__ import annotations

import logging
import socket
import threading
import time
import uuid
from dataclasses import dataclass

import msgspec
import zmq

from tokenmill.engine.kv_blocks import BlockLayout
from tokenmill.kv_transfer_params import KVTransferParams

logger = logging.getLogger("tokenmill.engine")


# ---- the wire: msgpack over a ZMQ REQ (decode) / ROUTER (prefill) pair ----

class Hello(msgspec.Struct, tag="hello", array_like=True):
    engine_id: str  # the prefill engine the decode instance expects (remote_engine_id)
    layout_key: bytes
    identity: dict  # BlockLayout.identity, to name what differs when the keys do


class Fetch(msgspec.Struct, tag="fetch", array_like=True):
    request_id: str  # remote_request_id
    indices: list[int]  # positions in the request's chain of pinned blocks
    block_hashes: list[bytes]  # the decode instance's hashes of those blocks
    release: bool  # unpin the request's blocks once answered


class Reply(msgspec.Struct, array_like=True):
    """The first frame of an answer; each entry (BlockLayout.entries: a block asked for, up to the first whose hash
    differs) follows in a frame of its own, so that no encoder copies tens of MB (msgpack of a list of entries cost
    as much as reading the blocks from the pool)."""
    error: str | None = None  # None: ok
    reason: str = ""  # for the counters: unknown (stale), engine, layout
    entries: list = []  # not encoded: the frames after this one


WireMessage = Hello | Fetch


class TransferError(Exception):
    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclass
class Pin:
    blocks: list  # the pool's KVCacheBlocks, a reference held on each
    block_hashes: list[bytes]
    deadline: float
    serving: bool = False  # the server thread reads them now: not freed meanwhile
    released: bool = False


@dataclass
class TransferCounters:
    """The prefill side's (pins, sent) and the decode side's (fetched, skipped, failures) counters."""
    pins_expired: int = 0
    blocks_sent: int = 0
    bytes_sent: int = 0
    blocks_fetched: int = 0
    blocks_skipped: int = 0
    bytes_received: int = 0

    def __post_init__(self):
        self.fetch_failures: dict[str, int] = {}
        # the decode side's fetch time by phase, cumulative: queued (waiting for the worker), network (the
        # request, the prefill side's read and the reply), checks (each block's header and CRC-32), write (into
        # the pool)
        self.phase_seconds: dict[str, float] = {"queued": 0.0, "network": 0.0, "checks": 0.0, "write": 0.0}
        self.fetch_seconds: list[float] = []
        self.tokens_fetched: list[int] = []

    def failed(self, reason: str) -> None:
        self.fetch_failures[reason] = self.fetch_failures.get(reason, 0) + 1


def advertised_host(kv_ip: str) -> str:
    """The host a decode instance connects to: kv_ip, or this machine's address when it binds every interface."""
    if kv_ip not in ("0.0.0.0", "::", "*", ""):
        return kv_ip
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


class KVBlockServer:
    """The prefill side: pins finished requests' blocks and serves their bytes on kv_ip:kv_port (0: a free port)."""

    def __init__(self, layout: BlockLayout, engine_id: str, kv_ip: str, kv_port: int, timeout: float,
                 counters: TransferCounters):
        self.layout = layout
        self.engine_id = engine_id
        self.timeout = timeout
        self.counters = counters
        self._pins: dict[str, Pin] = {}
        self._lock = threading.Lock()
        self._ctx = zmq.Context.instance()
        self._socket = self._ctx.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        host = "*" if kv_ip in ("0.0.0.0", "") else kv_ip
        try:
            if kv_port == 0:
                self.port = self._socket.bind_to_random_port(f"tcp://{host}")
            else:
                self._socket.bind(f"tcp://{host}:{kv_port}")
                self.port = kv_port
        except zmq.ZMQError as e:
            self._socket.close()
            raise ValueError(f"--kv-transfer-config: cannot serve KV blocks on {kv_ip}:{kv_port} ({e})") from None
        self.host = advertised_host(kv_ip)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kv-block-server", daemon=True)
        self._thread.start()
        logger.info("KV blocks for decode instances served on %s:%d (engine %s, pinned up to %g s)", self.host,
                    self.port, engine_id, timeout)

    # ---- the step loop's side ----

    def pin(self, request_id: str, blocks: list, block_hashes: list[bytes]) -> KVTransferParams:
        """Keeps these blocks (the caller has taken a reference on each) for a decode instance; returns what it
        needs to fetch them."""
        if blocks:
            with self._lock:
                self._pins[request_id] = Pin(blocks, block_hashes, time.monotonic() + self.timeout)
        return KVTransferParams(do_remote_prefill=True, remote_engine_id=self.engine_id,
                                remote_block_ids=[b.block_id for b in blocks], remote_host=self.host,
                                remote_port=self.port, remote_request_id=request_id, tp_size=1)

    def take_released(self) -> list:
        """The blocks to free now: those a decode instance is done with, and those past their deadline."""
        now, out = time.monotonic(), []
        with self._lock:
            for request_id, pin in list(self._pins.items()):
                if pin.serving:
                    continue
                if not pin.released and now < pin.deadline:
                    continue
                if not pin.released:
                    self.counters.pins_expired += 1
                    logger.warning("KV transfer: no decode instance fetched %s's %d blocks within %g s; freed",
                                   request_id, len(pin.blocks), self.timeout)
                del self._pins[request_id]
                out.extend(reversed(pin.blocks))
        return out

    @property
    def num_pinned_requests(self) -> int:
        return len(self._pins)

    @property
    def num_pinned_blocks(self) -> int:
        with self._lock:
            return sum(len(pin.blocks) for pin in self._pins.values())

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    # ---- the server thread ----

    def _serve(self) -> None:
        decoder, encoder = msgspec.msgpack.Decoder(WireMessage), msgspec.msgpack.Encoder()
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(200):
                continue
            peer, _, frame = self._socket.recv_multipart()
            try:
                msg = decoder.decode(frame)
                reply = self._hello(msg) if isinstance(msg, Hello) else self._fetch(msg)
            except msgspec.DecodeError as e:
                reply = Reply(f"not a KV transfer message: {e}", "protocol")
            except Exception as e:  # noqa: BLE001 - one bad fetch must not stop the server
                logger.exception("KV block server: a fetch failed")
                reply = Reply(f"{type(e).__name__}: {e}", "server")
            entries, reply.entries = reply.entries, []
            self._socket.send_multipart([peer, b"", encoder.encode(reply), *entries], copy=False)
        self._socket.close()

    def _hello(self, msg: Hello) -> Reply:
        if msg.engine_id != self.engine_id:
            return Reply(f"this instance is engine {self.engine_id!r}, not {msg.engine_id!r}", "engine")
        if msg.layout_key != self.layout.key():
            mine = self.layout.identity
            differ = sorted(k for k in set(mine) | set(msg.identity) if mine.get(k) != msg.identity.get(k))
            what = ", ".join(f"{k}: {mine.get(k)!r} here, {msg.identity.get(k)!r} there" for k in differ
                             if k != "model") + (", the model's checkpoint" if "model" in differ else "")
            return Reply("the KV layouts differ (" + (what or "the one-byte cache's KV scales") + "): blocks from "
                         "this prefill instance would mean nothing to that decode instance", "layout")
        return Reply()

    def _fetch(self, msg: Fetch) -> Reply:
        with self._lock:
            pin = self._pins.get(msg.request_id)
            if pin is None:
                return Reply(f"no KV blocks are held for {msg.request_id!r} (never pinned, already fetched, or "
                             "released after abort_request_timeout)", "unknown")
            pin.serving = True
        try:
            ids, hashes = [], []
            for i, block_hash in zip(msg.indices, msg.block_hashes):
                if not 0 <= i < len(pin.blocks) or pin.block_hashes[i] != block_hash:
                    break  # another prompt from there on: the decode instance computes the rest
                ids.append(pin.blocks[i].block_id)
                hashes.append(block_hash)
            entries = self.layout.entries(ids, hashes)
            self.counters.blocks_sent += len(entries)
            self.counters.bytes_sent += sum(len(e) for e in entries)
            return Reply(entries=entries)
        finally:
            with self._lock:
                pin.serving = False
                pin.released = pin.released or msg.release


class KVBlockClient:
    """The decode side: fetches blocks from prefill instances (called from the offloader's worker thread only).
    One REQ socket per prefill instance, opened with a Hello; a timeout or refusal drops it (the next fetch opens
    a new one)."""

    def __init__(self, layout: BlockLayout, timeout: float, counters: TransferCounters):
        self.layout = layout
        self.timeout = timeout
        self.counters = counters
        self._ctx = zmq.Context.instance()
        self._sockets: dict[tuple[str, int, str], zmq.Socket] = {}
        self._encoder, self._decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(Reply)

    def fetch(self, params: KVTransferParams, indices: list[int], block_hashes: list[bytes],
              release: bool = True) -> list[memoryview]:
        """The packed entries of these blocks of the remote request, in order, up to the first the prefill
        instance does not hold under that hash; raises TransferError."""
        peer = (params.remote_host, params.remote_port, params.remote_engine_id)
        sock = self._sockets.get(peer)
        if sock is None:
            sock = self._connect(peer)
            self._call(peer, sock, Hello(params.remote_engine_id, self.layout.key(), self.layout.identity))
            self._sockets[peer] = sock
        reply = self._call(peer, sock, Fetch(params.remote_request_id, indices, block_hashes, release))
        return reply.entries

    def _connect(self, peer: tuple[str, int, str]) -> zmq.Socket:
        sock = self._ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://{peer[0]}:{peer[1]}")
        return sock

    def _call(self, peer: tuple[str, int, str], sock: zmq.Socket, msg) -> Reply:
        where = f"{peer[0]}:{peer[1]}"
        try:
            sock.send(self._encoder.encode(msg))
            if not sock.poll(int(self.timeout * 1000)):
                raise TransferError("timeout", f"{where} did not answer within {self.timeout:g} s")
            frames = sock.recv_multipart(copy=False)
            reply = self._decoder.decode(frames[0].buffer)
            reply.entries = [frame.buffer for frame in frames[1:]]  # read-only views of the frames, no copy
        except TransferError:
            self._drop(peer, sock)
            raise
        except (zmq.ZMQError, msgspec.DecodeError) as e:
            self._drop(peer, sock)
            raise TransferError("connection", f"{where}: {e}") from None
        if reply.error is not None:
            if reply.reason != "unknown":  # a refused peer: a new connection, a new Hello, next time
                self._drop(peer, sock)
            raise TransferError(reply.reason or "refused", f"{where}: {reply.error}")
        return reply

    def _drop(self, peer, sock: zmq.Socket) -> None:
        self._sockets.pop(peer, None)
        sock.close(linger=0)

    def close(self) -> None:
        for sock in self._sockets.values():
            sock.close(linger=0)
        self._sockets.clear()


def new_engine_id() -> str:
    return f"tokenmill-{uuid.uuid4().hex[:12]}"
