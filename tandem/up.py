"""`tandem up`: the whole product on one machine, no cluster, no root.

An embedded Redis (or --redis-url), engines for one model (Normal: one
engine; Disaggregated: a PROMPT and a COMPLETION engine), and the gateway,
each a child process with its log in the run folder. An engine that dies is
restarted (with backoff), and so is the embedded Redis, from its append-only
file; Ctrl-C or SIGTERM answers every request already admitted, then stops
everything.
"""

from __future__ import annotations

import secrets
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import IO

import redis

from tandem import catalog
from tandem.backlog import answers_owed
from tandem.child import Child, drain_in_order, engine_child, engine_threads
from tandem.embedded_redis import restart_if_dead, start_embedded
from tandem.keys import Keys
from tandem.listen import local_host
from tandem.preflight import (
    StartError,
    check_max_model_len,
    check_model,
    check_port,
    check_redis,
)
from tandem.redaction import redacted
from tandem.redis_server import RedisServer, free_port
from tandem.run_folder import claim_run_folder
from tandem.up_config import UpConfig
from tandem.up_ready import ReadyWait

# How long stopping may take: the admitted requests answered, every process drained
# (engines draining for up to their default 30 s), and more where a manifest's
# drainTimeoutSeconds is longer (Stack.stop_timeout).
STOP_TIMEOUT_S = 60.0
DEFAULT_DRAIN_S = 30.0
# How long the queue must stay empty at stop: a request the gateway admitted just
# before may not be queued yet (on a loaded machine its engines were stopped first).
QUEUE_SETTLE_S = 1.0
# After a second stop request, what the engines get to finish what they run.
HURRY_S = 5.0
# What the gateway gets to end its open streams with an error event a client reads
# (then it is killed): before the stop's deadline, and after a hurried stop's.
GATEWAY_CUT_S = 3.0
# How often `tandem up` renews its model's catalog declaration (tandem/catalog.py).
DECLARE_EVERY_S = 15.0


class Stack:
    """Starts, watches and stops the processes of one `tandem up`."""

    def __init__(self, config: UpConfig) -> None:
        self.config = config
        self.api_key = config.api_key or f"tk-{secrets.token_urlsafe(18)}"
        # (name, validated spec) of the manifest: a bad one fails here, before any process.
        self.deployment = None
        if config.manifest is not None:
            # Imported only with a manifest: this module is light (cli.py imports it for
            # `tandem --help`) and the operator's modules are not.
            from tandem.operator.local_actuator import load_manifest

            self.deployment = load_manifest(config.manifest)
        # As a pod's grace period follows drainTimeoutSeconds: engines given longer to
        # finish their requests were killed after a minute all the same.
        roles = self.deployment[1].roles().values() if self.deployment is not None else ()
        longest = max((r.drain_timeout_seconds for r in roles), default=DEFAULT_DRAIN_S)
        self.stop_timeout = STOP_TIMEOUT_S + max(0.0, longest - DEFAULT_DRAIN_S)
        # Without a log_dir: a temporary one, which stop() removes unless start() failed.
        self._tmp = None if config.log_dir else Path(tempfile.mkdtemp(prefix="tandem-up-"))
        self.log_dir = config.log_dir or self._tmp
        self._lock: IO[bytes] | None = claim_run_folder(self.log_dir)
        self.redis: RedisServer | None = None
        self.redis_url = config.redis_url or ""
        self.children: list[Child] = []
        self.gateway: Child | None = None
        self.actuator = None  # a LocalActuator with `-f model.yaml`
        self._stop = threading.Event()
        # Why the stack stopped on its own (what it could not recover from), if it did.
        self.failure: str | None = None
        # In the engines' ids, fixed for the stack's life (a restart keeps its id): ids
        # are unique among a Redis' live engines, and two stacks on one --redis-url
        # shared theirs (one's drain deleted the other's registry entry).
        self._run_id = secrets.token_hex(3)
        # When a second stop request (Ctrl-C again) came: the stop waits no more for the
        # queue, and cuts what still runs HURRY_S after it.
        self._hurried_at: float | None = None

    @property
    def url(self) -> str:
        """The gateway's URL from this machine (the loopback address for a --host that
        is every interface)."""
        host = local_host(self.config.host)
        return f"http://{f'[{host}]' if ':' in host else host}:{self.config.port}"

    @property
    def mode(self) -> str:
        """What runs: "normal" or "disaggregated" (with a manifest, its spec.mode)."""
        if self.deployment is not None:
            return self.deployment[1].mode.value.lower()
        return self.config.mode

    # --------------------------------------------------------------- start

    def start(self, say=print) -> Stack:
        """Start every process and wait until the gateway serves the model.

        StartError when it cannot: what had started is stopped, the logs are kept.
        """
        launching = False
        try:
            check_port(self.config.host, self.config.port)
            model = self.config.model
            if self.deployment is not None:
                model = self.deployment[1].model.path or model
            check_model(model)
            if self.deployment is not None:
                length = self.deployment[1].engine.max_model_len
                check_max_model_len(model, length, "spec.engine.maxModelLen")
            if self.config.redis_url:
                check_redis(self.config.redis_url)
            launching = True
            try:
                self._launch(say)
            except OSError as exc:  # a file of the run folder's in the way
                where = exc.filename or self.log_dir
                raise StartError(
                    f"cannot write {where} (--log-dir {self.log_dir}): {exc.strerror or exc}"
                ) from None
        except BaseException as exc:
            if launching and isinstance(exc, StartError):
                self._tmp = None  # the error names a log: keep it
            self.stop()  # the run folder's lock too (a failed check: its folder is empty)
            raise
        return self

    def _launch(self, say) -> None:
        cfg = self.config
        if self.deployment is not None and self.deployment[1].redis is not None:
            # A cluster's address (a Service name) means nothing here: said, not used.
            say("redis      spec.redis is a cluster's: here --redis-url is, else an embedded one")
        if not self.redis_url:
            self._start_redis()
            say(f"redis      {redacted(self.redis_url)} (embedded, its password in its folder)")
        else:  # (an exported $TANDEM_REDIS_URL attached the stack to it in silence)
            say(f"redis      {redacted(self.redis_url)} (--redis-url, or $TANDEM_REDIS_URL)")
        starting = []
        if self.deployment is not None:
            starting += self._start_actuator(say)  # it says what it starts
        else:
            self._declare()  # requests sent while the engines load wait, as in a restart
            roles = ["normal"] if cfg.mode == "normal" else ["prompt", "completion"]
            threads = engine_threads(len(roles))
            for role in roles:
                self.children.append(self._engine(role, threads))
        self.gateway = self._gateway()
        self.children.append(self.gateway)
        for child in self.children:
            child.start()
        for child in self.children:
            say(f"{child.name:<10} starting (log {child.log_path})")
        self._wait_ready(say, starting + self.children)

    def _start_redis(self) -> None:
        self.redis = start_embedded(self.log_dir / "redis")
        self.redis_url = self.redis.url

    def _start_actuator(self, say) -> list[Child]:
        from tandem.operator.local_actuator import LocalActuator

        name, spec = self.deployment
        self.actuator = LocalActuator(
            name,
            spec,
            redis_url=self.redis_url,
            log_dir=self.log_dir,
            extra_engine_args=self.config.engine_args,
            say=say,
        )
        return self.actuator.start()

    def _engine(self, role: str, threads: int | None) -> Child:
        port = free_port()
        flags = [
            "--role", role,
            "--model", self.config.model,
            "--served-model-name", self.config.name,
            "--host", "127.0.0.1",
            "--port", str(port),
            "--kv-port", str(free_port()),
            "--engine-id", f"up-{role}-{self._run_id}",
            *(["--threads", str(threads)] if threads is not None else []),
            *self.config.engine_args,
        ]  # fmt: skip
        log_path = self.log_dir / f"engine-{role}.log"
        decodes = role == "completion"
        return engine_child(
            f"{role} engine", flags, port, log_path, self.redis_url, decodes=decodes
        )

    def _gateway(self) -> Child:
        cfg = self.config
        argv = [
            sys.executable, "-m", "tandem.cli", "gateway",
            "--host", cfg.host,
            "--port", str(cfg.port),
            # Its streams end after the engines answered them, at stop()'s pace; those
            # still open are cut by it (an error event each) before stop() kills it.
            "--shutdown-timeout", str(self.stop_timeout - GATEWAY_CUT_S),
            *cfg.gateway_args,
        ]  # fmt: skip
        return Child(
            "gateway",
            argv,
            self.log_dir / "gateway.log",
            f"{self.url}/readyz",
            restartable=True,
            # The Redis URL in its environment, as an engine's (engine_child).
            env={"TANDEM_API_KEYS": self.api_key, "TANDEM_REDIS_URL": self.redis_url},
            live_url=f"{self.url}/healthz",
        )

    def _wait_ready(self, say, children: list[Child]) -> None:
        wait = ReadyWait(
            timeout_s=self.config.ready_timeout,
            deadline=time.monotonic() + self.config.ready_timeout,
            stopping=self._stop,
            log_dir=self.log_dir,
        )
        wait.children(children, say)
        wait.model(self.url, self.api_key, self.config.name, self.gateway)

    # ----------------------------------------------------------- supervise

    def supervise(self, say=print) -> None:
        """Until stop(): restart children that die (with backoff); run the autoscaler."""
        next_evaluation = time.monotonic() + self.config.scale_every
        next_declaration = time.monotonic()
        failing = False  # the autoscaler's last evaluation raised
        while not self._stop.wait(0.5):
            if self.redis is not None and (failure := restart_if_dead(self.redis, say)):
                self.failure = failure
                self._stop.set()
                continue
            self._restart_dead(say, gateway=True)
            if self.actuator is None:
                if time.monotonic() >= next_declaration:
                    next_declaration = time.monotonic() + DECLARE_EVERY_S
                    self._declare()
                continue
            if time.monotonic() >= next_evaluation:
                next_evaluation = time.monotonic() + self.config.scale_every
                try:
                    self.actuator.evaluate()  # it says what it scales and holds
                    failing = False
                except Exception as exc:
                    say(f"autoscaler evaluation failed: {exc!r}")
                    if not failing:  # a bug's traceback, once a streak: not every tick
                        traceback.print_exc(file=sys.stderr)
                    failing = True

    def _declare(self) -> None:
        """This stack restarts the model's engines: declared in the catalog, the gateway
        queues its requests while one restarts (a lone prompt engine is no reason to
        refuse them)."""
        client = redis.Redis.from_url(self.redis_url, socket_timeout=2)
        try:
            ttl_s = catalog.declaration_ttl_s(DECLARE_EVERY_S)
            catalog.declare(client, Keys(), self.config.name, "local/tandem-up", ttl_s)
        except redis.RedisError:
            pass  # Redis restarting: the next round declares it
        finally:
            client.close()

    def request_stop(self) -> None:
        if self._stop.is_set() and self._hurried_at is None:
            self._hurried_at = time.monotonic()
        self._stop.set()

    def stop(self, timeout: float | None = None, say=print) -> None:
        """Answer what was admitted, then stop everything; Redis last.

        The gateway first takes no new requests (those in flight go on); the
        engines then serve the model's queue until it is empty, since no one
        else will; then they drain, decode engines last (they fetch the prompt
        engines' last KV); then the gateway's streams end. What is still
        running after `timeout` seconds (default: stop_timeout) is killed.
        """
        self._stop.set()
        at_the_latest = time.monotonic() + (self.stop_timeout if timeout is None else timeout)

        def deadline() -> float:
            # Asked as it waits: a second stop request (Ctrl-C again) during the drain
            # cuts what still runs after HURRY_S too, not only one during the queue's wait.
            if self._hurried_at is None:
                return at_the_latest
            return min(at_the_latest, self._hurried_at + HURRY_S)

        gateway = self.gateway
        if gateway is not None:
            gateway.signal(signal.SIGTERM)
            if self.redis_url:
                self._wait_for_empty_queue(at_the_latest, say)
        drain_in_order(self._engines(), deadline)  # the actuator's too
        if self.actuator is not None:
            self.actuator.close()
        if gateway is not None:
            if self._hurried_at is not None:
                # A second interrupt makes uvicorn stop at once: each stream still open
                # ends with the shutting_down event, where a kill cut it bare ("Connection
                # error." in the SDKs).
                gateway.signal(signal.SIGINT)
                cut_at = time.monotonic() + GATEWAY_CUT_S
                gateway.wait_or_kill(lambda: max(deadline(), cut_at))
            else:
                gateway.wait_or_kill(deadline)
        if self.redis is not None:
            self.redis.stop()
            self.redis = None
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None
        if self._lock is not None:
            self._lock.close()  # the folder is free for another stack
            self._lock = None

    def _restart_dead(self, say, *, gateway: bool) -> None:
        """Restart the children (the actuator's engines too) that died or hung, when their
        backoff allows; the gateway only if `gateway` (not while it is stopping)."""
        for child in self.children:
            if gateway or child is not self.gateway:
                self._supervise(child, say)
        if self.actuator is not None:
            self.actuator.supervise()

    @staticmethod
    def _supervise(child: Child, say) -> None:
        """One child's restart, if due (one that fails is tried again after its backoff)."""
        for line in child.supervise(time.monotonic()):
            say(line)

    def _engines(self) -> list[Child]:
        engines = [c for c in self.children if c is not self.gateway]
        if self.actuator is not None:
            engines += self.actuator.children()
        return engines

    def _wait_for_empty_queue(self, deadline: float, say) -> None:
        """Until every admitted request of the model was answered (or the deadline, or
        a second stop request). Engines that die meanwhile are restarted, and a role
        autoscaled to zero with work admitted is started for it, as the autoscaler
        would have: stopped without them, the work waited for the deadline and its
        client was cut off."""
        client = redis.Redis.from_url(self.redis_url, socket_timeout=2)
        empty_since, next_evaluation = None, 0.0
        try:
            while time.monotonic() < deadline and self._hurried_at is None:
                if answers_owed(client, Keys(), self.config.name, time.time()):
                    empty_since = None
                    self._restart_dead(say, gateway=False)
                    if self.actuator is None:
                        if not any(c.alive or c.restartable for c in self._engines()):
                            return  # no engine to answer it
                    elif time.monotonic() >= next_evaluation:
                        # Whatever else runs: a prefill role at zero leaves its
                        # requests waiting however many decoders are up.
                        next_evaluation = time.monotonic() + self.config.scale_every
                        self.actuator.evaluate(stopping=True)
                elif empty_since is None:
                    empty_since = time.monotonic()
                elif time.monotonic() - empty_since >= QUEUE_SETTLE_S:
                    return
                time.sleep(0.2)
            if answers_owed(client, Keys(), self.config.name, time.time()):
                # Cut without a word: their clients saw a connection close.
                why = "Ctrl-C again" if self._hurried_at is not None else "out of time"
                say(f"stopping sooner ({why}): requests still owed an answer are cut")
        except redis.RedisError:
            return  # nothing to wait for: no engine can serve without it
        finally:
            client.close()

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
