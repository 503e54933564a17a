"""`tandem <service> --help` says each flag's default, and no secret."""

import pytest

from tandem import cli


def _help(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit):
        cli.main([*argv, "--help"])
    return " ".join(capsys.readouterr().out.split())  # argparse wraps lines


def test_the_simulator_and_the_bench_say_their_defaults(capsys):
    text = _help(capsys, "sim")
    assert "--rate RATE requests/s (default: 2.0)" in text
    assert "--seed SEED default: 0" in text  # a zero is a default too
    assert "--max-model-len MAX_MODEL_LEN default: 8192" in text
    assert "--until UNTIL simulate at least this long (s) --max-time" in text  # None: nothing
    assert "(default: inf)" not in text
    assert "--timeout TIMEOUT seconds per request (default: 600.0)" in _help(capsys, "bench")


def test_the_gateway_help_shows_no_redis_password(capsys, monkeypatch):
    monkeypatch.setenv("TANDEM_REDIS_URL", "redis://:hunter2@redis:6379/0")
    text = _help(capsys, "gateway")
    assert "hunter2" not in text
    assert "--redis-url REDIS_URL default: $TANDEM_REDIS_URL, else redis://" in text


def test_ctrl_c_while_the_command_line_is_read_is_no_traceback(monkeypatch, capsys):
    # In the first fraction of a second (the parser loads the commands' modules).
    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build_parser", interrupted)
    assert cli.main(["up"]) == 130
    assert "Traceback" not in capsys.readouterr().err


def test_every_command_says_what_it_does_in_its_own_help(capsys):
    # `tandem walkthrough --help` and `tandem demo --help` said only their usage line.
    commands = cli.build_parser()._subparsers._group_actions[0].choices
    for name, parser in commands.items():
        assert parser.description, f"tandem {name} --help has no description"
