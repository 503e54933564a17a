"""`tandem bench` arguments: bad ones are refused with a message naming the problem (exit 2)."""

import pytest

from tandem import cli


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--rate", "0"], "--rate must be > 0"),
        (["--burstiness", "-1", "--rate", "5"], "--burstiness must be"),
        (["--num-requests", "0"], "--num-requests must be >= 1"),
        (["--duration", "-3"], "--duration must be > 0"),
        (["--concurrency", "-1"], "--concurrency must be >= 0"),
        (["--timeout", "0"], "--timeout must be > 0"),
        (["--replica-poll-s", "0"], "--replica-poll-s must be > 0"),
        (["--input-tokens", "uniform:9:1"], "--input-tokens 'uniform:9:1'"),
        (["--output-tokens", "nope:1"], "--output-tokens 'nope:1': unknown kind"),
        (["--slo-ttft-ms", "0"], "--slo-ttft-ms must be > 0"),
        (["--duration", "5", "--concurrency", "0"], "--rate inf with --duration needs"),
        (["--url", "ftp://host/v1"], "--url must be an http(s) URL"),
        (["--api", "chat", "--prompt", "ids"], "--prompt ids needs --api completions"),
        (["--token-id-range", "9"], "--token-id-range must be LOW:HIGH"),
        (["--token-id-range", "9:2"], "0 <= LOW <= HIGH"),
        (["--trace", "/nonexistent/t.jsonl"], "cannot read trace /nonexistent/t.jsonl"),
        (["--trace", "x.jsonl", "--trace-time-scale", "0"], "--trace-time-scale must be > 0"),
    ],
)
def test_bad_arguments_exit_2_naming_the_problem(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "x.jsonl").write_text('{"arrival_s": 0, "input_tokens": 1, "output_tokens": 1}\n')
    # A closed port: an argument check that let the run start would fail differently.
    assert cli.main(["bench", "--url", "http://127.0.0.1:9/v1", *argv]) == 2
    assert message in capsys.readouterr().err


def test_a_bad_trace_line_is_named(capsys, tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"arrival_s": 0, "input_tokens": 1, "output_tokens": 1}\n{"arrival_s": 1}\n')
    assert cli.main(["bench", "--trace", str(trace)]) == 2
    assert f"{trace} line 2: missing input_tokens, output_tokens" in capsys.readouterr().err


def test_an_unreachable_server_is_a_clear_error(capsys):
    # The model is looked up first (/v1/models): nothing listens on port 9.
    assert cli.main(["bench", "--url", "http://127.0.0.1:9", "-n", "1", "-q"]) == 2
    assert "cannot reach http://127.0.0.1:9/v1/models" in capsys.readouterr().err


def test_text_calibration_against_an_unreachable_server_is_a_clear_error(capsys):
    argv = ["bench", "--url", "http://127.0.0.1:9/v1", "--model", "m", "--prompt", "text", "-q"]
    assert cli.main(argv) == 2
    assert "calibration request to http://127.0.0.1:9/v1/completions failed" in (
        capsys.readouterr().err
    )
