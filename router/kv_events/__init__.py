"""Engine KV-cache events in vLLM's format, decoded and applied to a bounded view of each replica's cache.

The wire format is vLLM's (``vllm/distributed/kv_events.py``, ``--kv-events-config``): a ZeroMQ PUB
socket sends three frames per batch, ``(topic, sequence, payload)``; ``sequence`` is an 8-byte
big-endian counter that starts at 0 when the publisher starts; ``payload`` is msgspec's msgpack of
``KVEventBatch``, an array ``[ts, events, data_parallel_rank]`` (the rank may be left off). Each
event is a tagged struct. vLLM encodes it as a map with its class name under ``"type"``::

    {"type": "BlockStored", "block_hashes": [...], "parent_block_hash": h | nil,
     "token_ids": [...], "block_size": n, "lora_id": ..., "medium": "GPU", "lora_name": ..., ...}
    {"type": "BlockRemoved", "block_hashes": [...], "medium": "GPU"}
    {"type": "AllBlocksCleared"}

Older vLLM releases declared the events ``array_like``: ``["BlockStored", block_hashes,
parent_block_hash, token_ids, block_size, lora_id, medium, lora_name?]``; both forms are read.
Block hashes are bytes (sha256 by default) or 64-bit ints (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``).

The router never reproduces the engine's hash function: a ``BlockStored`` carries each block's token
ids and its parent's hash, so the view re-hashes the tokens with the router's own chained hash
(``token_block_hashes``), keyed by the parent's router hash, and maps each engine hash to it for the
``BlockRemoved`` that names only engine hashes. Whatever algorithm and seed the engine uses
(``prefix_caching_hash_algo``, ``PYTHONHASHSEED``), a request's tokens hashed by the router find the
blocks the engine holds for them. What must match is the tokenization and the block size.

Nothing here does I/O (``kv_subscriber.py`` reads the sockets, ``engine_caches.py`` keeps a view per
replica). The modules:

- ``events``: the events as the router holds them (``BlockStored``, ``BlockRemoved``,
  ``AllBlocksCleared``, ``EventBatch``) and ``KVEventError``;
- ``decoding``: ``decode_frames`` and ``decode_batch`` turn a publisher's bytes into events, field by
  field within ``DecodeLimits``, or raise ``KVEventError`` with a reason;
- ``sequence``: ``SequenceCheck`` says what a batch's sequence number means (lost batches, a restart);
- ``cache_view``: ``CacheView`` applies events to a bounded view of one replica's cache, and
  ``token_block_hashes`` hashes a request's tokens the same way.

The names a caller needs are importable from here.
"""

from kvfleet.router.kv_events.cache_view import ROOT_HASH, ApplyResult, CacheView, token_block_hashes
from kvfleet.router.kv_events.decoding import MAX_HASH_BYTES, DecodeLimits, decode_batch, decode_frames
from kvfleet.router.kv_events.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEvent,
    KVEventError,
)
from kvfleet.router.kv_events.sequence import SequenceCheck

__all__ = [
    "MAX_HASH_BYTES",
    "ROOT_HASH",
    "AllBlocksCleared",
    "ApplyResult",
    "BlockRemoved",
    "BlockStored",
    "CacheView",
    "DecodeLimits",
    "EventBatch",
    "KVEvent",
    "KVEventError",
    "SequenceCheck",
    "decode_batch",
    "decode_frames",
    "token_block_hashes",
]
