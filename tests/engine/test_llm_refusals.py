"""The offline API's refusals of arguments of the wrong kind: a ValueError that names
the argument, not an AttributeError or a torch error from inside the engine."""

from __future__ import annotations

import pytest
import torch

from tandem.engine import LLM, SamplingParams
from tandem.engine.model.loader import load_model


@pytest.fixture(scope="module")
def llm():
    return LLM("random:tiny", dtype="float32", num_kv_blocks=16)


@pytest.mark.parametrize(
    "params",
    [{"max_tokens": 3}, [{"max_tokens": 3}], "greedy", 3],
    ids=["dict", "list of dicts", "str", "int"],
)
def test_sampling_params_of_another_type_are_named(llm, params):
    with pytest.raises(ValueError, match="sampling_params must be a SamplingParams or a list"):
        llm.generate(prompt_token_ids=[[1, 2]], sampling_params=params)


@pytest.mark.parametrize("blocks", [0, -1, 1.5, "8", True])
def test_num_kv_blocks_must_be_a_positive_integer(blocks):
    loaded = load_model("random:tiny", dtype="float32")
    with pytest.raises(
        ValueError, match=f"num_kv_blocks must be a positive integer, got {blocks!r}"
    ):
        LLM(loaded, num_kv_blocks=blocks)


@pytest.mark.parametrize("dtype", [torch.float64, torch.int8])
def test_a_torch_dtype_no_kernel_runs_is_refused_at_load(dtype):
    with pytest.raises(ValueError, match=f"unsupported dtype {dtype}: use one of float32"):
        LLM("random:tiny", dtype=dtype, num_kv_blocks=8)


def test_chat_names_the_conversation_and_refuses_a_lone_message(llm):
    good = [{"role": "user", "content": "Hi"}]
    with pytest.raises(ValueError, match="conversation 1: message 0 \\(user\\) has no 'content'"):
        llm.chat([good, [{"role": "user"}]], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="messages must be a list of messages"):
        llm.chat(good[0], SamplingParams(max_tokens=1))


def test_a_seed_or_mtp_head_of_the_wrong_kind_is_named():
    with pytest.raises(ValueError, match="seed must be an integer or None, got 'x'"):
        LLM("random:tiny", num_kv_blocks=8, seed="x")
    with pytest.raises(ValueError, match="mtp_head must have a propose method"):
        LLM("random:tiny", num_kv_blocks=8, mtp_head=object())


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"prompt_token_ids": [1, 2, 3]}, r"give \[\[1, 2, 3\]\] for one prompt"),
        ({"prompts": 123}, "prompts must be a string, a prompt dict or a list of them, got 123"),
        ({"prompts": b"abc"}, "prompts must be a string, a prompt dict or a list of them"),
        ({"prompts": ["ok", 5]}, "prompt 1: a prompt is a string or a prompt dict, got 5"),
        ({"prompts": ["ok", ""]}, "prompt 1: the prompt is empty"),
    ],
    ids=["flat ids", "an int", "bytes", "a non-string", "an empty one"],
)
def test_prompts_of_another_shape_are_named(llm, args, message):
    # A flat list of ids (a common slip) was a TypeError from inside the loop.
    with pytest.raises(ValueError, match=message):
        llm.generate(**args, sampling_params=SamplingParams(max_tokens=1))
    assert not llm.engine.has_unfinished_requests()


def test_generate_refuses_to_run_over_requests_added_through_the_engine(llm):
    # It stepped the engine until empty: their outputs went to it, and a KeyError.
    params = SamplingParams(max_tokens=2)
    llm.engine.add_request("mine", None, params, prompt_token_ids=[1, 2])
    try:
        with pytest.raises(ValueError, match="the engine holds requests added through"):
            llm.generate(prompt_token_ids=[[3, 4]], sampling_params=params)
    finally:
        llm.engine.abort("mine")
    assert llm.generate(prompt_token_ids=[[3, 4]], sampling_params=params)[0].token_ids


def test_stop_strings_without_a_tokenizer_are_refused():
    # Without text to find them in they were silently ignored: length, not stop.
    llm = LLM("random:tiny", dtype="float32", num_kv_blocks=16)
    llm.engine.tokenizer = None  # as a checkpoint without tokenizer.json loads
    with pytest.raises(ValueError, match="no tokenizer, so no stop strings") as refused:
        llm.generate(prompt_token_ids=[[1, 2]], sampling_params=SamplingParams(stop=["ix"]))
    assert refused.value.param == "stop"


@pytest.mark.parametrize("role", ["prompt", "completion"])
def test_an_engine_type_other_than_normal_is_refused_before_the_load(role):
    # A prompt engine was accepted: each call raised KeyError, kept its KV pinned for a
    # decoder that never comes, and the ninth spun for good.
    with pytest.raises(ValueError, match="engine_type must be 'normal' here"):
        LLM("no-such-model", engine_type=role)


def test_data_parallel_ranks_are_refused_before_the_load():
    # Accepted, it was refused only once the model had loaded (minutes), in the
    # scheduler's terms: "the scheduler needs a vote (an all-reduce MIN ...)".
    with pytest.raises(ValueError, match="data_parallel_size must be 1 here"):
        LLM("no-such-model", data_parallel_size=2)


@pytest.mark.parametrize("memory", ["1GiB", 0, 1.5, True])
def test_kv_cache_memory_must_be_a_positive_number_of_bytes(memory):
    with pytest.raises(ValueError, match="kv_cache_memory must be a positive number of bytes"):
        LLM("random:tiny", kv_cache_memory=memory)


@pytest.mark.parametrize("device", ["xpu", "mps", "meta", "tpu"])
def test_a_device_with_no_kernels_here_is_refused(device):
    with pytest.raises(ValueError, match=f"unknown device '{device}': use 'cpu', 'cuda'"):
        LLM("random:tiny", device=device, num_kv_blocks=8)


def test_a_gpu_past_the_hosts_is_refused_by_name(monkeypatch):
    # A data-parallel group's rank r takes cuda:r: four ranks on a two-GPU host failed
    # in torch with "invalid device ordinal", no flag named. (Checked with a host that
    # says it has two GPUs: this one has none.)
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match=r"'cuda:3' .* has 2 CUDA device\(s\) .* --data-parallel"):
        LLM("random:tiny", device="cuda:3", num_kv_blocks=8)


def test_a_conversation_that_is_no_list_is_named(llm):
    good = [{"role": "user", "content": "Hi"}]
    with pytest.raises(ValueError, match="conversation 1: a conversation is a list of messages"):
        llm.chat([good, None], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="a conversation is a list of messages, got None"):
        llm.chat([None], SamplingParams(max_tokens=1))


@pytest.mark.parametrize(
    ("messages", "named"),
    [(None, "got None"), (5, "got 5"), ("hello", "got 'hello'"), ({"role": "user"}, "one dict")],
)
def test_messages_of_another_kind_are_named(llm, messages, named):
    # A string was read letter by letter ("conversation 0 ... got 'h'"); None and 5
    # were bare TypeErrors from inside.
    with pytest.raises(ValueError, match=f"messages must be a list of messages.*{named}"):
        llm.chat(messages, SamplingParams(max_tokens=1))


@pytest.mark.parametrize("second", [3, None, "ab"])
def test_each_prompts_token_ids_must_be_a_list(llm, second):
    with pytest.raises(ValueError, match="prompt 1: a prompt's token ids are a list"):
        llm.generate(prompt_token_ids=[[1, 2], second], sampling_params=SamplingParams())


def test_max_model_len_none_means_the_models_and_a_number_is_taken(llm):
    other = LLM(llm.loaded, num_kv_blocks=16, max_model_len=None)
    assert other.engine.config.max_model_len == llm.engine.config.max_model_len
    assert LLM(llm.loaded, num_kv_blocks=16, max_model_len=128).engine.config.max_model_len == 128


@pytest.mark.parametrize(
    ("setting", "value"),
    [
        ("enable_prefix_caching", "false"),  # read as on
        ("enable_chunked_prefill", 0),
        ("decode_graphs", "yes"),
    ],
)
def test_an_on_off_setting_of_another_kind_is_named(llm, setting, value):
    with pytest.raises(ValueError, match=f"{setting} must be True"):
        LLM(llm.loaded, num_kv_blocks=16, **{setting: value})


def test_prefix_caching_none_means_the_default_not_off(llm):
    # vLLM's spelling of its default: it turned prefix caching off without a word.
    other = LLM(llm.loaded, num_kv_blocks=16, enable_prefix_caching=None)
    assert other.engine.config.enable_prefix_caching is True


def test_a_dtype_or_device_beside_a_loaded_model_must_be_its_own(llm):
    # Ignored, a bfloat16 asked for ran in float32 without a word.
    assert llm.loaded.dtype == torch.float32
    with pytest.raises(ValueError, match=r"loaded in torch\.float32; leave dtype out"):
        LLM(llm.loaded, num_kv_blocks=16, dtype="bfloat16")
    LLM(llm.loaded, num_kv_blocks=16, dtype="float32", device="cpu")  # its own: taken
    with pytest.raises(ValueError, match=r"no CUDA device|loaded on cpu"):
        LLM(llm.loaded, num_kv_blocks=16, device="cuda")


def test_vllms_names_for_settings_spelled_otherwise_here_are_said_with_the_refusal():
    with pytest.raises(ValueError, match=r"enforce_eager \(decode_graphs=False"):
        LLM("random:tiny", num_kv_blocks=64, enforce_eager=True)
    with pytest.raises(ValueError, match=r"gpu_memory_utilization \(kv_cache_memory"):
        LLM("random:tiny", num_kv_blocks=64, gpu_memory_utilization=0.9)
    # None is the default, as vLLM reads it.
    llm = LLM("random:tiny", num_kv_blocks=64, max_model_len=256, enable_chunked_prefill=None)
    assert llm.engine.scheduler.config.enable_chunked_prefill is False


def test_vllms_auto_dtype_is_the_default_and_bare_token_ids_as_prompts_are_pointed_at(llm):
    assert LLM("random:tiny", dtype="auto", num_kv_blocks=64).loaded.dtype == torch.float32
    with pytest.raises(ValueError, match=r"prompt 0: .*prompt_token_ids=\[\[...\]\]"):
        llm.generate([[1, 2, 3]])
