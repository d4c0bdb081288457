"""The prefix cache's KV events over ZMQ, in vLLM's wire format, for routers that subscribe to
vLLM workers that way (llm-d's KV-cache manager): a PUB socket sending, per batch, the frames
[topic, sequence number (8 bytes, big-endian), msgpack payload], the payload vLLM's
KVEventBatch as msgspec writes it (arrays, each event tagged with its class name first):
[timestamp, [["BlockStored", [hash], parent hash, token ids, block size, lora id, medium], ...]].
"""

from __future__ import annotations

import msgpack
import zmq

from kiln.runtime.kvcache.events import MEDIUM, BlockStored, BlocksRemoved, EventBatch


def encode(batch: EventBatch) -> bytes:
    events = []
    for event in batch.events:
        if isinstance(event, BlockStored):
            events.append(["BlockStored", [event.block_hash], event.parent_hash, list(event.token_ids),
                           event.block_size, None, MEDIUM])
        elif isinstance(event, BlocksRemoved):
            events.append(["BlockRemoved", list(event.block_hashes), MEDIUM])
        else:
            events.append(["AllBlocksCleared"])
    return msgpack.packb([batch.timestamp, events])


class ZmqKvEventPublisher:
    """Binds (or connects, for an endpoint without a `*`) and sends each batch as it is made."""

    def __init__(self, endpoint: str, topic: str = ""):
        self.context = zmq.Context.instance()
        self.socket = self.context.socket(zmq.PUB)
        self.socket.setsockopt(zmq.SNDHWM, 100_000)  # beyond it ZMQ drops: a slow subscriber never blocks serving
        self.socket.setsockopt(zmq.LINGER, 0)
        if "*" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
            self.socket.bind(endpoint)
        else:
            self.socket.connect(endpoint)
        self.topic = topic.encode()

    def __call__(self, batch: EventBatch) -> None:
        self.socket.send_multipart([self.topic, batch.sequence_number.to_bytes(8, "big"), encode(batch)],
                                   flags=zmq.NOBLOCK)

    def close(self) -> None:
        self.socket.close(0)
