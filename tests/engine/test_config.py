"""EngineConfig: defaults, the derived budget, the prompt limit, and clear refusals."""

import pytest

from tandem.engine.config import EngineConfig, EngineType
from tandem.engine.request import SamplingParams


def test_defaults_follow_the_seed():
    cfg = EngineConfig()
    assert cfg.engine_type is EngineType.NORMAL
    assert cfg.max_num_seqs == 256
    assert cfg.enable_chunked_prefill is False
    assert cfg.num_speculative_tokens == 0
    assert (cfg.prefill_attempt_interval, cfg.prefill_any_attempt_interval) == (70, 100)
    assert cfg.cache_prefill_watermark == 0.90
    assert cfg.block_size == 16
    assert cfg.data_parallel_size == 1


@pytest.mark.parametrize(
    ("max_model_len", "max_num_seqs", "drafts", "budget"),
    [
        (2048, 256, 5, 4096),  # the seed's example: 256 x 6 = 1536 is the third term
        (8192, 256, 0, 8192),  # max_model_len wins
        (2048, 1024, 5, 6144),  # max_num_seqs x (1 + drafts) wins
        (1024, 8, 0, 4096),  # the 4096 floor
    ],
)
def test_default_budget_is_the_largest_of_three_terms(max_model_len, max_num_seqs, drafts, budget):
    cfg = EngineConfig(
        max_model_len=max_model_len, max_num_seqs=max_num_seqs, num_speculative_tokens=drafts
    )
    assert cfg.max_num_batched_tokens == budget


def test_budget_below_max_model_len_is_refused_without_chunking():
    with pytest.raises(
        ValueError, match=r"max_num_batched_tokens \(4096\) is smaller than max_model_len \(8192\)"
    ):
        EngineConfig(max_model_len=8192, max_num_batched_tokens=4096)


@pytest.mark.parametrize("chunked", [False, True])
def test_the_prompt_limit_leaves_the_context_room_for_one_token(chunked):
    budget = 2048 if chunked else 8192
    cfg = EngineConfig(
        max_model_len=4096, max_num_batched_tokens=budget, enable_chunked_prefill=chunked
    )
    assert cfg.prompt_limit == 4095


def test_engine_type_accepts_strings():
    assert EngineConfig(engine_type="prompt").engine_type is EngineType.PROMPT
    assert EngineConfig(engine_type="completion").engine_type is EngineType.COMPLETION


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("engine_type", "decode", "engine_type must be one of normal, prompt, completion"),
        ("max_model_len", 0, "max_model_len must be at least 1"),
        ("max_num_seqs", -1, "max_num_seqs must be at least 1"),
        ("max_num_seqs", 2.5, "max_num_seqs must be an integer"),
        ("block_size", True, "block_size must be an integer"),
        ("num_speculative_tokens", -1, "num_speculative_tokens must be at least 0"),
        ("prefill_attempt_interval", 0, "prefill_attempt_interval must be at least 1"),
        ("cache_prefill_watermark", 1.5, "cache_prefill_watermark .* must be in"),
        ("cache_prefill_watermark", 0, "cache_prefill_watermark .* must be in"),
        ("data_parallel_size", 0, "data_parallel_size must be at least 1"),
        ("vocab_size", 1, "vocab_size must be at least 2"),
    ],
)
def test_bad_values_are_refused_with_the_field_named(field, value, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**{field: value})


def test_a_budget_too_small_for_one_speculative_decode_is_refused():
    with pytest.raises(ValueError, match="cannot hold one decode step"):
        EngineConfig(
            max_model_len=4,
            max_num_batched_tokens=4,
            num_speculative_tokens=5,
            vocab_size=100,
        )


def test_draft_placeholder_is_the_last_vocab_id():
    assert EngineConfig(vocab_size=49152).draft_placeholder_id == 49151
    assert EngineConfig().draft_placeholder_id is None


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 0}, "max_tokens must be at least 1"),
        ({"max_tokens": "8"}, "max_tokens must be an integer"),
        ({"temperature": -0.1}, "temperature must be a number >= 0"),
        ({"temperature": float("nan")}, "temperature must be a number >= 0"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_k": -2}, "top_k must be a positive integer, or 0, -1 or None"),
        ({"top_k": 2.0}, "top_k must be a positive integer"),
        ({"seed": 1.5}, "seed must be an integer"),
        ({"stop_token_ids": [-1]}, "stop_token_ids must be token ids"),
        ({"stop": [""]}, "stop must be non-empty strings"),
        # Of the wrong kind: TypeErrors from tuple(), or taken as something else.
        ({"stop_token_ids": [True]}, "stop_token_ids must be token ids"),
        ({"stop_token_ids": 5}, "stop_token_ids must be token ids"),
        ({"stop_token_ids": 5}, "stop_token_ids must be token ids"),
        ({"stop": 5}, "stop must be non-empty strings"),
        ({"stop": 5}, "stop must be non-empty strings"),
        ({"ignore_eos": "no"}, "ignore_eos must be True or False"),
    ],
)
def test_sampling_params_refuse_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_top_k_0_and_minus_1_keep_every_token_as_in_vllm():
    assert SamplingParams(top_k=0).top_k is None
    assert SamplingParams(top_k=-1).top_k is None
    assert SamplingParams(top_k=1).top_k == 1


def test_vllms_none_and_minus_1_spellings_read_as_vllm_reads_them():
    # seed=-1 is vLLM's "no seed": read as a seed, every call sampled alike.
    assert SamplingParams(seed=-1).seed is None and SamplingParams(seed=7).seed == 7
    # None for the lists is none of them (vLLM's defaults; wrappers pass them on).
    none = SamplingParams(stop=None, stop_token_ids=None, logit_bias=None)
    assert (none.stop, none.stop_token_ids, none.logit_bias) == ((), (), ())
    # max_tokens=None is "until the context's end" (test_prompt_inputs.py runs it).
    assert SamplingParams(max_tokens=None).max_tokens is None
    with pytest.raises(ValueError, match=r"max_tokens must be an integer or None, got '8'"):
        SamplingParams(max_tokens="8")


def test_a_single_stop_string_becomes_a_tuple():
    assert SamplingParams(stop="###").stop == ("###",)
