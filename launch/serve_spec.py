"""Speculative decoding in the serving job (``launch/serve.py --spec-tokens T``).

A decode step of a request whose next input token is ``x`` (its last generated token, not yet in its state)
proposes ``T`` draft tokens ``d_1..d_T`` from the request's own tokens (:func:`propose`), then runs one verify step
of the whole model on ``[x, d_1, .., d_T]`` (every KDA layer's ``verify``: ``T + 1`` tokens per row). Position ``t``
of the logits is the model's prediction after ``x, d_1, .., d_t``, so with ``y_t`` its greedy token the row accepts
the longest prefix of drafts with ``d_{t+1} == y_t``, say ``n`` of them, and emits ``y_0 .. y_n``: the ``n``
accepted drafts and the bonus token ``y_n``, which is the next step's input. ``pool.commit(slots, n + 1)`` keeps
``x`` and the accepted drafts in every layer's state. Each emitted token is the greedy choice after exactly the
tokens before it, so the output is the plain greedy decode's, ``n + 1`` tokens per step.

The draft is prompt-lookup decoding: the next draft token follows the latest earlier occurrence of the longest
suffix (up to :data:`NGRAM` tokens) of the request's prompt, generated tokens and drafts so far; with no earlier
occurrence, the last token repeats. It costs no model, and greedy decoding of a small model repeats itself often.
"""

from __future__ import annotations

from typing import Any

import torch

NGRAM = 3  # the longest suffix a draft token is looked up by

__all__ = ["NGRAM", "SpecDecoder", "accepted_drafts", "propose"]


def propose(history: list[int], drafts: int, ngram: int = NGRAM) -> list[int]:
    """``drafts`` tokens continuing ``history`` (at least one token), one at a time: the token after the latest
    earlier occurrence of the longest suffix of ``ngram`` tokens or fewer (history and the drafts so far), else the
    last token again."""
    seq = list(history)
    for _ in range(drafts):
        seq.append(_next_token(seq, ngram))
    return seq[len(history):]


def _next_token(seq: list[int], ngram: int) -> int:
    for n in range(min(ngram, len(seq) - 1), 0, -1):
        suffix = seq[-n:]
        for i in range(len(seq) - n - 1, -1, -1):  # occurrences with a token after them, the latest first
            if seq[i:i + n] == suffix:
                return seq[i + n]
    return seq[-1]


def accepted_drafts(tokens: torch.Tensor, greedy: torch.Tensor) -> torch.Tensor:
    """``tokens [B, T+1]`` (the input token, then ``T`` drafts) and the greedy choices ``greedy [B, T+1]`` at each
    position -> the drafts each row accepts ``[B]`` int32: the longest prefix with ``tokens[:, t+1] ==
    greedy[:, t]`` (on the device, no sync)."""
    return (tokens[:, 1:] == greedy[:, :-1]).int().cumprod(1).sum(1, dtype=torch.int32)


class SpecDecoder:
    """One rank's speculative decode steps over ``model`` (``TPModel``) and its ``pool``; ``drafts`` = ``T``.
    Counts the drafts proposed and accepted on the rows of live requests, and how many rows accepted ``n`` drafts
    (``histogram[n]``, ``n = 0..T``)."""

    def __init__(self, model: Any, pool: Any, drafts: int, device: torch.device) -> None:
        if not 1 <= drafts <= pool.ring_length - 2:
            raise ValueError(f"--spec-tokens {drafts}: a step verifies T + 1 = {drafts + 1} tokens, at most "
                             f"ring_length - 1 = {pool.ring_length - 1}")
        self.model, self.pool, self.drafts, self.device = model, pool, drafts, device
        self.proposed = 0
        self.accepted = 0
        self.histogram = [0] * (drafts + 1)

    def step(self, rows: list[Any], slot_ids: list[int] | None = None) -> dict[int, tuple[list[int], torch.Tensor]]:
        """One verify + commit step of the fixed batch ``rows`` (a request per slot, None: a padding row; its input
        token ``r.last_token``), over ``slot_ids`` (default: each row's ``r.slot``, -1 for padding). Returns, per
        live row, its tokens to emit (``n + 1``: the accepted drafts and the bonus token) and their logits
        ``[n + 1, vocab]``. Every rank feeds and commits the same tokens: rank 0's greedy choices are broadcast
        before the acceptance is computed."""
        import torch.distributed as dist

        T = self.drafts
        tokens = torch.tensor([[r.last_token, *propose(r.prompt + r.generated, T)] if r else [0] * (T + 1)
                               for r in rows], device=self.device)  # [B, T+1]
        if slot_ids is None:
            slot_ids = [r.slot if r else -1 for r in rows]
        slots = torch.tensor(slot_ids, dtype=torch.int32, device=self.device)
        logits = self.model.verify(tokens, slots)  # [B, T+1, vocab]
        greedy = logits.argmax(-1)
        dist.broadcast(greedy, src=0)
        n = accepted_drafts(tokens, greedy)
        self.pool.commit(slots, torch.where(slots >= 0, n + 1, 0).to(torch.int32))  # the input token and n drafts
        n_host, greedy_host = n.tolist(), greedy.tolist()
        out = {}
        for i, r in enumerate(rows):
            if r is not None:
                out[i] = (greedy_host[i][:n_host[i] + 1], logits[i, :n_host[i] + 1])
                self.proposed += T
                self.accepted += n_host[i]
                self.histogram[n_host[i]] += 1
        return out

    @property
    def acceptance(self) -> float:
        """Accepted drafts over proposed drafts."""
        return self.accepted / max(self.proposed, 1)

    def summary(self, tokens: int, rows: int) -> str:
        """The summary's line: drafts proposed and accepted, the acceptance rate, the ``tokens`` emitted per live
        request and step (``rows`` live rows in all steps) and the histogram of accepted drafts per row."""
        T = self.drafts
        return (f"  speculative: {T} draft tokens per request and step (n-gram lookup), {self.proposed} proposed, "
                f"{self.accepted} accepted: acceptance rate {self.acceptance:.1%}, {tokens / max(rows, 1):.2f} tokens "
                f"per request and step; rows accepting 0..{T} drafts: {self.histogram}")
