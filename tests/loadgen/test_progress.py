"""The progress line: only on a terminal, never with --quiet, redrawn in place."""

import io

from tandem.loadgen.progress import Progress, progress_enabled, progress_line


class Tty(io.StringIO):
    def isatty(self):
        return True


def test_enabled_only_on_a_terminal_without_quiet():
    assert progress_enabled(Tty(), quiet=False)
    assert not progress_enabled(Tty(), quiet=True)
    assert not progress_enabled(io.StringIO(), quiet=False)


def test_the_line_shows_progress_and_counts():
    line = progress_line(10, 20, 9, 3, 5.0, None)
    assert line.startswith("[" + "#" * 10 + " " * 10 + "] 10/20")
    assert "ok 9  err 1  in flight 3  2.0 req/s  5.0s" in line
    # Duration runs fill the bar by time.
    assert progress_line(4, None, 4, 0, 15.0, 30.0).startswith("[" + "#" * 10 + " " * 10 + "]")


def test_redraws_in_place_and_ends_with_a_newline():
    stream = Tty()
    progress = Progress(stream, enabled=True, min_interval_s=0)
    progress.update("a long line")
    progress.update("short")
    progress.close()
    assert stream.getvalue() == "\ra long line\rshort      \n"


def test_disabled_writes_nothing():
    stream = Tty()
    progress = Progress(stream, enabled=False)
    progress.update("x", force=True)
    progress.close()
    assert stream.getvalue() == ""
