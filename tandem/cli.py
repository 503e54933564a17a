"""The `tandem` command."""

from __future__ import annotations

import argparse
import copy
import importlib
import os
import re
import sys
import time

# Light (no torch, no web stack): `tandem up`'s error and the defaults its help states.
from tandem import up_command
from tandem.preflight import StartError

DEMO_QUESTION = up_command.DEMO_QUESTION


def _walkthrough(_: argparse.Namespace) -> int:
    from tandem.engine import walkthrough

    walkthrough.run()
    return 0


def _chat(args: argparse.Namespace) -> int:
    """Answer one question with a local model, streaming the answer."""
    from tandem.engine import LLM, SamplingParams

    # Checked before the model loads: a bad value costs no load.
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed
    )
    started = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype, device=args.device, seed=None)
    loaded = time.perf_counter()
    print(f"[{args.model} loaded in {loaded - started:.1f}s]", file=sys.stderr)
    # stdout holds the answer alone (`tandem chat ... > answer.txt`), the rest is stderr.
    print(f"> {args.question}", file=sys.stderr, flush=True)
    engine = llm.engine
    if llm.tokenizer is None:
        raise ValueError(f"{args.model} has no tokenizer (tokenizer.json), so no chat template")
    if not llm.tokenizer.chat_template:
        raise ValueError(
            f"{args.model} has no chat template (a base model?): `tandem chat` needs a chat "
            "model; a base model continues plain text (LLM.generate, /v1/completions)"
        )
    prompt = llm.tokenizer.encode_chat([{"role": "user", "content": args.question}])
    engine.add_request("chat", prompt_token_ids=prompt, sampling_params=params)
    num_tokens = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            print(out.text_delta, end="", flush=True)
            num_tokens = out.num_output_tokens
    elapsed = time.perf_counter() - loaded
    print(flush=True)
    print(f"[{num_tokens} tokens in {elapsed:.2f}s]", file=sys.stderr)
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


def _sentence(help_text: str) -> str:
    """A command's one-line help as the description its own --help opens with."""
    return f"{help_text[:1].upper()}{help_text[1:]}."


class _DefaultsFormatter(argparse.HelpFormatter):
    """Each option's default in its help, where it has one worth showing and the
    help does not say it already (the gateway's, the bench's and the simulator's
    flags were silent about theirs)."""

    def _format_action(self, action: argparse.Action) -> str:
        default = action.default
        hidden = (None, False, argparse.SUPPRESS)  # by identity: 0 is a default to show
        shown = not any(default is h for h in hidden) and default not in (float("inf"), ())
        text = action.help or ""
        silent = text is not argparse.SUPPRESS and "default" not in text
        if action.option_strings and shown and silent:
            action = copy.copy(action)
            action.help = f"{text} (default: %(default)s)" if text else "default: %(default)s"
        return super()._format_action(action)


def _run_service(args: argparse.Namespace) -> int:
    return importlib.import_module(SERVICES[args.command][2]).main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for command, (help_text, arguments, _) in SERVICES.items():
        service = sub.add_parser(
            command,
            help=help_text,
            description=_sentence(help_text),
            formatter_class=_DefaultsFormatter,
        )
        importlib.import_module(arguments).add_arguments(service)
        service.set_defaults(func=_run_service)

    walk = sub.add_parser(
        "walkthrough",
        help="narrate the step scheduler's rules",
        description="Run the engine's real scheduler on a toy workload, no model, and say "
        "what each step does and which rule decided it (docs/scheduler.md).",
    )
    walk.set_defaults(func=_walkthrough)

    chat_help = "answer a question with a model in this process"
    chat = sub.add_parser("chat", help=chat_help, description=_sentence(chat_help))
    chat.add_argument("question")
    chat.add_argument(
        "--model",
        default="smollm2",
        help="a Hugging Face model directory, a .gguf file, smollm2 or random:<size> "
        "(default: %(default)s)",
    )
    chat.add_argument(
        "--max-tokens", type=int, default=64, help="longest answer (default: %(default)s)"
    )
    chat.add_argument(
        "--temperature", type=float, default=0.0, help="0: greedy (default: %(default)s)"
    )
    chat.add_argument(
        "--seed", type=int, help="the same seed, the same answer (default: a new one each run)"
    )
    chat.add_argument("--dtype", default=None, help="float32 (CPU default), bfloat16 or float16")
    chat.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    chat.set_defaults(func=_chat)

    up_command.add_parser(sub)

    demo = sub.add_parser(
        "demo",
        help="the main job: `tandem up`, one streamed chat answer over HTTP, shut down",
        description="Start Tandem on this machine as `tandem up` does, ask one question "
        "through the OpenAI-compatible API with streaming, print the answer as it comes, "
        "and stop everything.",
    )
    demo.add_argument(
        "--model",
        default="smollm2",
        help="the model, in any form `tandem up --model` takes (default: %(default)s)",
    )
    demo.add_argument(
        "--mode",
        choices=["normal", "disaggregated"],
        default="normal",
        help="one engine, or a prefill and a decode engine moving KV (default: %(default)s)",
    )
    demo.add_argument(
        "--question", default=DEMO_QUESTION, help="what to ask (default: %(default)r)"
    )
    demo.set_defaults(func=_demo)

    return parser


# Flags whose default is an environment variable's value, by the commands that read it
# so: where such a value is at fault, the error names the variable too (its user never
# typed the flag).
_FLAG_VARIABLES = {
    "gateway": {"--redis-url": "TANDEM_REDIS_URL"},
    "engine": {"--redis-url": "TANDEM_REDIS_URL"},
    "up": {"--redis-url": "TANDEM_REDIS_URL", "--api-key": "TANDEM_API_KEY"},
}


def naming_environment(message: str, argv: list[str]) -> str:
    """The message, each flag it names that took its value from the environment (for
    this command) followed by that variable's name."""
    command = next((arg for arg in argv if not arg.startswith("-")), "")
    for flag, variable in _FLAG_VARIABLES.get(command, {}).items():
        # argparse takes a flag's unambiguous prefix (--redis) as the flag.
        typed = any(
            len(name := arg.partition("=")[0]) > 2 and flag.startswith(name) for arg in argv
        )
        named = f"${variable}" in message
        if typed or named or not os.environ.get(variable):
            continue
        # The flag as a word: --api-key is the start of --api-keys-file too.
        word = rf"{re.escape(flag)}(?![\w-])"
        message = re.sub(word, f"{flag} (from ${variable})", message, count=1)
    return message


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)  # Ctrl-C here too: no traceback
        return args.func(args)
    except ValueError as exc:  # bad input: say what, no traceback
        said = naming_environment(str(exc), sys.argv[1:] if argv is None else argv)
        print(f"tandem: error: {said}", file=sys.stderr)
        return 2
    except StartError as exc:  # `tandem up` or `demo` did not start; it says why
        print(f"tandem: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C where a command keeps nothing to report
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:  # `| head`: the reader has all it wanted, at any write
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error at exit
        return 0


if __name__ == "__main__":
    sys.exit(main())
