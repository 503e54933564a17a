"""One engine process serving from Redis: load the model, wire the service together,
run until drained. Reached once `main` has checked the flags and Redis (torch loads here)."""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import signal
import socket

import redis
import torch
from redis.backoff import NoBackoff
from redis.retry import Retry

from tandem.engine.config import EngineConfig, max_model_len_for
from tandem.engine.llm import build_engine
from tandem.engine.model.loader import kv_blocks_for, kv_pool_check, load_model
from tandem.engine.service import probes
from tandem.engine.service.arguments import engine_fields, worker_fields
from tandem.engine.service.cancellation import CancelListener
from tandem.engine.service.handoff_flow import HandoffFlow
from tandem.engine.service.http import HealthServer
from tandem.engine.service.kv_tcp import KVServer
from tandem.engine.service.kv_transfer import KVLayout
from tandem.engine.service.logs import log_to_stderr
from tandem.engine.service.metrics import EngineMetrics
from tandem.engine.service.redis_io import RedisIO
from tandem.engine.service.settings import WorkerSettings, waiting_tokens
from tandem.engine.service.worker import EngineWorker
from tandem.engine.step_vote import Vote
from tandem.keys import Keys
from tandem.protocol import Role

log = logging.getLogger("tandem.engine")

# Seconds a PING may take before /readyz, or a retry while Redis is away, gives up.
PROBE_TIMEOUT_S = 0.5


def serve(args: argparse.Namespace, rank: int, vote: Vote | None = None) -> int:
    """Load the model, wire the service together, run until drained."""
    # A data-parallel rank is a fresh interpreter; its lines say which it is.
    log_to_stderr(rank if args.data_parallel_size > 1 else None)
    role = Role(args.role)
    if args.threads is not None:
        # More threads than cores owned is far worse than too few: torch's OpenMP
        # workers spin at every barrier while the core they wait for runs someone else.
        torch.set_num_threads(args.threads)
    fields = engine_fields(args)
    block_size = fields["block_size"]  # the flag's default is EngineConfig's
    names = "--kv-cache-memory or --num-kv-blocks"
    pool = kv_pool_check(block_size, args.num_kv_blocks, args.kv_cache_memory, names)
    loaded = load_model(args.model, dtype=args.dtype, device=args.device, before_weights=pool)
    num_blocks = args.num_kv_blocks or kv_blocks_for(
        loaded.config,
        block_size=block_size,
        dtype=loaded.dtype,
        device=loaded.device,
        kv_cache_bytes=args.kv_cache_memory,
    )
    fields["max_model_len"] = max_model_len_for(
        fields, loaded.config.max_position_embeddings, num_blocks * block_size
    )
    config = EngineConfig(vocab_size=loaded.config.vocab_size, **fields)
    graphs = False if args.enforce_eager else None
    engine = build_engine(
        loaded, config, num_blocks, seed=args.seed, vote=vote, decode_graphs=graphs
    )

    host = args.advertise_host or _default_advertise_host(args.host)
    group = group_ids(args.engine_id, config.data_parallel_size)
    engine_id = group[rank] if group else args.engine_id
    kv_caches = engine.runner.kv_caches
    layout = KVLayout.of(kv_caches)
    fingerprint = kv_fingerprint(loaded.source.fingerprint, layout)
    kv_server = None
    kv_address = None
    settings_kwargs = dict(
        role=role,
        model_name=args.model if args.served_model_name is None else args.served_model_name,
        engine_id=engine_id,
        fingerprint=fingerprint,
        keep_alive_every=min(5.0, args.claim_idle_ms / 4000),
        max_waiting_tokens=waiting_tokens(config.max_num_batched_tokens),
        group=group,
        **worker_fields(args),
    )
    metrics = EngineMetrics(settings_kwargs["model_name"], role.value)
    keys = Keys(prefix=args.key_prefix)
    client = redis.Redis.from_url(args.redis_url)
    # PINGs that must answer fast (/readyz; the loop's retries while Redis is away):
    # a paused Redis holds a command for the whole socket timeout, retries included.
    probe = redis.Redis.from_url(
        args.redis_url,
        socket_timeout=PROBE_TIMEOUT_S,
        socket_connect_timeout=PROBE_TIMEOUT_S,
        retry=Retry(NoBackoff(), 0),
    )
    worker: EngineWorker | None = None

    http = HealthServer(
        args.host,
        args.port + rank,
        live=lambda: probes.live(worker),
        # io.ping looked up when asked: `io` is made below, after the port opens (read
        # at once, a probe in between answered 500, "cannot access free variable").
        ready=lambda: probes.ready(worker, lambda: io.ping()),
        metrics=metrics.render,
    )
    http.start()
    settings_kwargs["http_address"] = f"{host}:{http.port}"
    handoffs: HandoffFlow | None = None
    if role is Role.PROMPT:
        # The callbacks reach `handoffs`, set just below, before any offer exists.
        kv_server = KVServer(
            kv_caches,
            layout,
            lookup=lambda h: handoffs.offers.lookup(h),
            on_fetched=lambda h: handoffs.on_fetched(h),
            on_sent=metrics.kv_served_bytes.inc,
            on_failure=metrics.kv_serve_failed,
            # A fetch still waiting for a turn after this long was given up on (if its
            # completion engine has the prompt engine's timeout, as a deployment's do).
            stale_after=args.kv_fetch_timeout,
            host=args.host,
            advertise_host=host,
            port=args.kv_port + rank if args.kv_port else 0,
        )
        kv_address = kv_server.start()
    settings = WorkerSettings(kv_address=kv_address, **settings_kwargs)
    if role is not Role.NORMAL:
        handoffs = HandoffFlow(settings, kv_caches, layout, config.block_size)
    io = RedisIO(client, keys, settings, CancelListener(args.redis_url, keys), probe=probe)
    if vote is not None:
        # Every rank's model loaded before any registers: a rank up first would take
        # work and hold it in its first step's vote for as long as a peer still loads
        # (past the stall limit, its liveness probe fails and the pod restarts).
        vote(0)
    worker = EngineWorker(engine, settings, io, metrics, handoffs, vote=vote)

    def on_signal(signum: int, _frame: object) -> None:
        # Only a flag: logging or the drain's heartbeat would take locks (a metric's, the
        # log handler's) that the interrupted loop may hold, and hang the engine.
        worker.request_drain()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    log.info(
        "engine %s ready: role %s, model %s, http %s%s",
        engine_id,
        role.value,
        settings.model_name,
        settings.http_address,
        f", kv {kv_address}" if kv_address is not None else "",
    )
    try:
        return worker.run()
    except ValueError as exc:
        # A bug or bad data while serving, not a bad flag: `tandem` reads a ValueError
        # as bad input (one line, exit 2), and the traceback was lost.
        raise RuntimeError(f"the engine failed while serving: {exc}") from exc
    finally:
        if kv_server is not None:
            kv_server.stop()
        if handoffs is not None:
            handoffs.close()
        http.stop()
        io.close()
        log.info("engine %s stopped", engine_id)


def kv_fingerprint(weights: str, layout: KVLayout) -> str:
    """What a decoder checks a prompt engine's KV against: the same weights, in the same
    layout and dtype (another model under the same served name is recomputed)."""
    text = f"{weights}|{layout.num_layers}|{layout.num_kv_heads}|{layout.head_dim}|{layout.dtype}"
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _default_advertise_host(bind: str) -> str:
    if bind not in ("0.0.0.0", "::", ""):
        return bind
    return os.environ.get("POD_IP") or socket.gethostbyname(socket.gethostname())


def group_ids(engine_id: str, size: int) -> tuple[str, ...]:
    """The engine ids of a data-parallel group's ranks 0 to size - 1 (rank 0 keeps the
    group's id, rank r is <id>-r<r>); empty for one engine alone."""
    if size < 2:
        return ()
    return (engine_id, *(f"{engine_id}-r{rank}" for rank in range(1, size)))
