"""`tandem sim`'s flags: bad values and conflicting flags are refused, naming the flag."""

import pytest

from tandem.cli import build_parser, main
from tandem.sim.arguments import check_args

SIM = ["sim", "--model", "llama-8b", "--duration", "2"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        # Infinite or out-of-range times (--until inf hung with an autoscaler, and
        # gave bare Infinity in --json).
        (["--until", "inf"], "--until must be a finite number of seconds >= 0, got inf"),
        (["--max-time", "-1"], "--max-time must be a finite number of seconds > 0, got -1.0"),
        (["--rate", "1e5", "--duration", "1e5"], "is 10,000,000,000 requests; a workload holds"),
        (
            ["--startup-s", "1e300", "--max-replicas", "2"],
            "--startup-s must be at most 86400 s (a day), got 1e+300",
        ),
        (["--max-time", "nan"], "--max-time must be a finite number of seconds > 0, got nan"),
        (["--until", "60", "--max-time", "30"], "--until 60 is past --max-time 30"),
        (
            ["--startup-s", "-1", "--max-replicas", "2"],
            "--startup-s must be a finite number of seconds >= 0",
        ),
        # Flags the deployment leaves without effect (they changed nothing, said nothing).
        (["--startup-s", "5"], "--startup-s: only where some role is autoscaled"),
        (["--network-gbps", "1"], "--network-gbps: only for a disaggregated deployment"),
        (
            ["--mode", "disaggregated", "--prefill-attempt-interval", "1"],
            "--prefill-attempt-interval: only for a normal deployment",
        ),
        # A workload of no request, as an empty trace is (the trace it saved was).
        (["--rate", "0.001", "--duration", "1"], "draws no request (this --seed): raise either"),
        (["--arrival", "bursty", "--cv", "1e6"], "--cv must be in (0, 10], got 1000000.0"),
        # Lengths: one parser with `tandem bench` (tandem/lengths.py).
        (["--input", "uniform:5:inf"], "--input 'uniform:5:inf': numbers must be finite"),
        (["--input", "1e30"], "a fixed length is one integer in 1..10,000,000"),
        (["--input", "1.5"], "a fixed length is one integer"),
        (["--input", "lognormal:1000:50"], "the median is 0"),
        # Every prompt over the context: refused, not clipped to it.
        (["--input", "10000"], "every length is over 8191 tokens, the longest the model takes"),
        # A prompt of the whole context leaves its first token no room.
        (["--input", "8192"], "--input '8192': every length is over 8191 tokens"),
        # Tensor parallelism the model and the node allow.
        (["--tp", "3"], "--tp 3: llama-8b on h200 takes --tp 1, 2, 4, 8"),
        (["--tp", "1000"], "--tp 1000: llama-8b on h200 takes --tp 1, 2, 4, 8"),
        (["--tp", "0"], "--tp must be an integer >= 1, got 0"),
        # Messages that name the flag and the role.
        (["--seed", "-1"], "--seed must be an integer >= 0, got -1"),
        (["--replicas", "-1"], "--replicas must be an integer in 0..100,000, got -1"),
        # Each pod is a real scheduler: 10^8 of them ran out of memory, killed in silence.
        (["--replicas", "100000000"], "--replicas must be an integer in 0..100,000, got 1000"),
        (["--replicas", "0"], "--replicas 0 needs --max-replicas >= 1"),
        (["--mode", "disaggregated", "--prefill", "0"], "--prefill 0 needs --prefill-max >= 1"),
        (["--replicas", "3", "--max-replicas", "2"], "--replicas 3 must be within --min-replicas"),
    ],
)
def test_bad_values_are_refused_naming_the_flag(argv, message, capsys):
    assert main([*SIM, *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tandem: error: ") and message in err


def test_a_start_up_of_zero_seconds_is_allowed():
    assert main([*SIM, "--startup-s", "0", "--max-replicas", "2", "--json"]) == 0


def _check(*argv):
    check_args(build_parser().parse_args(["sim", *argv]))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--mode", "normal", "--decode", "5", "--prefill", "3"],
            "--decode, --prefill: only with --mode disaggregated; this run is --mode normal: "
            "its pods are set by --replicas, --min-replicas, --max-replicas",
        ),
        (["--decode-max", "4"], "--decode-max: only with --mode disaggregated; this run is "),
        (["--mode", "disaggregated", "--replicas", "7"], "--replicas: only with --mode normal"),
        (
            [
                "--deployment",
                "x.yaml",
                "--model",
                "llama-8b",
                "--mode",
                "disaggregated",
                "--replicas",
                "5",
            ],
            "--mode, --replicas: not with --deployment",
        ),
        (
            ["--deployment", "x.yaml", "--model", "llama-8b", "--chunked-prefill"],
            "--chunked-prefill: not with",
        ),
        # A manifest names a checkpoint: llama-70b (the default) answered for any.
        (["--deployment", "x.yaml", "--tp", "1"], "--deployment needs --model, the simulated"),
        (
            ["--trace", "t.jsonl", "--rate", "3", "--input", "10"],
            "--rate, --input: not with --trace",
        ),
        (["--cv", "5"], "--cv: only with --arrival bursty"),
        (["--slo-tpot", "0"], "--slo-tpot must be a finite number of seconds > 0"),
    ],
)
def test_flags_a_run_would_ignore_are_refused(argv, message):
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(")):
        _check(*argv)


def test_flags_given_with_their_default_value_count_as_given():
    with pytest.raises(ValueError, match="--replicas: only with --mode normal"):
        _check("--mode", "disaggregated", "--replicas", "1")
    _check("--mode", "disaggregated", "--prefill", "2", "--decode-max", "3")
    _check("--arrival", "bursty", "--cv", "5")
    _check("--deployment", "x.yaml", "--model", "llama-70b", "--tp", "2", "--rate", "4")
