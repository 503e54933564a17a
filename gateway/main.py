"""`tandem gateway`: flags (light: `tandem --help` imports no web stack) and the server."""

from __future__ import annotations

import argparse
import gc
import logging
import os
import signal

# Light (a plain dataclass), unlike the app: its defaults are the flags' defaults.
from tandem.gateway.settings import GatewaySettings
from tandem.listen import every_interface
from tandem.preflight import StartError, check_port


def add_arguments(parser: argparse.ArgumentParser) -> None:
    default = GatewaySettings()
    parser.add_argument("--host", default=default.host, help="address to bind")
    parser.add_argument("--port", type=int, default=default.port, help="HTTP port")
    parser.add_argument(
        "--redis-url",
        default=os.environ.get("TANDEM_REDIS_URL", default.redis_url),
        # Not the value: the variable's may hold a password.
        help=f"default: $TANDEM_REDIS_URL, else {default.redis_url}",
    )
    parser.add_argument(
        "--key-prefix", default=default.key_prefix, help="prefix of every Redis key"
    )
    parser.add_argument(
        "--api-keys-file",
        default=default.api_keys_file,
        help="YAML or JSON list of {key | key_sha256, name, models, rpm, tpm}; "
        "$TANDEM_API_KEYS adds comma-separated plain keys (all models)",
    )
    parser.add_argument(
        "--no-auth",
        action="store_true",
        help="accept every request without a key (only on a trusted network)",
    )
    parser.add_argument(
        "--max-queue",
        type=int,
        default=default.max_queue,
        help="answer 429 while a model has this many requests waiting in its queue",
    )
    parser.add_argument(
        "--request-timeout",
        type=float,
        default=default.request_timeout,
        help="seconds a request may take, queueing included (X-Tandem-Timeout lowers it)",
    )
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        default=default.max_body_bytes,
        help="larger request bodies get 413",
    )
    parser.add_argument(
        "--allowed-origin",
        dest="allowed_origins",
        action="append",
        metavar="ORIGIN",
        help="an origin (https://chat.example.com, or *) whose web pages may call the API "
        "from a browser (CORS); repeat for more (default: none)",
    )
    parser.add_argument(
        "--default-max-tokens",
        type=int,
        default=default.default_max_tokens,
        help="max_tokens of chat requests that give none",
    )
    parser.add_argument(
        "--shutdown-timeout",
        type=float,
        default=default.shutdown_timeout,
        help="on SIGTERM, seconds in-flight requests get before their connections are cut "
        "(their queued work is kept: retries with the same Idempotency-Key find it)",
    )
    parser.add_argument("--access-log", action="store_true", help="log every request")


def main(args: argparse.Namespace) -> int:
    import uvicorn

    from tandem.gateway.app import create_app
    from tandem.gateway.server import graceful_seconds, quiet_server_logs, server_config

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args.host = every_interface(args.host)  # "::" in a pod of an IPv6 cluster
    settings = GatewaySettings.from_args(args)
    try:  # uvicorn's own refusal is a log line and exit 3, once the app was built
        check_port(settings.host, settings.port)
    except StartError as exc:  # the command's error line
        raise ValueError(str(exc)) from None
    app = create_app(settings)
    # Everything imported and built so far lives as long as the process: out of
    # the collector's sight, a full collection under load takes milliseconds
    # instead of a ~200 ms pause (measured at 200 requests/s).
    gc.freeze()
    log = logging.getLogger("tandem.gateway")
    if settings.no_auth:
        log.warning("--no-auth: every caller is accepted without a key")
    else:
        log.info("%d API keys loaded", len(app.state.gateway.key_store))
    # uvicorn handles SIGTERM (a graceful shutdown), then raises it again for the
    # handler found at start: one that exits 0 makes a drained gateway exit 0, as the
    # engines do, instead of dying by the signal. A SIGTERM before uvicorn took over
    # (nothing admitted yet) ends the process at once: a no-op handler here swallowed
    # it, and the gateway served on until the supervisor's kill (tandem up waited 60 s).
    signal.signal(signal.SIGTERM, _exit_cleanly)
    shutdown_s = graceful_seconds(settings.shutdown_timeout)
    quiet_server_logs(shutdown_s)
    config = server_config(
        app,
        settings,
        timeout_graceful_shutdown=shutdown_s,
        access_log=settings.access_log,
        log_level="info",
    )
    server = uvicorn.Server(config)
    server.run()
    return 0 if server.started else 3  # 3: uvicorn.run's exit for a failed start


def _exit_cleanly(signum: int, _frame: object) -> None:
    raise SystemExit(0)
