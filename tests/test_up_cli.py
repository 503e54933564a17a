"""`tandem up` as its user meets it: one clear line when it cannot start (and nothing left
running), the flags -f replaces refused, a banner that says what runs, a help that says it all."""

from __future__ import annotations

import contextlib
import copy
import fcntl
import http.server
import json
import os
import re
import signal
import socket
import subprocess
import sys
import termios
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import yaml
from support.polling import eventually

from tandem import cli, up_command
from tandem.operator.local_actuator import load_manifest
from tandem.redis_server import free_port
from tandem.up import GATEWAY_CUT_S, STOP_TIMEOUT_S, Stack, StartError, UpConfig

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[1]
TANDEM = str(Path(sys.executable).with_name("tandem"))

DISAGGREGATED = {
    "apiVersion": "serving.tandem.dev/v1alpha1",
    "kind": "ModelDeployment",
    "metadata": {"name": "split"},
    "spec": {
        "model": {"path": "random:tiny", "servedModelName": "tiny"},
        "mode": "Disaggregated",
        "prefill": {"minReplicas": 1, "maxReplicas": 2},
        "decode": {"minReplicas": 1},
    },
}


def processes_marked(mark: str) -> list[int]:
    """The processes whose environment holds `mark`: `tandem up` and all it started."""
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if mark.encode() in environ.read_bytes():
                found.append(int(environ.parent.name))
        except OSError:  # exited meanwhile, or not ours
            pass
    return found


def up(*argv: str) -> tuple[subprocess.CompletedProcess[str], list[int]]:
    """Run `tandem up` to its end: what it printed, and its processes still running."""
    mark = uuid.uuid4().hex  # every child inherits the environment
    env = {**os.environ, "TANDEM_CPU_KERNELS": "0", "TANDEM_UP_TEST": mark}
    done = subprocess.run(
        [TANDEM, "up", *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=100
    )
    return done, processes_marked(f"TANDEM_UP_TEST={mark}")


def the_error(done: subprocess.CompletedProcess[str]) -> str:
    """Its one `tandem: error:` line, the last it wrote; no traceback."""
    assert done.returncode != 0
    assert "Traceback" not in done.stderr, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("tandem: error: ")]
    assert len(errors) == 1 and done.stderr.rstrip().endswith(errors[0]), done.stderr
    return errors[0]


@pytest.fixture
def taken_port():
    with socket.create_server(("127.0.0.1", 0)) as listener:
        yield listener.getsockname()[1]


def test_a_port_in_use_is_named_before_anything_starts(taken_port, tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # where its run folder would be made
    done, left = up("--port", str(taken_port))
    error = the_error(done)
    assert f"port {taken_port} on 127.0.0.1 is already in use" in error and "--port" in error
    assert "redis" not in done.stdout  # nothing was started only to be stopped
    assert left == []
    assert list(tmp_path.iterdir()) == []  # its empty run folder left behind, lock and all


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        # Named with the variable it may come from: a user who exported it, and passed
        # no flag, was told of --redis-url only.
        (
            ["--redis-url", "redis://127.0.0.1:1/0"],
            "cannot reach Redis at redis://127.0.0.1:1/0 (--redis-url, or $TANDEM_REDIS_URL)",
        ),
        (["-f", "/nonexistent.yaml"], "cannot read -f /nonexistent.yaml: No such file"),
        # A cluster manifest (Hub download): -f needs spec.model.path.
        (["-f", "examples/smollm2-cpu.yaml"], "the model must be spec.model.path"),
        (["--log-dir", "/proc/no-such-dir"], "cannot create or write to --log-dir /proc/no-such"),
        (["--log-dir", "/proc"], "cannot create or write to --log-dir /proc: "),  # not writable
        # Before anything starts: with a role autoscaled from zero, the first engine
        # started only at the first request, and crash-looped while it waited.
        (["--model", "/no/such/model"], "model '/no/such/model' is no such file or directory"),
        (["--model", "docs"], "model 'docs': no config.json; not a Hugging Face model directory"),
        # It served under --model's name instead.
        (["--served-model-name", ""], "a served model name must be non-empty"),
        # The gateway reads its keys as a comma-separated list: it never came up.
        (["--api-key", "team-key,v2"], "--api-key must be one key of printable ASCII without"),
        (["--api-key", " "], "--api-key must be one key of printable ASCII without commas"),
    ],
    ids=[
        "redis-url",
        "missing-file",
        "cluster-manifest",
        "log-dir",
        "unwritable-log-dir",
        "model",
        "model-folder",
        "served-name",
        "api-key-comma",
        "api-key-blank",
    ],
)
def test_bad_input_is_one_clear_line(argv, says):
    done, left = up(*argv, "--port", str(free_port()))
    assert says in the_error(done)
    assert left == []


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["gateway"], "--redis-url (from $TANDEM_REDIS_URL) is not a Redis URL"),
        (["engine", "--model", "random:tiny"], "--redis-url (from $TANDEM_REDIS_URL) is not a"),
        (["gateway", "--redis-url", "foo://typed"], "error: --redis-url is not a Redis URL"),
        (["gateway", "--redis=foo://typed"], "error: --redis-url is not a Redis URL"),  # prefix
        (["up", "--model", "random:tiny"], "--api-key (from $TANDEM_API_KEY) must be one key"),
        # Not from the environment here: bench's --redis-url reads none, the gateway's
        # keys come from --api-keys-file or $TANDEM_API_KEYS (and --api-key is not a word
        # of --api-keys-file).
        (["bench", "--url", "http://127.0.0.1:9", "--key-prefix", "x"], "needs --redis-url\n"),
        (["gateway", "--redis-url", "redis://127.0.0.1:1/0"], "pass --api-keys-file, set"),
    ],
    ids=["gateway", "engine", "typed", "typed-prefix", "api-key", "bench", "gateway-keys"],
)
def test_a_bad_value_from_the_environment_names_its_variable(argv, says):
    # The user never typed --redis-url: the value came from an exported variable. (A
    # process of its own: the engine's command sets up the process's logging.)
    env = {
        **os.environ,
        "TANDEM_REDIS_URL": "foo://from-the-environment",
        "TANDEM_API_KEY": "with space",
    }
    env.pop("TANDEM_API_KEYS", None)
    done = subprocess.run(
        [sys.executable, "-P", "-m", "tandem.cli", *argv],
        capture_output=True, text=True, env=env, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert says in done.stderr


@pytest.mark.parametrize(
    "in_the_way, says",
    [
        # A file where the embedded Redis keeps its folder, a folder where a log goes.
        ("redis", "redis/appendonly.aof (--log-dir {}): Not a directory"),
        ("gateway.log", "gateway.log (--log-dir {}): Is a directory"),
    ],
)
def test_a_file_in_the_way_in_the_run_folder_is_named(tmp_path, in_the_way, says):
    # It was a traceback (NotADirectoryError, IsADirectoryError).
    path = tmp_path / in_the_way
    if path.suffix == ".log":
        path.mkdir()
    else:
        path.write_text("")
    done, left = up(
        "--model", "random:tiny", "--port", str(free_port()), "--log-dir", str(tmp_path)
    )
    assert says.format(tmp_path) in the_error(done)
    assert left == []


def test_killed_outright_it_takes_everything_it_started_with_it():
    # SIGKILL (an OOM kill, kill -9) forwards nothing: the gateway, the engine and the
    # embedded Redis went on running, orphaned, and held the port.
    mark = f"TANDEM_UP_TEST={uuid.uuid4().hex}"
    env = {**os.environ, "TANDEM_CPU_KERNELS": "0", "TANDEM_UP_TEST": mark.split("=")[1]}
    argv = [TANDEM, "up", "--model", "random:tiny", "--port", str(free_port())]
    with subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True) as proc:
        try:
            lines = []
            for line in proc.stdout:
                lines.append(line)
                if line.startswith("Tandem is up"):
                    break
            # Redis rewrites its environment (its process title): found by its port.
            said = "".join(lines)
            redis_port = int(re.search(r"redis://:\*\*\*@127.0.0.1:(\d+)/", said).group(1))
            started = processes_marked(mark)
            assert len(started) == 3, started  # itself, the gateway, an engine
        finally:
            proc.kill()
    deadline = time.monotonic() + 10
    while (processes_marked(mark) or _listening(redis_port)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert processes_marked(mark) == [] and not _listening(redis_port)


def _listening(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def test_an_engine_that_cannot_start_is_named_with_its_log_and_everything_stops(tmp_path):
    log = tmp_path / "engine-normal.log"
    model = tmp_path / "gpt2"  # a model folder, of an architecture the engine does not run
    model.mkdir()
    (model / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    (model / "model.safetensors").write_bytes(b"")
    done, left = up("--model", str(model), "--port", str(free_port()), "--log-dir", str(tmp_path))
    error = the_error(done)
    assert error.startswith("tandem: error: normal engine exited while starting (2: ")
    assert "GPT2LMHeadModel" in error
    assert f"; details in {log})" in error and "GPT2LMHeadModel" in log.read_text()
    assert left == []  # the gateway and the embedded Redis were stopped too


@pytest.mark.parametrize(
    ("flag", "value", "field"),
    [
        ("--model", "smollm2", "spec.model.path"),
        ("--served-model-name", "tiny", "spec.model.servedModelName"),
        ("--mode", "normal", "spec.mode"),  # the default, given: still refused
        ("--engine-args", "--max-model-len 64", "spec.engine"),
    ],
)
def test_flags_that_the_manifest_sets_are_refused_with_f(tmp_path, capsys, flag, value, field):
    manifest = tmp_path / "split.yaml"
    # Were the flag ignored, this model would fail at once rather than start a stack here.
    bad_path = {**DISAGGREGATED["spec"], "model": {"path": str(tmp_path / "nothing")}}
    manifest.write_text(yaml.safe_dump({**DISAGGREGATED, "spec": bad_path}))
    assert cli.main(["up", "-f", str(manifest), flag, value, "--port", str(free_port())]) == 2
    error = capsys.readouterr().err
    assert (
        error == f"tandem: error: {flag} cannot be used with -f: the manifest sets it ({field})\n"
    )


def test_a_key_given_twice_in_the_manifest_is_refused_as_kubectl_refuses_it(tmp_path, capsys):
    manifest = tmp_path / "twice.yaml"
    text = yaml.safe_dump(DISAGGREGATED, sort_keys=False)
    # The second maxReplicas would win silently, where kubectl refuses the document.
    manifest.write_text(
        text.replace("  decode:\n", "  decode:\n    maxReplicas: 3\n    maxReplicas: 1\n")
    )
    assert cli.main(["up", "-f", str(manifest), "--port", str(free_port())]) == 2
    error = capsys.readouterr().err
    line = manifest.read_text().split("\n").index("    maxReplicas: 1") + 1
    assert error == (
        f"tandem: error: -f {manifest} is not valid YAML: key 'maxReplicas' is given twice "
        f"(first at line {line - 1}) at line {line}, column 5\n"
    )


def test_the_banner_reports_the_mode_and_engines_a_manifest_runs(tmp_path):
    stack = Stack(UpConfig(manifest=DISAGGREGATED, log_dir=tmp_path))
    text = up_command.banner(stack)
    assert "Tandem is up: disaggregated mode, model 'tiny'" in text
    assert "engines  prefill 1 (autoscaled 1-2), decode 1\n" in text
    # The curl to try asks as the demo does, greedy and short: at the API's default
    # temperature 1 and 1,024 tokens, a small model's answer to "Hello!" rambled on.
    body = json.loads(text.split("-d '")[1].split("'")[0])
    assert body == {
        "model": "tiny",
        "temperature": 0,
        "max_tokens": 32,
        "messages": [{"role": "user", "content": up_command.DEMO_QUESTION}],
    }


@pytest.mark.parametrize(
    ("host", "url", "elsewhere"),
    [
        ("0.0.0.0", "http://127.0.0.1:8123/v1", True),
        ("::", "http://[::1]:8123/v1", True),
        ("127.0.0.1", "http://127.0.0.1:8123/v1", False),
        ("fd00::5", "http://[fd00::5]:8123/v1", False),
    ],
)
def test_the_banners_url_is_one_a_client_can_use(tmp_path, host, url, elsewhere):
    # --host 0.0.0.0 printed http://0.0.0.0:8123/v1, which a browser or an SDK on
    # another OS cannot open, and told nothing of the other machines it was for.
    stack = Stack(UpConfig(model="random:tiny", host=host, port=8123, log_dir=tmp_path))
    text = up_command.banner(stack)
    assert f"URL      {url}" in text and f"curl {url}/chat/completions" in text
    assert ("from other machines, this machine's address" in text) == elsewhere


def test_a_manifests_longer_drain_timeout_lengthens_the_stop(tmp_path):
    # As a pod's grace period follows drainTimeoutSeconds: engines given 300 s to finish
    # their requests were killed a minute into the stop, and the gateway's streams with them.
    manifest = copy.deepcopy(DISAGGREGATED)
    manifest["spec"]["decode"]["drainTimeoutSeconds"] = 300
    for spec, expected in ((DISAGGREGATED, STOP_TIMEOUT_S), (manifest, STOP_TIMEOUT_S + 270)):
        stack = Stack(UpConfig(manifest=spec, log_dir=tmp_path / str(expected)))
        try:
            assert stack.stop_timeout == expected
            argv = stack._gateway().argv
            # Its own cut of the streams still open (an error event each) before the kill.
            cut = argv[argv.index("--shutdown-timeout") + 1]
            assert cut == str(expected - GATEWAY_CUT_S)
        finally:
            stack.stop()


def test_the_help_of_up_states_its_defaults_and_what_f_needs(capsys):
    with pytest.raises(SystemExit):
        cli.main(["up", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # wrapped at any terminal width
    for default in ("smollm2", "127.0.0.1, this machine only", "8000", "normal"):
        assert f"(default: {default})" in text
    for said in (
        "a .gguf file",
        "random:<size>",
        "a new temporary folder, kept after exit",
        "spec.model.path",
        "examples/local/smollm2.yaml is a local variant of examples/smollm2-cpu.yaml",
    ):
        assert said in text


@pytest.mark.parametrize("how", ["ctrl-c", "hang-up"])
def test_stopped_from_its_terminal_it_answers_the_requests_in_flight(how):
    # Ctrl-C: the terminal sends SIGINT to its whole foreground group; the embedded
    # Redis took it too and went at once, every request in flight with it. A closed
    # terminal (SIGHUP): writing "stopping" to it failed (EIO) and the stop never ran,
    # the children killed with their parent.
    port = free_port()
    argv = [TANDEM, "up", "--model", "random:tiny", "--port", str(port), "--api-key", "sk-t"]
    env = {**os.environ, "TANDEM_CPU_KERNELS": "0"}
    body = {
        "model": "random:tiny",
        "prompt": "hi",
        "max_tokens": 300,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    terminal, its_end = os.openpty()
    with subprocess.Popen(
        argv,
        cwd=ROOT,
        env=env,
        stdin=its_end,
        stdout=its_end,
        stderr=its_end,
        start_new_session=True,
        # The terminal becomes its controlling one, as a shell's job has it.
        preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0),
    ) as proc:
        os.close(its_end)
        try:
            said = b""
            while b"Tandem is up" not in said:
                said += os.read(terminal, 4096)
            url = f"http://127.0.0.1:{port}/v1/completions"
            with ThreadPoolExecutor(3) as pool, httpx.Client(timeout=90) as client:
                auth = {"Authorization": "Bearer sk-t"}
                tokens: list[list[str]] = [[], []]
                replies = [pool.submit(_stream, client, url, body, auth, seen) for seen in tokens]
                assert eventually(lambda: all(tokens), 60), "no stream began"
                # Both admitted and generating: stopped now, neither has ended.
                assert not any(reply.done() for reply in replies), "ended before the stop"
                if how == "ctrl-c":
                    os.write(terminal, b"\x03")  # the terminal signals its foreground group
                else:
                    os.close(terminal)  # the window closed: SIGHUP
                answers = [reply.result() for reply in replies]
            after: list[bytes] = []
            if how == "ctrl-c":
                reader = threading.Thread(target=_drain, args=(terminal, after), daemon=True)
                reader.start()
            assert proc.wait(timeout=60) == 0
            if how == "ctrl-c":  # it says the stop ended, not only that it began
                reader.join(10)
                assert b"\r\nstopped (logs in " in b"".join(after)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(OSError):
                os.close(terminal)
    for status, usage in answers:
        assert status == 200
        assert usage["completion_tokens"] == 300  # the whole answer


def _stream(client: httpx.Client, url: str, body: dict, headers: dict, seen: list[str]):
    """Read one streamed completion, each text piece into `seen` as it comes: its status
    and the usage its last event carries."""
    usage = None
    with client.stream("POST", url, json=body, headers=headers) as reply:
        for line in reply.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line.removeprefix("data: "))
            seen.extend(choice["text"] for choice in event["choices"])
            usage = event.get("usage") or usage
        return reply.status_code, usage


def _drain(fd: int, into: list[bytes]) -> None:
    """Read a terminal until it closes, `into` a list: a full one would block its writer."""
    with contextlib.suppress(OSError):
        while piece := os.read(fd, 4096):
            into.append(piece)


def _manifest(**changes) -> dict:
    return {**DISAGGREGATED, **changes}


@pytest.mark.parametrize(
    ("text", "says"),
    [
        # Tracebacks (a TypeError, an AttributeError) for a metadata of the wrong shape.
        (yaml.safe_dump(_manifest(metadata={"name": 123})), "metadata.name must be a non-empty"),
        (yaml.safe_dump(_manifest(metadata=["name"])), "metadata must be a mapping with a name"),
        # What kubectl refuses, -f served.
        (
            yaml.safe_dump(_manifest(apiVersion="serving.tandem.dev/v2")),
            "apiVersion must be serving.tandem.dev/v1alpha1, got 'serving.tandem.dev/v2'",
        ),
        (yaml.safe_dump(_manifest(extra=1)), "extra: unknown field (a ModelDeployment has"),
        (
            yaml.safe_dump(_manifest(metadata={"name": "split", "nme": "typo"})),
            "metadata.nme: unknown field",
        ),
        # Valid YAML, but two documents ("not valid YAML: but found another document").
        (
            "apiVersion: v1\nkind: Namespace\nmetadata: {name: ml}\n---\n"
            + yaml.safe_dump(DISAGGREGATED),
            "holds 2 documents (Namespace, ModelDeployment): tandem up runs one",
        ),
    ],
    ids=["name-type", "metadata-list", "api-version", "top-level", "metadata-field", "two-docs"],
)
def test_a_manifest_kubectl_would_refuse_is_one_clear_line(tmp_path, capsys, text, says):
    manifest = tmp_path / "m.yaml"
    manifest.write_text(text)
    assert cli.main(["up", "-f", str(manifest), "--port", str(free_port())]) == 2
    error = capsys.readouterr().err
    assert error.startswith(f"tandem: error: -f {manifest}") and says in error, error
    assert error.count("\n") == 1


def test_a_manifest_that_is_not_text_is_named(tmp_path, capsys):
    manifest = tmp_path / "m.yaml"
    manifest.write_bytes(b"\xff\xfe" + yaml.safe_dump(DISAGGREGATED).encode("utf-16-le"))
    assert cli.main(["up", "-f", str(manifest), "--port", str(free_port())]) == 2
    error = capsys.readouterr().err
    assert error.startswith(f"tandem: error: -f {manifest} is not UTF-8 text"), error


def test_a_manifest_autoscaled_from_zero_names_a_model_that_is_not_there(tmp_path, capsys):
    spec = {**DISAGGREGATED["spec"], "model": {"path": str(tmp_path / "gone")}}
    spec["prefill"] = {"minReplicas": 0, "maxReplicas": 2}
    manifest = tmp_path / "zero.yaml"
    manifest.write_text(yaml.safe_dump({**DISAGGREGATED, "spec": spec}))
    assert cli.main(["up", "-f", str(manifest), "--port", str(free_port())]) == 1  # StartError
    error = capsys.readouterr().err
    assert f"model '{tmp_path / 'gone'}' is no such file or directory" in error, error


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"model": {"path": "random:huge"}}, "model 'random:huge': unknown size 'huge'"),
        (
            {"engine": {"maxModelLen": 100000}},
            "spec.engine.maxModelLen: max_model_len (100000) is longer than the model's 2048",
        ),
    ],
)
def test_a_manifest_autoscaled_from_zero_names_what_no_engine_could_start(
    tmp_path, capsys, change, says
):
    # Found only at the first request, which waited out its deadline while the role's
    # first engine crash-looped.
    spec = {**DISAGGREGATED["spec"], "model": {"path": "random:tiny"}, **change}
    spec["prefill"] = spec["decode"] = {"minReplicas": 0, "maxReplicas": 2}
    manifest = tmp_path / "zero.yaml"
    manifest.write_text(yaml.safe_dump({**DISAGGREGATED, "spec": spec}))
    assert cli.main(["up", "-f", str(manifest), "--port", str(free_port())]) == 1  # StartError
    assert says in capsys.readouterr().err


def test_the_readmes_local_manifest_is_one_that_runs_here():
    manifest = yaml.safe_load((ROOT / "examples" / "local" / "smollm2.yaml").read_text())
    name, spec = load_manifest(manifest)
    assert name == "smollm2" and spec.model.path == "smollm2"
    assert "examples/local/smollm2.yaml" in (ROOT / "README.md").read_text()


def test_engines_slower_than_the_ready_timeout_name_the_flag(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_CPU_KERNELS", "0")
    config = UpConfig(model="random:tiny", port=free_port(), ready_timeout=0.2, log_dir=tmp_path)
    with pytest.raises(StartError, match=r"not ready after 0\.2 s \(--ready-timeout\)"):
        Stack(config).start(say=lambda line: None)
    with pytest.raises(ValueError, match="--ready-timeout must be > 0"):
        UpConfig(ready_timeout=0)


def test_an_ipv6_host_is_written_in_brackets(tmp_path):
    assert Stack(UpConfig(host="::1", port=8123, log_dir=tmp_path)).url == "http://[::1]:8123"
    assert Stack(UpConfig(port=8123, log_dir=tmp_path / "v4")).url == "http://127.0.0.1:8123"


def test_a_gateway_that_exits_while_another_answers_its_port_is_named_at_once(
    tmp_path, monkeypatch
):
    # Two tandem up started at once on one port both pass the port check; the loser's
    # gateway exits ("in use") while the winner's answers its probes: it waited out
    # --ready-timeout, then blamed the engines.
    class Other(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200 if self.path == "/readyz" else 401)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass  # http.server logs every request to stderr: quiet in the test's output

    monkeypatch.setenv("TANDEM_CPU_KERNELS", "0")
    monkeypatch.setattr("tandem.up.check_port", lambda host, port: None)  # the race
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), Other) as other:
        threading.Thread(target=other.serve_forever, daemon=True).start()
        port = other.server_address[1]
        config = UpConfig(model="random:tiny", port=port, ready_timeout=100, log_dir=tmp_path)
        started = time.monotonic()
        with pytest.raises(StartError, match=r"gateway exited while starting \(2: .*in use"):
            Stack(config).start(say=lambda line: None)
        other.shutdown()
    assert time.monotonic() - started < 60


def test_a_stack_that_gives_up_exits_non_zero_and_says_why(tmp_path):
    # Its Redis died and something took the port: it stopped, as it must, but exited 0
    # (a supervisor's restart-on-failure read a clean stop) saying "redis-server exited: ".
    argv = [TANDEM, "up", "--model", "random:tiny", "--port", str(free_port())]
    env = {**os.environ, "TANDEM_CPU_KERNELS": "0", "PYTHONUNBUFFERED": "1"}
    with subprocess.Popen(
        [*argv, "--log-dir", str(tmp_path)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    ) as proc:
        said = ""
        while "Tandem is up" not in said:
            line = proc.stdout.readline()
            assert line, said
            said += line
        port = int(re.search(r"redis +redis://:\*\*\*@127\.0\.0\.1:(\d+)/0", said).group(1))
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        (redis_pid,) = [
            int(pid)
            for pid in children
            if b"redis-server" in Path(f"/proc/{pid}/cmdline").read_bytes()
        ]
        os.kill(redis_pid, signal.SIGKILL)
        with socket.socket() as taker:
            deadline = time.monotonic() + 10
            while True:  # before the supervisor restarts it
                try:
                    taker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    taker.bind(("127.0.0.1", port))
                    break
                except OSError:
                    assert time.monotonic() < deadline, "the port never came free"
                    time.sleep(0.005)
            taker.listen()
            rest, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1, said + rest
    error = rest.rstrip().splitlines()[-1]
    assert error.startswith("tandem: error: the embedded Redis could not restart: "), rest
    assert "Address already in use" in error


@pytest.mark.parametrize(
    ("files", "says"),
    [
        (["config.json"], "no *.safetensors weight files"),
        (["model.Q4_1.gguf"], "holds GGUF files, not a Hugging Face model; pass "),
        (["config.json", "pytorch_model.bin"], "only pickled weights (*.bin/*.pt); convert"),
    ],
)
def test_a_folder_that_holds_no_model_is_refused_before_anything_starts(
    tmp_path, capsys, files, says
):
    # It passed as a model: with a role autoscaled from zero, the first request started
    # an engine that crash-looped on it, and the request waited out its deadline.
    folder = tmp_path / "model"
    folder.mkdir()
    for name in files:
        (folder / name).write_text("{}")
    assert cli.main(["up", "--model", str(folder), "--port", str(free_port())]) == 1
    error = capsys.readouterr().err
    assert error.startswith(f"tandem: error: model '{folder}'") and says in error, error


def test_what_the_stack_and_its_autoscaler_say_goes_through_the_same_safe_writer(
    tmp_path, monkeypatch
):
    # The start, and the local autoscaler it starts (scale, starting, ready, draining),
    # said their lines with print: a reader gone (`| grep -m1`) stopped the whole stack
    # at the next scale, exit 0, and through a pipe the lines came only at the exit.
    told: list[object] = []

    def start(self, say=print):
        told.append(say)
        raise KeyboardInterrupt

    monkeypatch.setattr(Stack, "start", start)
    argv = ["up", "--model", "random:tiny", "--port", str(free_port()), "--log-dir", str(tmp_path)]
    assert cli.main(argv) == 130
    assert told == [up_command._say]


def test_a_line_for_a_reader_that_left_is_dropped_and_tandem_up_serves_on():
    # `tandem up | grep -m1 'API key'`: the next line (an engine's restart) raised
    # BrokenPipeError out of the supervisor, and the whole stack stopped, exit 0.
    code = (
        "from tandem.up_command import _say\n"
        "_say('first'); _say('a restart, said to nobody'); _say('and another')\n"
        "print('served on', file=__import__('sys').stderr)\n"
    )
    reader = subprocess.Popen([sys.executable, "-P", "-c", "import sys; sys.stdin.readline()"],
                              stdin=subprocess.PIPE)  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-P", "-c", "import time; time.sleep(0.5); " + code.replace("\n", "; ")],
        stdout=reader.stdin, stderr=subprocess.PIPE, text=True, timeout=60, check=False,
    )  # fmt: skip
    reader.wait(timeout=10)
    assert done.returncode == 0 and "served on" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


class _Started(Exception):
    """Raised in place of starting a stack: its config is kept."""


@pytest.fixture
def started(monkeypatch) -> list:
    """The configs `tandem up` would start stacks with (none starts)."""
    configs = []

    def stack(config):
        configs.append(config)
        raise _Started

    monkeypatch.setattr(up_command, "Stack", stack)
    return configs


def test_engine_args_reach_every_engine_as_tandem_engine_reads_them(started, capsys):
    # tandem up had no way to give the engines a flag (a shorter context, chunked
    # prefill) but a whole ModelDeployment manifest.
    with pytest.raises(_Started):
        cli.main(["up", "--engine-args", "--max-model-len 64 --enable-chunked-prefill"])
    assert started[0].engine_args == ("--max-model-len", "64", "--enable-chunked-prefill")
    refused = {
        "--port 9000": "--engine-args cannot set --port: set by tandem up (a free port each)",
        "--model=x": "--engine-args cannot set --model: set by --model",
        "--role prompt": "--engine-args cannot set --role: set by --mode",
        "--max-model-len 0": "--engine-args: --max-model-len must be at least 1, got 0",
        "--max-model-len x": "--engine-args: argument --max-model-len: invalid int value: 'x'",
        "--max-mod 64": "--engine-args: unrecognized arguments: --max-mod 64",  # no prefixes
        "--seed '1": '--engine-args "--seed \'1": No closing quotation',
    }
    for flags, error in refused.items():
        assert cli.main(["up", f"--engine-args={flags}"]) == 2, flags
        assert capsys.readouterr().err == f"tandem: error: {error}\n"
    assert len(started) == 1  # nothing started for any of them


def test_gateway_args_reach_the_gateway_as_tandem_gateway_reads_them(started, capsys):
    # Answers without max_tokens stop at the gateway's default (1,024 tokens), which
    # tandem up gave no way to change.
    with pytest.raises(_Started):
        cli.main(["up", "--gateway-args", "--default-max-tokens 4096 --max-queue 64"])
    assert started[0].gateway_args == ("--default-max-tokens", "4096", "--max-queue", "64")
    refused = {
        "--port 9000": "--gateway-args cannot set --port: set by --port",
        "--no-auth": "--gateway-args cannot set --no-auth: set by --api-key",
        "--default-max-tokens 0": "--gateway-args: default_max_tokens must be an integer >= 1",
        "--max-q 64": "--gateway-args: unrecognized arguments: --max-q 64",  # no prefixes
    }
    for flags, error in refused.items():
        assert cli.main(["up", f"--gateway-args={flags}"]) == 2, flags
        assert capsys.readouterr().err.startswith(f"tandem: error: {error}"), flags
    assert len(started) == 1  # nothing started for any of them
