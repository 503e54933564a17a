"""A stand-in MTP head for tests: argmax drafts from a table of successors."""

from __future__ import annotations

import itertools

import torch

from tandem.engine.mtp import MtpDrafts


class SuccessorHead:
    """Drafts, after each token, the token that followed it in reference outputs (and
    after that one, its successor): right often, wrong where a token had several."""

    def __init__(self, references: list[list[int]]) -> None:
        self.successors = {a: b for ref in references for a, b in itertools.pairwise(ref)}

    def propose(self, hidden: torch.Tensor, tokens: torch.Tensor, num_drafts: int) -> MtpDrafts:
        drafts = []
        for token in tokens.tolist():
            row = []
            for _ in range(num_drafts):
                token = self.successors.get(token, 0)
                row.append(token)
            drafts.append(row)
        return MtpDrafts(torch.tensor(drafts))
