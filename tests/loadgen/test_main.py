"""`tandem bench` end to end on the fake server: the report, and no result lost to an output."""

import json

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
