"""A GGUF's SentencePiece vocabulary (Llama 2's, Mistral's kind) against transformers'.

The file is written as llama.cpp writes such a vocabulary: special pieces, 256 byte
pieces, then the learned pieces with falling scores, and no merges. transformers'
GGUF loader is the reference: the same file must encode to the same ids.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
import tokenizers
import transformers

from tandem.engine.detokenizer import IncrementalDetokenizer
from tandem.engine.literal_chat import LiteralChat
from tandem.engine.model.gguf_container import GGUFContainer
from tandem.engine.model.gguf_tokenizer import gguf_tokenizer
from tandem.engine.tokenizer import Tokenizer

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world, hello there! What is the capital of France?",
    "A tokenizer splits text into pieces; numbers like 1234 too.",
]
TEXTS = [
    "The quick brown fox",
    " leading space, and  two spaces",
    "Hello world!\nnew line\ttab",
    "émoji 🎉 and 日本語, spelled in bytes",  # no piece spells these: byte fallback
    "",
    "a",
    "What is the capital of France?",
]
UNKNOWN, CONTROL, NORMAL, BYTE = 2, 3, 1, 6  # llama.cpp token types


def write_sentencepiece_gguf(path: Path, *, typed: bool = True, **extra) -> Path:
    """A GGUF holding only a SentencePiece vocabulary learned from CORPUS; `typed`:
    with llama.cpp's token types; `extra`: more metadata by its writer's name."""
    learner = tokenizers.SentencePieceBPETokenizer()
    learner.train_from_iterator(CORPUS * 20, vocab_size=220, show_progress=False)
    learned = learner.get_vocab()
    pieces = [p for p in sorted(learned, key=learned.get) if p != "<unk>"]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    types = [UNKNOWN, CONTROL, CONTROL, *[BYTE] * 256, *[NORMAL] * len(pieces)]
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    if typed:
        writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    for key, value in extra.items():
        getattr(writer, f"add_{key}")(value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def read(path: Path) -> Tokenizer:
    tokenizer = gguf_tokenizer(GGUFContainer.read(path), path)
    assert tokenizer is not None
    return tokenizer


@pytest.fixture(scope="module")
def vocabulary(tmp_path_factory) -> Path:
    return write_sentencepiece_gguf(tmp_path_factory.mktemp("spm") / "spm.gguf")


def test_a_sentencepiece_vocabulary_encodes_as_transformers_reads_it(vocabulary):
    ours = read(vocabulary)
    theirs = transformers.AutoTokenizer.from_pretrained(vocabulary.parent, gguf_file="spm.gguf")
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == theirs(text)["input_ids"], text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True) == text.lstrip()
    # SentencePiece's BOS, as llama.cpp prepends it by default; the end of sequence.
    assert (ours.bos_token_id, ours.eos_token_ids, ours.add_bos_token) == (1, (2,), True)
    # Its control pieces are special: in text they are the tokens (BOS said once).
    assert ours.encode("<s>hi</s>")[-1] == 2
    assert ours.decode(ours.encode("<s>hi</s>")) == "hi"


def test_the_files_own_add_bos_token_is_kept(tmp_path):
    path = write_sentencepiece_gguf(tmp_path / "nobos.gguf", add_bos_token=False)
    assert read(path).encode("hi")[0] != 1


def test_a_sentencepiece_vocabulary_without_scores_is_named(tmp_path):
    writer = gguf.GGUFWriter(tmp_path / "bare.gguf", "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(["<unk>", "a"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"bare\.gguf: a SentencePiece tokenizer without"):
        read(tmp_path / "bare.gguf")


LLAMA2_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}<s>[INST] {{ m['content'] }} [/INST]"
    "{% else %} {{ m['content'] }} </s>{% endif %}{% endfor %}"
)


def test_text_between_control_tokens_encodes_as_in_the_whole_prompt(vocabulary):
    # A message quoting a control token is encoded piece by piece (literal_chat.py): each
    # piece as the whole prompt would have it. SentencePiece's space goes before the
    # prompt's first piece only; alone, every piece was a first ("<s>" then "▁[INST]").
    spm = read(vocabulary)
    chat = Tokenizer(spm.backend, bos_token_id=1, eos_token_ids=(2,), chat_template=LLAMA2_TEMPLATE)
    turns = [
        {"role": "user", "content": "Hello world"},
        {"role": "assistant", "content": "hello there"},
        {"role": "user", "content": "The quick brown fox"},
    ]
    whole = chat.encode(chat.apply_chat_template(turns), add_special_tokens=False)
    literal = LiteralChat(spm.backend).encode(turns, chat.apply_chat_template)
    assert literal == whole
    quoting = [*turns[:2], {"role": "user", "content": "what is <s> for"}]
    ids = chat.encode_chat(quoting)
    assert ids[: whole.index(1, 1)] == whole[: whole.index(1, 1)]  # the first turn as it was
    assert ids.count(1) == 2  # the template's own <s> only


def test_a_sentencepiece_tokens_text_keeps_its_space(vocabulary):
    # Logprobs name each token by its own text and bytes: a run of them must join into
    # the text (decoded alone, "▁quick" lost its space to the decoder's start strip).
    spm = read(vocabulary)
    ids = spm.encode("The quick brown fox", add_special_tokens=False)
    assert "".join(spm.token_text(i) for i in ids) == " The quick brown fox"
    assert b"".join(spm.token_bytes(i) for i in ids) == b" The quick brown fox"
    # A space spelled as its byte piece, which the decoder's start strip also took.
    space = spm.token_to_id("<0x20>")
    assert (spm.token_text(space), spm.token_bytes(space)) == (" ", b" ")


@pytest.mark.parametrize(
    ("prompt", "completion"),
    [("The capital of 日本", "語 is Tokyo"), ("Party time 🎉🎉", "🎉 fun"), ("Hello 🎉", "🎉 fun")],
)
def test_text_streamed_after_a_prompt_ending_in_byte_tokens_is_the_decode(
    vocabulary, prompt, completion
):
    # The prompt's last five tokens start inside a character's byte tokens: the
    # window's run of bytes was not UTF-8, and the generated characters joining it
    # streamed as U+FFFD.
    tokenizer = read(vocabulary)
    ids, prompt_ids = tokenizer.encode(prompt + completion), tokenizer.encode(prompt)
    assert ids[: len(prompt_ids)] == prompt_ids
    generated = ids[len(prompt_ids) :]
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids)
    streamed = "".join(detokenizer.add([t])[0] for t in generated) + detokenizer.flush()
    assert streamed == tokenizer.decode(generated) == completion


@pytest.mark.parametrize(
    "raw",
    [b"\xe2" + "🎉".encode(), b"\x80" + "é".encode(), "🎉".encode() + b"\xe2"],
    ids=["stray-lead-then-emoji", "stray-continuation", "emoji-then-stray-lead"],
)
def test_byte_tokens_that_are_no_utf8_read_as_python_reads_them(vocabulary, raw):
    # The byte-fallback decoder wrote U+FFFD for every byte of a run that was not UTF-8
    # as a whole: the characters in it lost, four U+FFFD for one bad byte.
    tokenizer = read(vocabulary)
    prompt = tokenizer.encode("The quick brown fox", add_special_tokens=False)
    generated = [tokenizer.token_to_id(f"<0x{b:02X}>") for b in raw]
    generated += tokenizer.encode(" and", add_special_tokens=False)
    expected = raw.decode("utf-8", "replace") + " and"
    assert tokenizer.decode(generated) == expected
    detokenizer = IncrementalDetokenizer(tokenizer, prompt)
    streamed = "".join(detokenizer.add([t])[0] for t in generated) + detokenizer.flush()
    assert streamed == expected


def test_text_generated_after_a_prompt_cut_inside_a_character_is_its_own_bytes(vocabulary):
    # A prompt of ids ending inside a character (an answer cut by its length, sent back
    # to go on): the generated bytes that finish it are read alone, as Python reads them.
    # (The prompt's bytes and the generated ones were read together, garbled: valid
    # characters after them lost.)
    tokenizer = read(vocabulary)
    ids = tokenizer.encode("Party 🎉🎉🎉 time", add_special_tokens=False)
    cuts = [k for k in range(1, len(ids)) if tokenizer.decode(ids[:k]).endswith("\ufffd")]
    assert cuts  # the emoji are byte tokens here
    for k in cuts:
        generated = ids[k:]
        detokenizer = IncrementalDetokenizer(tokenizer, ids[:k])
        streamed = "".join(detokenizer.add([t])[0] for t in generated) + detokenizer.flush()
        raw = b"".join(tokenizer.token_bytes(t) for t in generated)
        assert streamed == raw.decode("utf-8", "replace") == tokenizer.decode(generated)


def learned_merges() -> list[str]:
    learner = tokenizers.SentencePieceBPETokenizer()
    learner.train_from_iterator(CORPUS * 20, vocab_size=220, show_progress=False)
    return [" ".join(pair) for pair in json.loads(learner.to_str())["model"]["merges"][:40]]


@pytest.mark.parametrize(
    "extra",
    [
        {"token_merges": learned_merges()},  # the file's own merges, as transformers reads them
        {"typed": False},  # no token types: BOS, EOS and unknown are special all the same
    ],
    ids=["merges", "untyped"],
)
def test_what_a_file_says_besides_its_pieces_is_read_as_transformers_reads_it(tmp_path, extra):
    path = write_sentencepiece_gguf(tmp_path / "spm.gguf", **extra)
    ours = read(path)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="spm.gguf")
    for text in [*TEXTS, "<s> hello world</s>"]:
        ids = theirs(text)["input_ids"]
        assert ours.encode(text) == (ids[1:] if ids[:2] == [1, 1] else ids), text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text
