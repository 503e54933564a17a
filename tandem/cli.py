"""The `tandem` command."""

from __future__ import annotations

import argparse
import importlib
import sys
import time

DEMO_QUESTION = "What is the capital of France?"


def _walkthrough(_: argparse.Namespace) -> int:
    from tandem.engine import walkthrough

    walkthrough.run()
    return 0


def _chat(args: argparse.Namespace) -> int:
    """Answer one question with a local model, streaming the answer."""
    from tandem.engine import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype, device=args.device)
    loaded = time.perf_counter()
    print(f"[{args.model} loaded in {loaded - started:.1f}s]", file=sys.stderr)
    print(f"> {args.question}")
    engine = llm.engine
    prompt = llm.tokenizer.encode_chat([{"role": "user", "content": args.question}])
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    engine.add_request("chat", prompt_token_ids=prompt, sampling_params=params)
    num_tokens = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            print(out.text_delta, end="", flush=True)
            num_tokens = out.num_output_tokens
    elapsed = time.perf_counter() - loaded
    print(f"\n[{num_tokens} tokens in {elapsed:.2f}s]", file=sys.stderr)
    return 0


def _up(args: argparse.Namespace) -> int:
    import signal
    import tempfile
    from pathlib import Path

    from tandem.up import Stack, UpConfig, banner

    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="tandem-up-"))
    manifest = None
    if args.file:
        import yaml

        manifest = yaml.safe_load(Path(args.file).read_text())
    config = UpConfig(
        manifest=manifest,
        model=args.model,
        served_model_name=args.served_model_name,
        mode=args.mode,
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        redis_url=args.redis_url,
        log_dir=log_dir,
    )
    stack = Stack(config)
    signal.signal(signal.SIGTERM, lambda *_: stack.request_stop())
    signal.signal(signal.SIGINT, lambda *_: stack.request_stop())
    try:
        stack.start()
        print(banner(stack), flush=True)
        stack.supervise()
    finally:
        print("stopping...", file=sys.stderr)
        stack.stop()
    return 0


def _demo(args: argparse.Namespace) -> int:
    from tandem import demo

    return demo.run(args.model, args.question, mode=args.mode)


# The long-running parts: command -> (help, module with add_arguments, module with main).
# Both imported only when needed, so `tandem --help` loads no torch and no web stack.
SERVICES = {
    "engine": (
        "run an engine that serves requests from Redis",
        "tandem.engine.service.arguments",
        "tandem.engine.service.main",
    ),
    "gateway": (
        "run the OpenAI-compatible HTTP gateway",
        "tandem.gateway.main",
        "tandem.gateway.main",
    ),
    "operator": (
        "run the Kubernetes operator for ModelDeployments",
        "tandem.operator.settings",
        "tandem.operator.main",
    ),
    "bench": (
        "load an OpenAI-compatible endpoint and report goodput",
        "tandem.loadgen.main",
        "tandem.loadgen.main",
    ),
    "sim": (
        "simulate a Tandem cluster with the real scheduler",
        "tandem.sim.arguments",
        "tandem.sim.main",
    ),
}


def _run_service(args: argparse.Namespace) -> int:
    return importlib.import_module(SERVICES[args.command][2]).main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for command, (help_text, arguments, _) in SERVICES.items():
        service = sub.add_parser(command, help=help_text)
        importlib.import_module(arguments).add_arguments(service)
        service.set_defaults(func=_run_service)

    walk = sub.add_parser("walkthrough", help="narrate the step scheduler's rules")
    walk.set_defaults(func=_walkthrough)

    chat = sub.add_parser("chat", help="answer a question with a model in this process")
    chat.add_argument("question")
    chat.add_argument("--model", default="smollm2", help="HF directory, .gguf, smollm2")
    chat.add_argument("--max-tokens", type=int, default=64)
    chat.add_argument("--temperature", type=float, default=0.0)
    chat.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16")
    chat.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    chat.set_defaults(func=_chat)

    up = sub.add_parser("up", help="run Redis, a gateway and engines on this machine")
    up.add_argument("--model", default="smollm2")
    up.add_argument("--served-model-name", default=None)
    up.add_argument("--mode", choices=["normal", "disaggregated"], default="normal")
    up.add_argument("--host", default="127.0.0.1")
    up.add_argument("--port", type=int, default=8000)
    up.add_argument("--api-key", default=None, help="default: a new random key")
    up.add_argument("--redis-url", default=None, help="default: an embedded redis-server")
    up.add_argument("--log-dir", default=None)
    up.add_argument(
        "-f",
        "--file",
        default=None,
        help="a ModelDeployment YAML: run its roles here and autoscale them",
    )
    up.set_defaults(func=_up)

    demo = sub.add_parser(
        "demo", help="the main job: `tandem up`, one streamed chat answer over HTTP, shut down"
    )
    demo.add_argument("--model", default="smollm2")
    demo.add_argument("--mode", choices=["normal", "disaggregated"], default="normal")
    demo.add_argument("--question", default=DEMO_QUESTION)
    demo.set_defaults(func=_demo)

    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as exc:  # bad input: say what, no traceback
        print(f"tandem: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
