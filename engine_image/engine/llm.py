"""The offline API: generate text in-process, no server.

from tandem.engine import LLM, SamplingParams
llm = LLM("smollm2")
out = llm.chat([{"role": "user", "content": "What is the capital of France?"}])
print(out[0].text)
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tandem.engine.chat_template import template_options
from tandem.engine.config import EngineConfig, EngineType, check_fields, max_model_len_for
from tandem.engine.decode_graphs import DecodeGraphs
from tandem.engine.drafter import NgramDrafter
from tandem.engine.engine import Engine
from tandem.engine.engine_output import FinishReason
from tandem.engine.host_memory import keep_freed_memory
from tandem.engine.model.attention import allocate_kv_cache
from tandem.engine.model.loader import (
    LoadedModel,
    kv_blocks_for,
    kv_pool_check,
    load_model,
    pick_device,
    pick_dtype,
)
from tandem.engine.mtp import MtpHead
from tandem.engine.plan import TokenLogprobs
from tandem.engine.prompt_inputs import PromptInput, PromptType, read_prompts
from tandem.engine.request import SamplingParams
from tandem.engine.runner import ModelRunner
from tandem.engine.sampler import Sampler


@dataclass
class CompletionOutput:
    request_id: str
    # The prompt as given (None when token ids were given).
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    # "stop" or "length".
    finish_reason: str
    # Prompt tokens whose prefill the prefix cache saved.
    num_cached_tokens: int
    # Where SamplingParams.logprobs asked for them: one entry per token of token_ids.
    logprobs: list[TokenLogprobs] | None = None


class LLM:
    """A model and an engine in this process.

    model is a spec for resolve_model (a Hugging Face directory, a .gguf
    file, "smollm2", "random:<size>") or a LoadedModel to share its weights.

    engine_config_fields are EngineConfig fields (max_model_len,
    num_speculative_tokens, enable_chunked_prefill, ...). The KV pool is
    num_kv_blocks blocks, or as many as kv_cache_memory bytes hold (default
    1 GiB on the CPU, 90 % of free memory on a GPU).

    With num_speculative_tokens > 0 the n-gram drafter proposes the drafts,
    or mtp_head does where one is given (an MtpHead: mtp.py).

    decode_graphs: decode steps (with or without drafts) padded to fixed shapes
    and replayed from CUDA graphs (decode_graphs.py); None: on CUDA devices. True
    on the CPU runs the same padded steps without recording (what tests check
    there).
    """

    def __init__(
        self,
        model: str | LoadedModel = "smollm2",
        *,
        dtype: str | torch.dtype | None = None,
        device: str | torch.device | None = None,
        num_kv_blocks: int | None = None,
        kv_cache_memory: int | None = None,
        seed: int | None = 0,
        mtp_head: MtpHead | None = None,
        decode_graphs: bool | None = None,
        **engine_config_fields: Any,
    ) -> None:
        unknown = set(engine_config_fields) - set(EngineConfig.field_names())
        if unknown:
            hint = _VLLM_HINTS.get(min(unknown), "")
            raise ValueError(f"unknown engine settings: {', '.join(sorted(unknown))}{hint}")
        if "vocab_size" in engine_config_fields:
            raise ValueError("vocab_size comes from the model; do not set it")
        for name in ("max_model_len", "enable_prefix_caching", "enable_chunked_prefill"):
            if name in engine_config_fields and engine_config_fields[name] is None:
                del engine_config_fields[name]  # vLLM's spelling of "the default"
        check_fields(engine_config_fields)  # before a load of minutes
        if EngineType(engine_config_fields.get("engine_type", "normal")) is not EngineType.NORMAL:
            # A prompt engine pins each request's KV for a decoder that never comes.
            raise ValueError(
                "engine_type must be 'normal' here: the offline API runs prompts to the "
                "end on one engine (prompt and completion engines are the service's roles)"
            )
        if engine_config_fields.get("data_parallel_size", 1) != 1:
            # Refused by the scheduler only after the load, in its own terms (the vote).
            raise ValueError(
                "data_parallel_size must be 1 here: the offline API runs one engine in this "
                "process (data-parallel ranks are the service's: tandem engine "
                "--data-parallel-size)"
            )
        if decode_graphs is not None and not isinstance(decode_graphs, bool):
            raise ValueError(f"decode_graphs must be True, False or None, got {decode_graphs!r}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(f"seed must be an integer or None, got {seed!r}")
        if mtp_head is not None and not callable(getattr(mtp_head, "propose", None)):
            raise ValueError(f"mtp_head must have a propose method (MtpHead), got {mtp_head!r}")
        block_size = engine_config_fields.get("block_size", 16)
        if num_kv_blocks is not None and (
            isinstance(num_kv_blocks, bool)
            or not isinstance(num_kv_blocks, int)
            or num_kv_blocks < 1
        ):
            raise ValueError(f"num_kv_blocks must be a positive integer, got {num_kv_blocks!r}")
        if kv_cache_memory is not None and (
            isinstance(kv_cache_memory, bool)
            or not isinstance(kv_cache_memory, int)
            or kv_cache_memory < 1
        ):
            raise ValueError(
                f"kv_cache_memory must be a positive number of bytes, got {kv_cache_memory!r}"
            )
        pool = kv_pool_check(
            block_size, num_kv_blocks, kv_cache_memory, "kv_cache_memory or num_kv_blocks"
        )
        if isinstance(model, LoadedModel):  # share one copy of the weights
            loaded = model
            _check_as_loaded(loaded, dtype, device)
            pool(loaded.config, loaded.dtype, loaded.device)
        else:
            loaded = load_model(model, dtype=dtype, device=device, before_weights=pool)
        self.loaded = loaded
        if num_kv_blocks is None:
            num_kv_blocks = kv_blocks_for(
                loaded.config,
                block_size=block_size,
                dtype=loaded.dtype,
                device=loaded.device,
                kv_cache_bytes=kv_cache_memory,
            )
        fields = dict(engine_config_fields)
        fields["max_model_len"] = max_model_len_for(
            fields, loaded.config.max_position_embeddings, num_kv_blocks * block_size
        )
        config = EngineConfig(vocab_size=loaded.config.vocab_size, **fields)
        self.engine = build_engine(
            loaded,
            config,
            num_kv_blocks,
            seed=seed,
            mtp_head=mtp_head,
            decode_graphs=decode_graphs,
        )
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
        use_tqdm: object = True,
        lora_request: object = None,
    ) -> list[CompletionOutput]:
        """Generate for every prompt (text, token ids, or vLLM's prompt dicts:
        prompt_inputs.py); outputs come back in order. use_tqdm (vLLM's progress bar)
        is taken and shows nothing; lora_request must be None."""
        _no_lora(lora_request)
        inputs = read_prompts(prompts, prompt_token_ids)
        return self._run(inputs, _per_prompt(sampling_params, len(inputs)))

    def chat(
        self,
        messages: Sequence[dict[str, Any]] | Sequence[Sequence[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
        use_tqdm: object = True,
        lora_request: object = None,
    ) -> list[CompletionOutput]:
        """Answer one conversation (a list of messages) or several, with the model's template.

        As vLLM's: continue_final_message (with add_generation_prompt=False) goes on with
        the last message, an assistant's answer begun; chat_template_kwargs are more of
        the template's variables, tools one of them; chat_template renders instead of
        the checkpoint's own. use_tqdm shows nothing; lora_request must be None.
        """
        _no_lora(lora_request)
        options = template_options(
            add_generation_prompt, continue_final_message, chat_template_kwargs
        )
        if tools is not None:
            options.setdefault("tools", tools)  # as vLLM: the kwargs' own tools win
        if chat_template is not None:
            options["chat_template"] = chat_template
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer, so no chat template")
        if not isinstance(messages, list | tuple):
            raise ValueError(
                "messages must be a list of messages (or of conversations), got "
                + ("one dict" if isinstance(messages, dict) else f"{messages!r:.40}")
            )
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        ids = []
        for i, conversation in enumerate(conversations):
            try:
                if not isinstance(conversation, list | tuple):
                    raise ValueError(f"a conversation is a list of messages, got {conversation!r}")
                limit = self.engine.config.max_model_len
                ids.append(
                    self.tokenizer.encode_chat(list(conversation), **options, max_model_len=limit)
                )
            except ValueError as exc:  # which one, where there are several
                if len(conversations) > 1:  # its class kept (PromptTooLongError)
                    exc.args = (f"conversation {i}: {exc}", *exc.args[1:])
                raise
        inputs = [PromptInput(None, token_ids) for token_ids in ids]
        return self._run(inputs, _per_prompt(sampling_params, len(ids)))

    def _run(
        self, inputs: list[PromptInput], params: list[SamplingParams]
    ) -> list[CompletionOutput]:
        engine = self.engine
        if engine.has_unfinished_requests():
            # It steps the engine until it is empty: another caller's requests would end
            # here, their outputs lost to it.
            raise ValueError(
                "the engine holds requests added through llm.engine: step them to the end "
                "first (generate and chat run their prompts on the engine alone)"
            )
        order, outputs = [], {}
        try:
            for index, (prompt, p) in enumerate(zip(inputs, params, strict=True)):
                rid = f"llm-{next(self._ids)}"
                try:
                    request = engine.add_request(
                        rid,
                        prompt.text,
                        p,
                        prompt_token_ids=prompt.token_ids,
                        cache_salt=prompt.cache_salt,
                    )
                except ValueError as exc:
                    if len(inputs) > 1:  # say which of the batch's prompts, as given
                        exc.args = (f"prompt {index}: {exc}", *exc.args[1:])
                    raise
                order.append((rid, prompt.text, request))
            pieces: dict[str, list[str]] = {rid: [] for rid, _, _ in order}
            logprobs: dict[str, list[TokenLogprobs]] = {}
            while engine.has_unfinished_requests():
                for out in engine.step():
                    pieces[out.request_id].append(out.text_delta)
                    if out.logprobs is not None:
                        logprobs.setdefault(out.request_id, []).extend(out.logprobs)
                    if out.finish_reason is FinishReason.ERROR:
                        raise RuntimeError(out.error)
                    if out.finished:
                        outputs[out.request_id] = out
        except BaseException:
            for rid, _, _ in order:
                engine.abort(rid)
            raise
        results = []
        for rid, text, request in order:
            out = outputs[rid]
            results.append(
                CompletionOutput(
                    rid,
                    text,
                    request.prompt_token_ids,
                    "".join(pieces[rid]),
                    request.output_token_ids,
                    out.finish_reason,
                    out.num_cached_tokens,
                    logprobs.get(rid, [] if request.sampling_params.logprobs is not None else None),
                )
            )
        return results


def build_engine(
    loaded: LoadedModel,
    config: EngineConfig,
    num_blocks: int,
    *,
    seed: int | None = 0,
    vote=None,
    mtp_head: MtpHead | None = None,
    decode_graphs: bool | None = None,
) -> Engine:
    """An Engine over a loaded model: KV cache, sampler, drafter, runner; decode graphs
    as LLM's decode_graphs says."""
    kv = allocate_kv_cache(
        loaded.config, num_blocks, config.block_size, loaded.dtype, loaded.device
    )
    if decode_graphs is None:
        decode_graphs = loaded.device.type == "cuda"
    graphs = None
    if decode_graphs:  # recorded on CUDA, run unrecorded elsewhere (DecodeGraphs)
        graphs = DecodeGraphs(
            loaded.model,
            kv,
            config.block_size,
            max_seqs=config.max_num_seqs,
            max_width=-(-config.max_model_len // config.block_size),
            max_queries=1 + config.num_speculative_tokens,
        )
    # A PROMPT engine samples one token a request and decodes none: an index of each
    # prompt would be built, and held while its KV waits for a decoder, for nothing.
    speculates = config.num_speculative_tokens > 0 and config.engine_type is not EngineType.PROMPT
    drafter = NgramDrafter() if speculates and mtp_head is None else None
    runner = ModelRunner(
        loaded.model,
        kv,
        block_size=config.block_size,
        sampler=Sampler(seed),
        drafter=drafter,
        mtp_head=mtp_head,
        num_speculative_tokens=config.num_speculative_tokens,
        decode_graphs=graphs,
    )
    tokenizer = loaded.source.tokenizer
    eos = tokenizer.eos_token_ids if tokenizer is not None else ()
    eos = eos or loaded.config.eos_token_ids
    if loaded.device.type == "cpu":
        keep_freed_memory()  # each step's activations reuse the last one's pages
    return Engine(config, runner, tokenizer, num_blocks, vote=vote, eos_token_ids=tuple(eos))


def _per_prompt(
    params: SamplingParams | Sequence[SamplingParams] | None, n: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    wrong = ValueError(
        f"sampling_params must be a SamplingParams or a list of them, got {params!r:.80}"
    )
    if isinstance(params, str | bytes | dict):
        raise wrong
    try:
        params = list(params)
    except TypeError:
        raise wrong from None
    if not all(isinstance(p, SamplingParams) for p in params):
        raise wrong
    if len(params) != n:
        raise ValueError(f"{len(params)} sampling params for {n} prompts")
    return params


def _no_lora(lora_request: object) -> None:
    if lora_request is not None:
        raise ValueError("lora_request: this engine serves no LoRA adapters; give None")


# vLLM's names for what is spelled otherwise here: said with the refusal.
_VLLM_HINTS = {
    "enforce_eager": " (decode_graphs=False runs every step op by op, as enforce_eager)",
    "gpu_memory_utilization": " (kv_cache_memory gives the KV cache's bytes)",
}


def _check_as_loaded(
    loaded: LoadedModel, dtype: str | torch.dtype | None, device: str | torch.device | None
) -> None:
    """A dtype or device given beside a loaded model must be the one it was loaded with:
    the weights are shared as they are (a bfloat16 asked for ran in float32, unsaid)."""
    asked = pick_device(device) if device is not None else loaded.device
    if (asked.type, asked.index or 0) != (loaded.device.type, loaded.device.index or 0):
        raise ValueError(
            f"device {device!r}: the model given was loaded on {loaded.device}; "
            "leave device out, or load it there"
        )
    if dtype is not None and pick_dtype(dtype, loaded.device) != loaded.dtype:
        raise ValueError(
            f"dtype {dtype!r}: the model given was loaded in {loaded.dtype}; "
            "leave dtype out, or load it so"
        )
