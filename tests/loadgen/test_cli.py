"""`tandem bench` arguments: bad ones are refused with a message naming the problem (exit 2)."""

import contextlib
import http.server
import json
import socket
import threading
from collections.abc import Iterator

import pytest

from tandem import cli
from tandem.loadgen import main


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--rate", "0"], "--rate must be > 0"),
        (["--burstiness", "-1", "--rate", "5"], "--burstiness must be"),
        (["--num-requests", "0"], "--num-requests must be >= 1"),
        (["--duration", "-3"], "--duration must be a finite number > 0"),
        # It was taken, and the run never ended.
        (["--duration", "inf", "--rate", "1"], "--duration must be a finite number > 0"),
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
        # Past a vocabulary's size by far: the prompt's draw overflowed mid-run.
        (["--token-id-range", f"0:{2**63}"], "0 <= LOW <= HIGH < 2**31"),
        (["--url", "http://127.0.0.1:99999/v1"], "--url 'http://127.0.0.1:99999/v1' is not a"),
        (["--url", "http://127.0.0.1:abc/v1"], "--url 'http://127.0.0.1:abc/v1' is not a valid"),
        (["--url", "http://[::1"], "--url 'http://[::1' is not a valid URL"),
        (["--redis-url", "notaurl"], "--redis-url is not a Redis URL: redis://[[user]"),
        # Neither the URL nor redis-py's reason, which quoted the password's first half.
        (["--redis-url", "redis://:Sup3r/Pw@h:6379/0"], "--redis-url is not a Redis URL: "),
        (["--temperature", "-1"], "--temperature must be between 0 and 2"),
        (["--temperature", "nan"], "--temperature must be between 0 and 2"),
        (["--trace", "/nonexistent/t.jsonl"], "cannot read trace /nonexistent/t.jsonl"),
        (["--trace", "latin1.jsonl"], "latin1.jsonl line 2: not UTF-8 text (byte 0xe9)"),
        (["--trace", "x.jsonl", "--trace-time-scale", "0"], "--trace-time-scale must be a finite"),
        (["--trace", "x.jsonl", "--trace-time-scale", "inf"], "--trace-time-scale must be a fin"),
        # Finite, but the last arrival (2 s) scaled is not: refused before anything is sent.
        (["--trace", "x.jsonl", "--trace-time-scale", "1e308"], "last arrival (2 s) infinite"),
        # Flags that would be silently ignored.
        (["--trace", "x.jsonl", "--rate", "5"], "--rate cannot be used with --trace"),
        (["--trace", "x.jsonl", "--input-tokens", "9"], "--input-tokens cannot be used with"),
        (["--trace-time-scale", "0.5"], "--trace-time-scale needs --trace"),
        (["--burstiness", "0.5"], "--burstiness needs a finite --rate"),
        (["--api", "chat", "--token-id-range", "1:9"], "--token-id-range needs --prompt ids"),
        (["--key-prefix", "x"], "--key-prefix needs --redis-url"),
        # Outputs are checked before the run, not found unwritable once it is over.
        (["--json", "/proc/nope/r.json"], "--json /proc/nope/r.json: cannot write"),
        (["--json", "."], "--json .: is a folder, not a file"),
        (["--json", "x.jsonl/r.json"], "--json x.jsonl/r.json: x.jsonl is not a folder"),
        (["--plots", "x.jsonl"], "--plots x.jsonl: is not a folder"),
        (["--plots", "/proc/nope"], "--plots /proc/nope: cannot write"),
        # A pasted smart quote failed in an ASCII codec's words; a newline as "cannot
        # reach" the server. The key itself is not echoed.
        (["--api-key", "sk-rev\u201c"], "--api-key must be printable ASCII"),
        (["--api-key", "sk-rev\n"], "--api-key must be printable ASCII"),
    ],
)
def test_bad_arguments_exit_2_naming_the_problem(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    request = '{"arrival_s": %d, "input_tokens": 1, "output_tokens": 1}\n'
    (tmp_path / "x.jsonl").write_text(request % 0 + request % 2)
    (tmp_path / "latin1.jsonl").write_bytes((request % 0 + "# caf\xe9\n").encode("latin-1"))
    # A closed port: an argument check that let the run start would fail differently.
    assert cli.main(["bench", "--url", "http://127.0.0.1:9/v1", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Sup3r" not in err
    assert err.startswith("tandem: error: ") and err.count("\n") == 1  # one line, no traceback


def test_a_bad_trace_line_is_named(capsys, tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"arrival_s": 0, "input_tokens": 1, "output_tokens": 1}\n{"arrival_s": 1}\n')
    assert cli.main(["bench", "--trace", str(trace)]) == 2
    assert f"{trace} line 2: missing input_tokens, output_tokens" in capsys.readouterr().err


@pytest.mark.parametrize("model", [[], ["--model", "m"]])
def test_an_unreachable_server_stops_the_bench_before_the_run(model, capsys):
    # /v1/models is asked first, with --model too: nothing listens on port 9. Without
    # the probe, 20 requests at 2/s would each fail to connect, for 10 s, and exit 1.
    argv = ["bench", "--url", "http://127.0.0.1:9", *model, "-n", "20", "--rate", "2", "-q"]
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert err.startswith("tandem: error: cannot reach http://127.0.0.1:9/v1/models: ")
    assert out == ""


def test_a_server_that_never_answers_is_said_to_time_out(capsys, monkeypatch):
    monkeypatch.setattr(main, "PROBE_TIMEOUT_S", 0.2)
    # Connections are accepted (the kernel's backlog) but nothing is ever answered.
    with socket.create_server(("127.0.0.1", 0)) as server:
        url = f"http://127.0.0.1:{server.getsockname()[1]}/v1"
        assert cli.main(["bench", "--url", url, "--model", "m", "-n", "1", "-q"]) == 2
    assert f"cannot reach {url}/models: no answer within 0.2 s" in capsys.readouterr().err


@contextlib.contextmanager
def answering(status: int, path: str = "/v1") -> Iterator[str]:
    """A server answering every GET with `status` and no body; the URL under `path`."""

    class Answers(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(status)
            self.end_headers()

        def log_message(self, *args):
            pass  # http.server logs every request to stderr, which the test reads

    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), Answers) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        yield f"http://127.0.0.1:{server.server_address[1]}{path}"
        server.shutdown()


@pytest.mark.parametrize("model", [[], ["--model", "m"]])
def test_a_refused_api_key_stops_the_bench_naming_the_flag(model, capsys):
    with answering(401) as url:
        argv = ["bench", "--url", url, "--api-key", "bad", *model, "-n", "3", "-q"]
        assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err == (
        f"tandem: error: {url}/models answered 401: the server refuses the API key; "
        "check --api-key (or $TANDEM_API_KEY / $OPENAI_API_KEY)\n"
    )


@pytest.mark.parametrize("model", [[], ["--model", "m"]])
def test_an_endpoint_given_as_the_url_is_named_before_the_run(model, capsys):
    # It said "give --model"; given one, every request of the run was a 404.
    with answering(404, "/v1/completions") as url:
        assert cli.main(["bench", "--url", url, *model, "-n", "3", "-q"]) == 2
    err = capsys.readouterr().err
    assert "--url is the API's base, ending in /v1" in err and err.count("\n") == 1


def test_a_model_the_server_does_not_list_is_warned_of_first(capsys):
    class Lists(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"object": "list", "data": [{"id": "smollm2-135m-instruct"}]})
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body.encode())

        def log_message(self, *args):
            pass  # http.server logs every request to stderr, which the test reads

    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), Lists) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        url = f"http://127.0.0.1:{server.server_address[1]}/v1"
        cli.main(["bench", "--url", url, "--model", "smollm2", "-n", "1", "-q"])
        server.shutdown()
    assert capsys.readouterr().err.startswith(
        f"tandem: warning: --model smollm2: {url}/models lists only ['smollm2-135m-instruct']"
        "; requests may fail with 404\n"
    )
