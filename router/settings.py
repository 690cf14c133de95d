"""The router's one typed settings object. Units are in the field names; every number is bounded."""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict, Field, model_validator

_NAMESPACE = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")  # a DNS-1123 label


class RouterSettings(BaseModel):
    """Settings of one router process (per-deployment routing comes from each deployment's RoutingSpec)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    host: str = Field(default="127.0.0.1", description="Address to listen on (0.0.0.0 inside a pod).")
    port: int = Field(default=8080, ge=0, le=65_535, description="Port to listen on (0 picks a free one).")
    max_body_bytes: int = Field(
        default=4 * 1024 * 1024,
        ge=1024,
        le=256 * 1024 * 1024,
        description="Largest request body accepted; larger ones get 413 before being read whole.",
    )
    max_request_head_bytes: int = Field(
        default=32 * 1024,
        ge=1024,
        le=1024 * 1024,
        description=(
            "Largest request head (request line and header fields); larger ones get 431 and a close. "
            "32 KiB is nginx's 4 x 8k large_client_header_buffers."
        ),
    )
    max_request_headers: int = Field(
        default=100,
        ge=8,
        le=10_000,
        description="Most header fields in one request; more get 431 (Apache's LimitRequestFields).",
    )
    request_head_timeout_s: float = Field(
        default=60.0,
        gt=0,
        le=3600,
        description=(
            "From a request head's first byte to its end; a slower head gets 408 and a close (slowloris). "
            "nginx's client_header_timeout."
        ),
    )
    max_client_connections: int = Field(
        default=8192,
        ge=1,
        le=1_000_000,
        description=(
            "Client connections held at once; more are answered 503 and closed. Each holds at most "
            "max_request_head_bytes plus one 256 KiB read of an unfinished head."
        ),
    )
    max_client_connections_per_address: int = Field(
        default=1024,
        ge=1,
        le=1_000_000,
        description=(
            "Client connections from one IP address; more get 503. Behind an L7 load balancer every client "
            "shares its address: raise this to max_client_connections there."
        ),
    )
    connect_timeout_s: float = Field(
        default=3.0, gt=0, le=60, description="TCP connect to a replica; a slow connect is retried elsewhere."
    )
    idle_read_timeout_s: float = Field(
        default=600.0,
        gt=0,
        le=3600,
        description="Longest silence from a replica (headers or body; prefill of a long prompt counts).",
    )
    pool_connections_per_replica: int = Field(
        default=256, ge=1, le=10_000, description="Connections (in use and keep-alive) held open per replica."
    )
    pool_wait_timeout_s: float = Field(
        default=5.0,
        gt=0,
        le=600,
        description=(
            "Longest wait for a connection to the picked replica when all pool_connections_per_replica are in "
            "use; then 503 upstream_busy with Retry-After. A few seconds: the replica is saturated by this "
            "router alone, and a client told to retry does better than one held for the read timeout."
        ),
    )
    keepalive_timeout_s: float = Field(
        default=30.0, gt=0, le=600, description="Idle keep-alive connections are closed after this."
    )
    client_keepalive_timeout_s: float = Field(
        default=75.0, gt=0, le=3600, description="Idle client connections are closed after this."
    )
    max_attempts: int = Field(
        default=3,
        ge=1,
        le=10,
        description="Tries per request across replicas when a replica fails before the first response byte.",
    )
    stream_migration_attempts: int = Field(
        default=3,
        ge=0,
        le=10,
        description=(
            "Replicas tried to continue a streamed completion that its replica broke after the first byte "
            "(0: no migration; the client gets an SSE error event and [DONE])."
        ),
    )
    stream_migration_timeout_s: float = Field(
        default=30.0,
        gt=0,
        le=600,
        description="Longest time from a stream breaking to its continuation's first byte, all attempts together.",
    )
    eject_after_failures: int = Field(
        default=3, ge=1, le=100, description="Consecutive failures that eject a replica (passive outlier detection)."
    )
    eject_base_s: float = Field(default=1.0, gt=0, le=600, description="First ejection length; doubles per repeat.")
    eject_max_s: float = Field(default=30.0, gt=0, le=3600, description="Longest ejection.")
    prefix_index_blocks_per_replica: int = Field(
        default=16_384,
        ge=1,
        le=10_000_000,
        description=(
            "Block hashes remembered per replica, an estimate of its KV capacity: 16384 blocks of 128 chars "
            "is about 500k tokens, an H100's KV cache for an 8B model."
        ),
    )
    max_prompt_blocks: int = Field(
        default=2048, ge=1, le=100_000, description="Prompt blocks hashed per request (bounds CPU per request)."
    )
    load_penalty_blocks: float = Field(
        default=4.0,
        ge=0,
        le=1000,
        description=(
            "Prefix strategy: blocks of prefill one extra in-flight request is worth. A replica holding m more "
            "of the prompt's blocks wins while it has fewer than m / this more requests in flight "
            "(4 was chosen in bench/routing_sim.py, docs/benchmarks/router.md section 1)."
        ),
    )
    placement: bool = Field(
        default=True,
        description=(
            "Prefix strategy: also credit each prompt's rendezvous home (the replica every router ranks first "
            "for where the prompt diverges from others), so that several routers place a conversation or "
            "document alike without talking. Off: each router's own index and load alone."
        ),
    )
    placement_branch_entries: int = Field(
        default=65_536,
        ge=16,
        le=10_000_000,
        description="Blocks remembered per model to find where prompts diverge (an LRU; ~100 bytes each).",
    )
    placement_max_depth_blocks: int = Field(
        default=512,
        ge=1,
        le=100_000,
        description=(
            "Deepest block at which a prompt's divergence is looked for: a shared prefix longer than this "
            "(512 blocks of 128 chars: ~16k tokens) gets no home. Bounds the CPU per request."
        ),
    )
    load_bound_slack_requests: int = Field(
        default=2,
        ge=0,
        le=1000,
        description=(
            "Prefix strategy: in-flight requests a replica may have over the load bound's cap. Several routers "
            "each see a few requests per replica, where one more is already over 1.25x; the slack keeps that "
            "noise from moving prompts off their home (docs/benchmarks/router.md, section 4)."
        ),
    )
    peer_load_max_age_s: float = Field(
        default=1.0,
        gt=0,
        le=60,
        description=(
            "Another router's reported load counts while it was heard within this many seconds; older, it counts "
            "for nothing (each router then picks on its own counts alone, as with no peers). docs/router.md."
        ),
    )
    peer_load_port: int | None = Field(
        default=None,
        ge=0,
        le=65_535,
        description=(
            "UDP port on which this router exchanges its per-replica load counts with the routers in "
            "peer_load_peers (peer_link.py; 0 picks a free one). None: off, each router picks on its own counts."
        ),
    )
    peer_load_peers: tuple[str, ...] = Field(
        default=(),
        max_length=64,
        description="The other routers' host:port for load reports (this router's own address is ignored).",
    )
    peer_load_key_file: str | None = Field(
        default=None,
        max_length=4096,
        description="File holding the HMAC key (>= 32 bytes) every router signs its load reports with; required.",
    )
    peer_load_send_interval_s: float = Field(
        default=0.001,
        ge=0.0002,
        le=1.0,
        description=(
            "How often the counts that changed are sent. Reports must arrive within ~1 ms to route as one "
            "router (docs/router.md, The fleet's load: at 5 ms the no-cache workload's TTFT p99 is 1.25x)."
        ),
    )
    peer_load_full_interval_s: float = Field(
        default=0.25,
        ge=0.01,
        le=30.0,
        description="How often every count is sent (a lost report is corrected; must be under peer_load_max_age_s).",
    )
    kv_events_port: int | None = Field(
        default=None,
        ge=1,
        le=65_535,
        description=(
            "Subscribe to every replica's KV-cache events (vLLM's --kv-events-config ZMQ PUB, and the reference "
            "engine's) at tcp://<replica host>:<this port>, and score prefixes by what the engines report holding "
            "(docs/router.md, KV events). None: off, the learned index alone."
        ),
    )
    kv_events_announced_only: bool = Field(
        default=False,
        description=(
            "With kv_events_port set: subscribe only to replicas whose discovery names their events port (in "
            "Kubernetes the EndpointSlice's kv-events port, which the operator adds only where the engine "
            "publishes), instead of trying kv_events_port on every replica. The chart sets it."
        ),
    )
    kv_events_replay: bool = Field(
        default=True,
        description=(
            "Ask each engine's replay socket (vLLM's replay_endpoint, the events port + 1) for the batches it still "
            "buffers on connecting and after a gap, so a restarted router sees what the engines hold at once."
        ),
    )
    kv_events_report_hits: bool = Field(
        default=True,
        description=(
            "Ask the engine to announce the cached blocks each request hits (vLLM's vllm_xargs kv_cache_report_mode "
            "'full'), so a router that joined late learns a long-cached prefix once any router's request hits it."
        ),
    )
    kv_events_replay_idle_s: float = Field(
        default=1.0, gt=0, le=60, description="A replay with no answer for this long ends (no replay socket there)."
    )
    kv_events_topic: str = Field(default="", max_length=256, description="The publishers' topic (vLLM's default: '').")
    kv_events_tokenizers: dict[str, str] = Field(
        default_factory=dict,
        description=(
            "Served model name -> folder with its tokenizer.json (and tokenizer_config.json for chat): prompts are "
            "tokenized as the engine does to match the engines' token blocks. A model without one is routed by the "
            "learned index even when its replicas publish events."
        ),
    )
    kv_events_fetch_tokenizers: bool = Field(
        default=True, description="Fetch an unlisted model's tokenizer from a replica's launcher (docs/router.md)."
    )
    kv_events_inline_tokenize_bytes: int = Field(
        default=4096,
        ge=0,
        le=256 * 1024 * 1024,
        description=(
            "Request bodies up to this size are tokenized on the event loop (tens of microseconds); larger ones "
            "in a worker thread (a 16k-character prompt takes milliseconds: docs/benchmarks/kv_events.md)."
        ),
    )
    kv_events_token_cache_tokens: int = Field(
        default=2_000_000,
        ge=0,
        le=100_000_000,
        description=(
            "Token ids each tokenized model keeps of the chat-prompt pieces it has seen (a system prompt, earlier "
            "turns), so a piece is tokenized once (router/token_cache.py; 4 bytes each); 0 tokenizes each prompt whole."
        ),
    )
    kv_events_max_blocks_per_replica: int = Field(
        default=262_144,
        ge=16,
        le=100_000_000,
        description=(
            "Blocks remembered per replica from its events (~150 bytes each); past it the oldest go. An engine "
            "holds at most its KV pool's blocks, so more is a flood or missed removals."
        ),
    )
    kv_events_max_batches_per_s: int = Field(
        default=2_000,
        ge=1,
        le=1_000_000,
        description="Batches applied per replica per second; more are dropped and counted (a flooding replica).",
    )
    kv_events_queue_batches: int = Field(
        default=10_000,
        ge=1,
        le=1_000_000,
        description="Batches ZeroMQ queues per replica before dropping (the SUB socket's high-water mark).",
    )
    kv_events_reconnect_s: float = Field(
        default=0.5,
        gt=0,
        le=60,
        description="First reconnection delay after a subscription drops (jittered 0.5-1.5x per subscription).",
    )
    kv_events_reconnect_max_s: float = Field(
        default=10.0,
        gt=0,
        le=600,
        description="Longest reconnection delay (ZeroMQ doubles the delay up to this while a publisher is down).",
    )
    max_held_requests: int = Field(
        default=2_000,
        ge=1,
        le=1_000_000,
        description=(
            "Most requests the router holds at once across all models while they have no ready replica; more "
            "get 429. Each deployment's routing.maxQueue bounds its own queue, this bounds their sum: a held "
            "request keeps its body in memory (at most this x max_body_bytes; prompts are usually a few KiB)."
        ),
    )
    wake_min_interval_s: float = Field(
        default=2.0, gt=0, le=600, description="Wake signal repeat interval while requests wait."
    )
    wake_timeout_s: float = Field(default=5.0, gt=0, le=60, description="Timeout of one wake signal call.")
    retry_after_s: int = Field(
        default=2, ge=1, le=3600, description="Retry-After sent with 429 (queue full) and 503 (no replica)."
    )
    cold_start_comments: bool = Field(
        default=True,
        description=(
            "A streamed request held while its model has no ready replica gets its response head at once and an "
            "SSE comment line (': cold start: ...') every cold_start_comment_interval_s, so proxies and load "
            "balancers in front (nginx's proxy_read_timeout 60 s, an AWS ALB's idle timeout 60 s) see traffic "
            "and do not answer 504 while the model wakes (docs/router.md, Held through a cold start). Off: held "
            "streams get nothing until the first token, as non-streamed requests do."
        ),
    )
    cold_start_comment_interval_s: float = Field(
        default=1.0,
        ge=0.05,
        le=60,
        description=(
            "Seconds between two cold-start comments (the first is sent at once). Well under the shortest idle "
            "timeout between client and router; each comment is ~60-100 bytes."
        ),
    )
    sse_max_pending_bytes: int = Field(
        default=1024 * 1024,
        ge=1024,
        le=64 * 1024 * 1024,
        description="An SSE event longer than this is forwarded unsplit rather than held until it completes.",
    )
    shutdown_timeout_s: float = Field(
        default=60.0, ge=0, le=3600, description="On stop, in-flight requests get this long to finish."
    )
    client_namespace_header: str | None = Field(
        default=None,
        min_length=1,
        max_length=128,
        pattern=r"^[A-Za-z0-9-]+$",
        description=(
            "Client scoping (docs/router.md, Namespaces): the request header holding the client's namespace, set "
            "by the authenticating gateway in front of the router, which must strip any value a client sends. "
            "When set, every /v1 request must carry it once (else 403) and reaches only models in that namespace "
            "or in shared_namespaces; another namespace's model answers 404 as an unknown one. None: off, every "
            "client reaches every model."
        ),
    )
    shared_namespaces: tuple[str, ...] = Field(
        default=(),
        max_length=1000,
        description=(
            "Namespaces whose models every client reaches when client_namespace_header is set (a platform "
            "team's shared models). Empty: each client reaches its own namespace's models only."
        ),
    )

    @model_validator(mode="after")
    def _client_scoping(self) -> RouterSettings:
        for namespace in self.shared_namespaces:
            if not _NAMESPACE.match(namespace):
                raise ValueError(f"shared_namespaces: {namespace!r} is not a Kubernetes namespace name")
        if self.shared_namespaces and self.client_namespace_header is None:
            raise ValueError("shared_namespaces: only used with client_namespace_header set (scoping is off)")
        return self

    @model_validator(mode="after")
    def _peer_load(self) -> RouterSettings:
        if self.peer_load_port is None:
            if self.peer_load_peers or self.peer_load_key_file:
                raise ValueError("peer_load_peers, peer_load_key_file: only used with peer_load_port set")
            return self
        if not self.peer_load_key_file:
            raise ValueError("peer_load_key_file: required with peer_load_port (reports are signed)")
        for address in self.peer_load_peers:
            host, _, port = address.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65_536:
                raise ValueError(f"peer_load_peers: {address!r} is not host:port")
        if self.peer_load_full_interval_s >= self.peer_load_max_age_s:
            raise ValueError("peer_load_full_interval_s: must be under peer_load_max_age_s, or live peers age out")
        return self

    @model_validator(mode="after")
    def _kv_events(self) -> RouterSettings:
        if self.kv_events_tokenizers and self.kv_events_port is None:
            raise ValueError("kv_events_tokenizers: tokenizers are only used with kv_events_port set")
        return self
