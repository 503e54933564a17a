"""`tandem bench` end to end on the fake server: the report, and no result lost to an output."""

import json
import os
import signal
import threading

import httpx
import pytest

from tandem import cli
from tandem.loadgen import main

from .fake_server import FakeServer


def bench(*argv: str, transport: httpx.AsyncBaseTransport) -> int:
    args = cli.build_parser().parse_args(["bench", "--url", "http://fake/v1", "-q", *argv])
    return main.main(args, transport=transport)


def test_a_run_prints_the_report_and_writes_the_json(tmp_path, capsys):
    path = tmp_path / "new" / "r.json"  # its folder is made when it is written
    assert bench("-n", "3", "--json", str(path), transport=FakeServer().transport()) == 0
    assert "3 sent, 3 ok, 0 failed" in capsys.readouterr().out
    report = json.loads(path.read_text())
    assert report["requests"]["ok"] == 3 and report["config"]["model"] == "fake"


def test_a_json_that_cannot_be_written_after_the_run_loses_no_result(tmp_path, capsys):
    server = FakeServer()
    blocker = tmp_path / "out"
    path = blocker / "r.json"

    async def handle(request: httpx.Request) -> httpx.Response:
        blocker.write_text("")  # the JSON's folder becomes a file while the run goes on
        return await server.handle(request)

    assert bench("-n", "2", "--json", str(path), transport=httpx.MockTransport(handle)) == 1
    out, err = capsys.readouterr()
    assert "2 sent, 2 ok, 0 failed" in out  # the text report came first
    assert err.startswith(f"tandem: error: --json {path}: cannot write (")
    assert err.count("\n") == 1


def test_a_failed_calibration_request_is_a_clear_error():
    async def handle(request: httpx.Request) -> httpx.Response:
        if request.method == "GET":
            return await FakeServer().handle(request)
        raise httpx.ConnectError("connection refused")

    with pytest.raises(
        ValueError, match="calibration request to http://fake/v1/completions failed"
    ):
        bench("--prompt", "text", transport=httpx.MockTransport(handle))


# SIGTERM: what `timeout`, a cancelled CI job or a Job's end sends (it lost the report).
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_ctrl_c_ends_the_run_with_the_report_of_what_was_answered(tmp_path, capsys, signum):
    # Ten requests of ~0.4 s, two at a time; Ctrl-C after ~1 s: a few answered,
    # two in flight dropped, the rest never sent. A long run stopped early still
    # has its figures.
    server = FakeServer(token_delay=0.02)
    path = tmp_path / "r.json"
    argv = ["-n", "10", "--rate", "inf", "--concurrency", "2", "--output-tokens", "20"]
    timer = threading.Timer(1.0, os.kill, (os.getpid(), signum))
    timer.start()
    try:
        status = bench(*argv, "--json", str(path), transport=server.transport())
    finally:
        timer.cancel()
    assert status == 130
    report = json.loads(path.read_text())
    requests = report["requests"]
    assert requests["interrupted"] in (1, 2)
    # The requests cut were sent: they count, and against the goodput fraction.
    assert requests["ok"] + requests["interrupted"] == requests["sent"] < 10
    assert requests["ok"] >= 1
    assert report["goodput"]["fraction"] == requests["ok"] / requests["sent"] < 1
    assert "interrupted (Ctrl-C or SIGTERM)" in capsys.readouterr().out
