"""Trace files: the JSONL format shared with `tandem sim`, and errors that name the line."""

import pytest

from tandem.trace import TraceError, TraceRequest, parse_trace, read_trace, write_trace


def test_lines_are_parsed_sorted_and_comments_skipped():
    lines = [
        "# a comment",
        '{"arrival_s": 1.5, "input_tokens": 10, "output_tokens": 2, "id": "x"}',
        "",
        '{"arrival_s": 0, "input_tokens": 7, "output_tokens": 3}',
    ]
    assert parse_trace(lines) == [TraceRequest(0.0, 7, 3), TraceRequest(1.5, 10, 2)]


def test_write_then_read_round_trips(tmp_path):
    requests = [TraceRequest(0.0, 5, 1), TraceRequest(0.25, 300, 40)]
    path = tmp_path / "t.jsonl"
    write_trace(path, requests)
    assert read_trace(path) == requests


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ("not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object, got list"),
        ('{"arrival_s": 0, "input_tokens": 3}', "missing output_tokens"),
        ('{"arrival_s": "0", "input_tokens": 3, "output_tokens": 1}', "arrival_s must be a number"),
        ('{"arrival_s": -1, "input_tokens": 3, "output_tokens": 1}', "finite and >= 0"),
        ('{"arrival_s": 0, "input_tokens": 0, "output_tokens": 1}', "input_tokens must be"),
        ('{"arrival_s": 0, "input_tokens": 2.5, "output_tokens": 1}', "input_tokens must be"),
        ('{"arrival_s": 0, "input_tokens": 2, "output_tokens": true}', "output_tokens must be"),
    ],
)
def test_a_bad_line_is_named_by_file_and_number(tmp_path, line, problem):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"arrival_s": 0, "input_tokens": 1, "output_tokens": 1}\n\n' + line + "\n")
    with pytest.raises(TraceError, match=f"{path} line 3: ") as info:
        read_trace(path)
    assert problem in str(info.value)


def test_an_empty_trace_and_a_missing_file_are_errors(tmp_path):
    with pytest.raises(TraceError, match="no requests"):
        parse_trace(["# only a comment"], "x.jsonl")
    with pytest.raises(TraceError, match="cannot read trace"):
        read_trace(tmp_path / "absent.jsonl")
    # A ValueError, so `tandem bench` reports it as a bad argument (exit 2).
    assert issubclass(TraceError, ValueError)


def test_a_trace_of_timestamps_is_refused_with_the_fix():
    # The bench slept until the first arrival (54 years) in silence; the simulator ran
    # its autoscaler through them for hours, its memory growing.
    lines = [
        '{"arrival_s": 1700000001.0, "input_tokens": 100, "output_tokens": 10}',
        '{"arrival_s": 1700000000.0, "input_tokens": 100, "output_tokens": 10}',
    ]
    with pytest.raises(TraceError, match="first request arrives 1,700,000,000 s"):
        parse_trace(lines, "epoch.jsonl")
    week = '{"arrival_s": 604800, "input_tokens": 1, "output_tokens": 1}'
    assert parse_trace([week])[0].arrival_s == 604800  # a quiet week is a trace's own


def test_bytes_that_are_not_utf8_are_named_by_line(tmp_path):
    path = tmp_path / "t.jsonl"
    good = b'{"arrival_s": 0, "input_tokens": 1, "output_tokens": 1}\n'
    path.write_bytes(good + b"\xff\xfe\n")
    with pytest.raises(TraceError, match=f"{path} line 2: not UTF-8 text \\(byte 0xff\\)"):
        read_trace(path)
    # A byte-order mark (Windows editors) is not a bad byte.
    path.write_bytes(b"\xef\xbb\xbf" + good)
    assert read_trace(path) == [TraceRequest(0.0, 1, 1)]


def test_writing_makes_the_missing_folders(tmp_path):
    path = tmp_path / "new" / "deeper" / "t.jsonl"
    write_trace(path, [TraceRequest(0.0, 5, 1)])
    assert read_trace(path) == [TraceRequest(0.0, 5, 1)]
