"""The fewest tokens a text can encode to, read from its length alone: a prompt far
over the limit is refused without encoding it (encoding a megabyte stalls every
request of the engine for a second or more), and the bound is never above the truth."""

from __future__ import annotations

import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import models, normalizers, pre_tokenizers

from tandem.engine import LLM
from tandem.engine.admission import PromptTooLongError
from tandem.engine.model.random_model import byte_level_tokenizer
from tandem.engine.token_bound import longest_token_chars
from tandem.engine.tokenizer import Tokenizer

from .test_gguf_tokenizer import read, write_sentencepiece_gguf

TEXTS = st.text(
    st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=4096, max_size=6000
) | st.text(" \n\tab日本🎉", min_size=4096, max_size=6000)


@pytest.fixture(scope="module")
def byte_level() -> Tokenizer:
    return byte_level_tokenizer(512)


@pytest.fixture(scope="module")
def sentencepiece(tmp_path_factory) -> Tokenizer:
    return read(write_sentencepiece_gguf(tmp_path_factory.mktemp("spm") / "spm.gguf"))


@settings(max_examples=25, deadline=None)
@given(text=TEXTS)
def test_the_bound_is_never_above_the_tokens_byte_level(byte_level, text):
    assert 0 < byte_level.fewest_tokens(text) <= len(byte_level.encode(text))


@settings(max_examples=25, deadline=None)
@given(text=TEXTS)
def test_the_bound_is_never_above_the_tokens_sentencepiece(sentencepiece, text):
    assert 0 < sentencepiece.fewest_tokens(text) <= len(sentencepiece.encode(text))


def _backend(**parts) -> tokenizers.Tokenizer:
    backend = tokenizers.Tokenizer(models.BPE(vocab={"a": 0, "[UNK]": 1}, merges=[], **parts))
    return backend


@pytest.mark.parametrize(
    "setup",
    [
        # Parts that make a text shorter before its model sees it: no bound.
        lambda b: setattr(b, "normalizer", normalizers.NFC()),  # "e" + U+0301 -> "é"
        lambda b: setattr(b, "normalizer", normalizers.Strip()),
        lambda b: setattr(b, "normalizer", normalizers.Replace("  ", " ")),
        lambda b: setattr(b, "pre_tokenizer", pre_tokenizers.WhitespaceSplit()),
        lambda b: setattr(b, "pre_tokenizer", pre_tokenizers.Split(" ", behavior="removed")),
    ],
    ids=["nfc", "strip", "replace-shorter", "whitespace-split", "split-removed"],
)
def test_a_pipeline_that_may_shrink_a_text_gives_no_bound(setup):
    backend = _backend()
    setup(backend)
    assert longest_token_chars(backend) is None
    assert Tokenizer(backend).fewest_tokens("a" * 10_000) == 0


def test_unknown_characters_fused_into_one_token_give_no_bound():
    fused = tokenizers.Tokenizer(
        models.BPE(vocab={"a": 0, "[UNK]": 1}, merges=[], unk_token="[UNK]", fuse_unk=True)
    )
    assert len(fused.encode("é" * 10_000).ids) == 1  # why
    assert longest_token_chars(fused) is None


def test_an_added_tokens_text_counts_among_the_pieces(byte_level):
    # "<|im_end|>" is one token of ten characters: a text of them is a tenth as many.
    special = "<|im_end|>"
    assert byte_level.token_to_id(special) is not None
    assert byte_level.fewest_tokens(special * 1000) <= len(byte_level.encode(special * 1000))


def test_a_prompt_its_length_shows_too_long_is_refused_unencoded():
    llm = LLM("random:tiny", dtype="float32", num_kv_blocks=32, max_model_len=512)
    longest = longest_token_chars(llm.tokenizer.backend)
    text = "a" * max(4096, 512 * longest)
    fewest = -(-len(text) // longest)
    with pytest.raises(PromptTooLongError, match=f"the prompt has at least {fewest} tokens"):
        llm.generate(text)
    with pytest.raises(PromptTooLongError, match=r"has at least \d+ tokens"):  # the template's
        llm.chat([{"role": "user", "content": text}])
    # Under the bound, the tokens are counted: the usual refusal.
    with pytest.raises(PromptTooLongError, match=r"the prompt has \d+ tokens"):
        llm.generate("a b " * 1024)  # at least 4096 / longest tokens, in fact ~2048


def test_a_chat_is_bounded_by_what_its_template_renders_not_by_its_messages(byte_level):
    # Qwen3's template keeps only what follows an earlier assistant turn's </think>: the
    # messages' own length refused a conversation that encodes to a few dozen tokens.
    template = (
        "{%- for m in messages %}{%- set c = m.content %}"
        "{%- if m.role == 'assistant' and '</think>' in c %}"
        "{%- set c = c.split('</think>')[-1] %}{%- endif %}"
        "<|im_start|>{{ m.role }}\n{{ c }}<|im_end|>\n{%- endfor %}"
        "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
    )
    tokenizer = Tokenizer(byte_level.backend, chat_template=template)
    thought = "<think>" + "let me think about this. " * 5000 + "</think>4"
    messages = [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": thought},
        {"role": "user", "content": "And 3+3?"},
    ]
    ids = tokenizer.encode_chat(messages, max_model_len=4096)
    assert ids == tokenizer.encode_chat(messages) and len(ids) < 100
    with pytest.raises(PromptTooLongError, match="at least"):  # what it renders counts
        tokenizer.encode_chat([{"role": "user", "content": thought}], max_model_len=4096)


def test_a_long_text_encodes_as_ever_and_twice_alike(byte_level):
    text = "The capital of France is Paris. " * 300
    ids = byte_level.encode(text)
    assert ids == byte_level.backend.encode(text).ids
    ids.append(-1)  # a caller's edit of its list is not remembered
    assert byte_level.encode(text) == byte_level.backend.encode(text).ids
