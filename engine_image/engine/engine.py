"""Engine: the scheduler, the runner and the tokenizer, stepped together.

The service layer (Redis, HTTP) and the offline `LLM` both drive this:

    engine.add_request("r1", prompt="Hello", sampling_params=SamplingParams(max_tokens=8))
    while engine.has_unfinished_requests():
        for out in engine.step():          # EngineOutput per request that moved
            ...

It turns text into token ids, applies stop strings through the incremental
detokenizer, and reports per-step statistics for the metrics.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field

from tandem.engine.admission import check_fits
from tandem.engine.config import EngineConfig
from tandem.engine.detokenizer import IncrementalDetokenizer
from tandem.engine.engine_output import (
    EngineOutput,
    EngineTotals,
    FinishReason,
    ParameterError,
    StepStats,
)
from tandem.engine.plan import StepPlan
from tandem.engine.request import Request, RequestStatus, SamplingParams
from tandem.engine.runner import ModelRunner
from tandem.engine.scheduler import Scheduler, Vote
from tandem.engine.stop_matcher import StopStrings
from tandem.engine.tokenizer import Tokenizer

log = logging.getLogger("tandem.engine")


@dataclass(slots=True)
class _Tracked:
    request: Request
    detokenizer: IncrementalDetokenizer | None
    text: list[str] = field(default_factory=list)


class Engine:
    def __init__(
        self,
        config: EngineConfig,
        runner: ModelRunner,
        tokenizer: Tokenizer | None,
        num_blocks: int,
        *,
        vote: Vote | None = None,
        eos_token_ids: tuple[int, ...] = (),
    ) -> None:
        self.config = config
        self.runner = runner
        self.tokenizer = tokenizer
        self.scheduler = Scheduler(config, num_blocks, vote)
        # The model's EOS; extra ids (a chat model's end-of-turn) stop as well.
        self._eos = eos_token_ids[0] if eos_token_ids else None
        self._extra_eos = tuple(eos_token_ids[1:])
        self._tracked: dict[str, _Tracked] = {}
        # The last stop strings' tables: the n choices of a request arrive one after
        # another with the same strings, and share one build (linear in their length,
        # on the stepping thread).
        self._last_stops = StopStrings.of(())
        # Resumed requests found complete on arrival: reported by the next step().
        self._finished_early: list[tuple[Request, FinishReason]] = []
        self.last_step = StepStats()
        self.totals = EngineTotals()

    # ---------------------------------------------------------------- input

    def add_request(
        self,
        request_id: str,
        prompt: str | None = None,
        sampling_params: SamplingParams | None = None,
        *,
        prompt_token_ids: list[int] | None = None,
        priority: int = 0,
        generated_token_ids: list[int] | None = None,
        generated_text: str | None = None,
        exact_max_tokens: bool = False,
        cache_salt: str | None = None,
    ) -> Request:
        """Queue a request; raises ValueError (e.g. PromptTooLongError) if it cannot run.

        generated_token_ids resumes a request another engine started: those
        tokens were already sent (with generated_text, when known), so they are
        recomputed (not sampled again) and generation continues after them.
        exact_max_tokens: see Scheduler.add_request (ContextLengthError).
        cache_salt: see Request.cache_salt.
        """
        request = self._make_request(request_id, prompt, prompt_token_ids, sampling_params)
        request.priority = priority
        request.cache_salt = cache_salt
        if generated_token_ids:
            self._check_token_ids(generated_token_ids, "generated")
            request.token_ids.extend(generated_token_ids)
            # The last engine died before saying so.
            if (reason := _already_done(request, self.config.max_model_len)) is not None:
                self._finished_early.append((request, reason))
                return request
        self.scheduler.add_request(request, exact_max_tokens=exact_max_tokens)
        self._track(request, generated_text)
        return request

    def _make_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int] | None,
        sampling_params: SamplingParams | None,
    ) -> Request:
        params = sampling_params or SamplingParams()
        if (prompt is None) == (prompt_token_ids is None):
            raise ValueError("give exactly one of prompt (text) or prompt_token_ids")
        if prompt_token_ids is None:
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompt_token_ids")
            prompt_token_ids = self.tokenizer.encode(
                prompt, max_model_len=self.config.max_model_len
            )
        self._check_token_ids(prompt_token_ids)
        if params.stop and self.tokenizer is None:  # no text to find them in
            raise ParameterError("this model has no tokenizer, so no stop strings", "stop")
        vocab = self.config.vocab_size
        if vocab is not None and params.logit_bias and params.logit_bias[-1][0] >= vocab:
            raise ParameterError(  # the pairs are sorted: the last has the largest id
                f"logit_bias token id {params.logit_bias[-1][0]} is outside the vocabulary "
                f"({vocab})",
                "logit_bias",
            )
        beyond = [t for t in params.stop_token_ids if vocab is not None and t >= vocab]
        if beyond:  # it could never be sampled: a token id of another tokenizer
            raise ParameterError(
                f"stop_token_ids {beyond} are outside the vocabulary ({vocab})", "stop_token_ids"
            )
        if self._extra_eos and not params.ignore_eos:
            params = _with_stop_ids(params, self._extra_eos)
        return Request(request_id, prompt_token_ids, params, eos_token_id=self._eos)

    # ------------------------------------------------------- disaggregation

    def admit_handoff(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        first_token_ids: list[int],
        sampling_params: SamplingParams,
        sent_text: str | None = None,
        cache_salt: str | None = None,
    ) -> list[int] | None:
        """COMPLETION engine: reserve KV for a request prefilled elsewhere.

        Returns the block table the KV transfer writes into, or None when there
        is no room yet. Then call handoff_received (KV arrived) or
        handoff_failed (recompute it here). sent_text: what the events of
        first_token_ids carried, when known. cache_salt: the prompt engine's (its blocks,
        once here, are cached under it).
        """
        request = self._make_request(request_id, None, prompt_token_ids, sampling_params)
        # Sampled by the prompt engine: one of another model (a rollout that moved the
        # served name) may have sampled a token this vocabulary lacks.
        self._check_token_ids(first_token_ids, "generated")
        request.cache_salt = cache_salt
        table = self.scheduler.admit_handoff(request, first_token_ids)
        if table is not None:
            self._track(request, sent_text)
        return table

    def already_ended(
        self,
        prompt_token_ids: list[int],
        generated_token_ids: list[int],
        sampling_params: SamplingParams,
    ) -> bool:
        """Whether tokens generated elsewhere already end the request: a stop token, its
        max_tokens, or this engine's context reached. add_request resumes such a request
        without running it: it finishes at the next step."""
        request = self._make_request("resumed", None, prompt_token_ids, sampling_params)
        request.token_ids.extend(generated_token_ids)
        return _already_done(request, self.config.max_model_len) is not None

    def check_handoff_fits(
        self, prompt_token_ids: list[int], params: SamplingParams, exact_max_tokens: bool
    ) -> None:
        """COMPLETION engine: raise admission's errors for a request its context can
        never hold (a prompt engine with a longer max_model_len prefilled it): such a
        handoff would wait for room for ever, or stop short at this max_model_len."""
        check_fits(
            self.config, len(prompt_token_ids), params.max_tokens, exact_max_tokens=exact_max_tokens
        )

    def handoff_received(self, request_id: str) -> None:
        # Drafts from the prompt and first token, as a local prefill's (placeholders,
        # verified and rejected, cost the first decode step its speculation).
        request = self.scheduler.receiving.get(request_id)
        drafts = None if request is None else self.runner.drafts_for(request_id, request.token_ids)
        self.scheduler.handoff_received(request_id, drafts)

    def handoff_failed(self, request_id: str) -> None:
        self.scheduler.handoff_failed(request_id)

    def release_handoff(self, request_id: str) -> None:
        """PROMPT engine: the decoder has the KV (or the offer expired): free it."""
        self.scheduler.release_handoff(request_id)
        self._tracked.pop(request_id, None)
        self.runner.free(request_id)

    def _check_token_ids(self, token_ids: list[int], what: str = "prompt") -> None:
        vocab = self.config.vocab_size
        for token in token_ids:
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise ValueError(f"{what} token ids must be non-negative integers, got {token!r}")
            if vocab is not None and token >= vocab:
                raise ValueError(f"{what} token id {token} is outside the vocabulary ({vocab})")

    def _track(self, request: Request, sent_text: str | None = None) -> None:
        detok = None
        if self.tokenizer is not None:
            stop = request.sampling_params.stop
            if stop != self._last_stops.stops:
                self._last_stops = StopStrings.of(stop)
            detok = IncrementalDetokenizer(
                self.tokenizer, request.prompt_token_ids, self._last_stops
            )
            if request.num_output_tokens:
                # Tokens generated elsewhere (a PROMPT engine, or an engine that died):
                # replay them so this detokenizer is where the other one was, with any
                # half-decoded character still pending and what was sent counted so.
                detok.resume(request.output_token_ids, sent_text)
        self._tracked[request.request_id] = _Tracked(request, detok)

    def abort(self, request_id: str) -> EngineOutput | None:
        """Cancel a request and free its KV at once; None if it already finished."""
        out = self.scheduler.abort_request(request_id)
        tracked = self._tracked.pop(request_id, None)
        self.runner.free(request_id)
        if out is None or tracked is None:
            return None
        return self._output(tracked, [], "", FinishReason.ABORT)

    # ----------------------------------------------------------------- step

    def has_unfinished_requests(self) -> bool:
        return bool(self._finished_early) or self.scheduler.has_unfinished_requests()

    def step(self) -> list[EngineOutput]:
        early = [self._early_output(r, reason) for r, reason in self._finished_early]
        self._finished_early.clear()
        return early + self._step()

    def _early_output(self, request: Request, reason: FinishReason) -> EngineOutput:
        return EngineOutput(
            request.request_id,
            [],
            "",
            reason,
            request.num_prompt_tokens,
            request.num_output_tokens,
            0,
        )

    def _step(self) -> list[EngineOutput]:
        started = time.perf_counter()
        plan = self.scheduler.schedule()
        try:
            result = self.runner.execute(plan)
        except Exception as exc:  # one bad batch must not take the engine down
            log.exception("step failed; ending its %d requests", len(plan.seqs))
            return self._fail_step(plan, exc)
        updates = self.scheduler.update(plan, result)
        for rid in plan.preempted_request_ids:
            self.runner.free(rid)  # its sampler/drafter state restarts with the recompute
        outputs = []
        for update in updates:
            tracked = self._tracked.get(update.request_id)
            if tracked is None:
                continue
            out = self._apply(tracked, update.new_token_ids, update.status)
            # (Drafts cut off by a stop string were not kept: not counted.)
            out.num_accepted_drafts = min(update.num_accepted_drafts, len(out.new_token_ids))
            step_logprobs = (result.logprobs or {}).get(update.request_id)
            if step_logprobs is not None:  # the step's tokens, cut as they were
                out.logprobs = step_logprobs[: len(out.new_token_ids)]
            outputs.append(out)
        self._record(plan, outputs, time.perf_counter() - started)
        return outputs

    def _fail_step(self, plan: StepPlan, exc: Exception) -> list[EngineOutput]:
        """End every request of a step that raised, with the error as the reason."""
        self.last_step = StepStats()  # nothing computed: no step to count
        outputs = []
        for seq in plan.seqs:
            tracked = self._tracked.pop(seq.request_id, None)
            self.scheduler.abort_request(seq.request_id)
            self.runner.free(seq.request_id)
            if tracked is not None:
                out = self._output(tracked, [], "", FinishReason.ERROR)
                out.error = f"the engine failed on this request: {type(exc).__name__}: {exc}"
                outputs.append(out)
        return outputs

    def _apply(
        self, tracked: _Tracked, new_tokens: list[int], status: RequestStatus
    ) -> EngineOutput:
        request = tracked.request
        delta, reason = "", None
        if tracked.detokenizer is not None:
            # A stop token ends the text without its own (as in vLLM: a stop id that is
            # an ordinary token, "\n" say, or an EOS that is not a special token); it
            # stays in token_ids.
            stop_token = (
                status is RequestStatus.FINISHED_STOPPED
                and bool(new_tokens)
                and new_tokens[-1] in request.stop_token_set
            )
            shown = new_tokens[:-1] if stop_token else new_tokens
            delta, stopped, kept = tracked.detokenizer.add_until_stop(shown)
            if stopped and kept < len(new_tokens):
                # Accepted drafts after the token that completed a stop string, a stop
                # token among them: a run without speculation never sampled them.
                del request.token_ids[kept - len(new_tokens) :]
                new_tokens = new_tokens[:kept]
                if status.is_finished:  # (a stop id or the length limit further on)
                    request.status = status = RequestStatus.FINISHED_STOPPED
            if stopped:
                if not status.is_finished:
                    self.scheduler.finish_request(
                        request.request_id, RequestStatus.FINISHED_STOPPED
                    )
                else:  # the last token max_tokens allowed completed it: a stop all the same
                    request.status = RequestStatus.FINISHED_STOPPED
                status = RequestStatus.FINISHED_STOPPED
            elif status.is_finished:
                delta += tracked.detokenizer.flush()
        if status.is_finished:
            reason = FinishReason(status.value)
        elif status is RequestStatus.HANDOFF:
            reason = FinishReason.HANDOFF
        if reason is not None and reason is not FinishReason.HANDOFF:
            self._tracked.pop(request.request_id, None)
            self.runner.free(request.request_id)
        return self._output(tracked, new_tokens, delta, reason)

    def _output(
        self,
        tracked: _Tracked,
        new_tokens: list[int],
        delta: str,
        reason: FinishReason | None,
    ) -> EngineOutput:
        request = tracked.request
        return EngineOutput(
            request.request_id,
            new_tokens,
            delta,
            reason,
            request.num_prompt_tokens,
            request.num_output_tokens,
            request.num_cached_tokens,
        )

    def _record(self, plan: StepPlan, outputs: list[EngineOutput], seconds: float) -> None:
        last, totals = self.last_step, self.totals
        last.is_prefill = plan.is_prefill
        last.num_scheduled_tokens = plan.total_tokens
        last.num_seqs = len(plan.seqs)
        last.seconds = seconds
        if plan.is_prefill:
            totals.prefill_steps += 1
            totals.prefill_tokens += plan.total_tokens
        else:
            totals.decode_steps += 1
            totals.decode_tokens += plan.total_tokens
        totals.prefix_cached_tokens += plan.num_prefix_cached_tokens
        totals.admitted_tokens += plan.num_admitted_tokens
        totals.preemptions += len(plan.preempted_request_ids)
        totals.drafts_proposed += sum(len(s.draft_token_ids) for s in plan.seqs)
        totals.drafts_accepted += sum(o.num_accepted_drafts for o in outputs)


def _with_stop_ids(params: SamplingParams, extra: tuple[int, ...]) -> SamplingParams:
    stop_ids = tuple(dict.fromkeys(params.stop_token_ids + extra))
    return dataclasses.replace(params, stop_token_ids=stop_ids)


def _already_done(request: Request, max_model_len: int) -> FinishReason | None:
    """The finish reason of a resumed request whose generated tokens already end it (its
    last token a stop, or the tokens at max_tokens or the context's end), else None."""
    if request.num_output_tokens > 0 and request.token_ids[-1] in request.stop_token_set:
        return FinishReason.STOP
    if request.num_tokens >= min(request.max_num_tokens, max_model_len):
        return FinishReason.LENGTH
    return None
