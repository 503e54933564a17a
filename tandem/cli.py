"""The `tandem` command."""

from __future__ import annotations

import argparse
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


def _engine(args: argparse.Namespace) -> int:
    from tandem.engine.service import main as service

    return service.main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    walk = sub.add_parser("walkthrough", help="narrate the step scheduler's rules")
    walk.set_defaults(func=_walkthrough)

    engine = sub.add_parser("engine", help="run an engine that serves requests from Redis")
    _add_engine_arguments(engine)
    engine.set_defaults(func=_engine)

    for name, help_text in (
        ("chat", "answer a question with a local model"),
        ("demo", "the product's main job on this machine: a real answer from SmolLM2"),
    ):
        cmd = sub.add_parser(name, help=help_text)
        if name == "chat":
            cmd.add_argument("question")
        else:
            cmd.set_defaults(question=DEMO_QUESTION)
        cmd.add_argument("--model", default="smollm2", help="HF directory, .gguf, smollm2")
        cmd.add_argument("--max-tokens", type=int, default=64)
        cmd.add_argument("--temperature", type=float, default=0.0)
        cmd.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16")
        cmd.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
        cmd.set_defaults(func=_chat)
    return parser


def _add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    from tandem.engine.service.arguments import add_arguments

    add_arguments(parser)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as exc:  # bad input: say what, no traceback
        print(f"tandem: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
