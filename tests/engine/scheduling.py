"""What the step scheduler's tests share: a scheduler on one rank, prompts."""

from tandem.engine.config import EngineConfig
from tandem.engine.request import SamplingParams
from tandem.engine.scheduler import Scheduler

LONG = SamplingParams(max_tokens=100_000, ignore_eos=True)


def make(num_blocks=4096, **fields):
    return Scheduler(EngineConfig(**fields), num_blocks=num_blocks)


def prompt(n, offset=0):
    return [offset + i for i in range(n)]
