"""The GGUF container reader against the gguf package's own writer and reader: every
metadata type and tensor type reads back alike, and a damaged file is named, not
half-read."""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
import pytest

from tandem.engine.model.gguf_container import GGUFContainer

Q = gguf.GGMLQuantizationType
_GGUF_READERS_OWN = ("GGUF.version", "GGUF.tensor_count", "GGUF.kv_count")


def write_every_kind(path: Path, *, alignment: int | None = None) -> dict[str, np.ndarray]:
    """A GGUF with a value of every metadata type and tensors of plain and block types;
    returns the tensors written (block types as their quantised bytes)."""
    writer = gguf.GGUFWriter(path, "llama")
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -100)
    writer.add_uint16("t.u16", 60_000)
    writer.add_int16("t.i16", -30_000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 1e-5)
    writer.add_uint64("t.u64", 2**63 + 5)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float64("t.f64", 0.1)
    writer.add_bool("t.yes", True)
    writer.add_bool("t.no", False)
    writer.add_string("t.text", "héllo <|im_start|> 世界 🙂")
    writer.add_array("t.ints", [3, -1, 7])
    writer.add_array("t.floats", [0.5, -2.25])
    writer.add_array("t.strings", ["a", "Ġthe", "", "\n"])
    rng = np.random.default_rng(0)
    tensors = {
        "f32": rng.standard_normal((3, 64)).astype(np.float32),
        "f16": rng.standard_normal((2, 32)).astype(np.float16),
        "i32": np.arange(5, dtype=np.int32),
    }
    for name, array in tensors.items():
        writer.add_tensor(name, array)
    for kind in (Q.Q8_0, Q.Q4_1, Q.BF16):
        raw = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), kind)
        writer.add_tensor(kind.name, raw, raw_dtype=kind)
        tensors[kind.name] = raw
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tensors


@pytest.mark.parametrize("alignment", [None, 64])
def test_metadata_and_tensors_read_as_the_gguf_package_reads_them(
    tmp_path: Path, alignment: int | None
) -> None:
    path = tmp_path / "every.gguf"
    written = write_every_kind(path, alignment=alignment)
    ours, theirs = GGUFContainer.read(path), gguf.GGUFReader(path)

    expected = {k: f.contents() for k, f in theirs.fields.items() if k not in _GGUF_READERS_OWN}
    assert ours.fields == expected
    assert ours.fields["t.text"] == "héllo <|im_start|> 世界 🙂"
    assert ours.fields["t.strings"] == ["a", "Ġthe", "", "\n"]
    assert ours.fields["t.u64"] == 2**63 + 5 and ours.fields["t.yes"] is True
    assert ours.version == 3

    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, ref in zip(ours.tensors, theirs.tensors, strict=True):
        assert mine.tensor_type == ref.tensor_type, mine.name
        assert mine.shape == tuple(int(d) for d in ref.shape), mine.name
        assert mine.n_bytes == ref.n_bytes, mine.name
        assert mine.data.dtype == ref.data.dtype and mine.data.shape == ref.data.shape
        np.testing.assert_array_equal(mine.data, ref.data)
        np.testing.assert_array_equal(mine.data, written[mine.name])
    # Block types dequantise from our view as from theirs.
    q4 = next(t for t in ours.tensors if t.name == "Q4_1")
    assert gguf.quants.dequantize(q4.data, q4.tensor_type).shape == (4, 64)


def _damaged(tmp_path: Path, edit) -> Path:
    good = tmp_path / "good.gguf"
    write_every_kind(good)
    raw = bytearray(good.read_bytes())
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(edit(raw)))
    return bad


def _tensor_info_at(raw: bytearray, name: str) -> int:
    """Where tensor `name`'s info (its u64 name length) starts in the header."""
    return raw.index(struct.pack("<Q", len(name)) + name.encode())


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda raw: raw[:300], "the file ends inside its header"),
        (lambda raw: raw[:24] + b"\xff" * 8, "the file ends inside its header"),
        (lambda raw: b"GGML" + raw[4:], "no GGUF magic"),
        (lambda raw: raw[:4] + struct.pack("<I", 4) + raw[8:], "GGUF version 4 is not supported"),
        (lambda raw: raw[:4] + struct.pack(">I", 3) + raw[8:], r"big-endian"),
        (lambda raw: raw[: raw.index(b"t.ints") + 6] + struct.pack("<I", 99), "unknown metadata"),
        (lambda raw: raw[: len(raw) - 100], "tensor 'BF16' ends past the end of the file"),
        (
            lambda raw: raw.replace(
                struct.pack("<Q", 4) + b"Q8_0" + struct.pack("<IQQ", 2, 64, 4),
                struct.pack("<Q", 4) + b"Q8_0" + struct.pack("<I", 0),
            ),
            "tensor 'Q8_0' has no dimensions",
        ),
        (
            lambda raw: raw.replace(struct.pack("<Q", 3) + b"f16", struct.pack("<Q", 3) + b"f32"),
            "tensor 'f32' appears twice",
        ),
    ],
    ids=[
        "cut",
        "huge-count",
        "magic",
        "version",
        "big-endian",
        "type",
        "tensor-cut",
        "no-dims",
        "twice",
    ],
)
def test_a_damaged_file_is_named(tmp_path: Path, edit, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        GGUFContainer.read(_damaged(tmp_path, edit))


def test_a_non_utf8_string_and_a_bad_alignment_are_named(tmp_path: Path) -> None:
    def latin1(raw: bytearray) -> bytearray:
        at = raw.index("héllo".encode())
        raw[at + 1 : at + 3] = b"\xe9!"  # é as Latin-1: an invalid UTF-8 sequence
        return raw

    with pytest.raises(ValueError, match="is not UTF-8"):
        GGUFContainer.read(_damaged(tmp_path, latin1))

    odd = tmp_path / "odd.gguf"
    write_every_kind(odd, alignment=64)
    raw = bytearray(odd.read_bytes())
    at = raw.index(b"general.alignment") + len(b"general.alignment") + 4  # past the type
    raw[at : at + 4] = struct.pack("<I", 48)
    odd.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=r"general\.alignment 48 is not a power of two"):
        GGUFContainer.read(odd)
