"""A request that can never fit its model's context, refused before it is queued.

The engines refuse it too, but only as they take it from the queue: under load,
after minutes in it. The gateway knows the context length each live engine
registers (`EngineInfo.max_model_len`, the longest of them counts) and the exact
length of a prompt given as token ids; of a text prompt it only estimates the length,
so there it refuses only a max_tokens that leaves no room for any prompt. Refused
here, a request takes no quota and no place in the queue.
"""

from __future__ import annotations

from tandem.context_window import completion_too_long, context_exceeded, prompt_too_long
from tandem.gateway.errors import bad_request
from tandem.gateway.jobs import Job
from tandem.gateway.prompts import naming_prompt
from tandem.protocol import ErrorCode


def check_context(job: Job, max_model_len: int | None) -> None:
    """GatewayError (400, the engines' words, OpenAI's code) for a job that cannot fit a
    context of `max_model_len` tokens; None: not known (nothing checked)."""
    if max_model_len is None:
        return
    max_tokens, field = job.max_tokens, job.max_tokens_param
    for p, item in enumerate(job.prompt_items):  # a batch's: one too long fails it all
        if (ids := item.prompt_token_ids) is None:
            continue
        why = prompt_too_long(len(ids), max_model_len)
        if why is None and job.max_tokens_given:  # else the engines stop at the context's end
            why = context_exceeded(len(ids), max_tokens, max_model_len, field)
        if why is not None:
            # OpenAI's code for any overflow (errors.answered_code), the prompt alone too.
            why = naming_prompt(why, p, job.prompts)
            raise bad_request(why, job.prompt_param, ErrorCode.CONTEXT_LENGTH_EXCEEDED)
    if not job.max_tokens_given:
        return
    if why := completion_too_long(max_tokens, max_model_len, field):
        raise bad_request(why, job.max_tokens_param, ErrorCode.CONTEXT_LENGTH_EXCEEDED)
