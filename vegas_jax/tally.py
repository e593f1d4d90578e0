"""Acceptance statistics of the speculative rounds a generation ran: per draft position,
per gamma (auto runs several), per prompt and per call.

Over the sequence-rounds R of a set of rounds, cumulative[i] = (those accepting drafts
1..i+1) / R, a position past a round's gamma counting as not accepted, so that
tau = (tokens emitted) / R = 1 + sum(cumulative), pooled over every gamma as for each
one. conditional[i] = P(draft i+1 accepted | drafted, drafts 1..i accepted) (None: never
reached); for one gamma its running product is the cumulative one."""

from __future__ import annotations

import collections

import numpy as np


def _acceptance(accepted_at: np.ndarray, reached: np.ndarray, rounds: int) -> dict:
    """tau and the acceptance lists of `rounds` sequence-rounds of which accepted_at[i]
    accepted drafts 1..i+1 and reached[i] drafted i+1 with 1..i accepted."""
    return {
        "tau": 1.0 + float(accepted_at.sum()) / rounds if rounds else 1.0,
        "acceptance_cumulative": (accepted_at / max(rounds, 1)).tolist(),
        "acceptance_conditional": [float(a / r) if r else None
                                   for a, r in zip(accepted_at, reached)],
    }


class Tally:
    """Counts of the rounds read so far."""

    def __init__(self, n_prompts: int):
        # gamma -> [gamma] sequence-rounds accepting drafts 1..i+1, and its calls / rounds
        self.accepted_at: dict[int, np.ndarray] = {}
        self.calls: collections.Counter = collections.Counter()
        self.seq_rounds: collections.Counter = collections.Counter()
        self.plain_calls = 0
        self.prompt_rounds = np.zeros(n_prompts, np.int64)
        self.prompt_emitted = np.zeros(n_prompts, np.int64)
        self.by_call: list = []  # per call, per slot: drafts accepted (-1 inactive; None plain)

    def add(self, gamma: int, n_acc, was_active, owner):
        """A call's output: a gamma round's drafts accepted per slot (n_acc [b]; None:
        plain steps), the slots it ran (was_active [b]) and their prompts (owner)."""
        if n_acc is None:
            self.plain_calls += 1
            self.by_call.append(None)
            return
        self.by_call.append(np.where(was_active, n_acc, -1).tolist())
        np.add.at(self.prompt_rounds, owner, 1)
        np.add.at(self.prompt_emitted, owner, n_acc[was_active] + 1)
        n_acc = n_acc[was_active]
        at = self.accepted_at.setdefault(gamma, np.zeros(gamma, np.int64))
        at += (n_acc[:, None] > np.arange(gamma)[None, :]).sum(0)
        self.calls[gamma] += 1
        self.seq_rounds[gamma] += len(n_acc)

    def _pooled(self, gammas) -> dict:
        top = max(gammas, default=0)
        acc, reached = np.zeros(top, np.int64), np.zeros(top, np.int64)
        for g in gammas:
            at = self.accepted_at[g]
            acc[:g] += at
            reached[:g] += np.concatenate([[self.seq_rounds[g]], at[:-1]])
        return _acceptance(acc, reached, sum(self.seq_rounds[g] for g in gammas))

    def stats(self) -> dict:
        gammas = sorted(self.accepted_at)
        return {
            "rounds": sum(self.calls.values()),  # speculative rounds (device calls)
            "plain_calls": self.plain_calls,  # auto's calls of plain steps
            # tau = mean accepted drafts + 1 a sequence-round, and the acceptance lists,
            # over every round (module docstring), then per gamma
            **self._pooled(gammas),
            "by_gamma": {g: {"rounds": self.calls[g], **self._pooled([g])} for g in gammas},
            # per prompt, in prompt order (None: no round, the prefill's token ended it)
            "tau_by_sequence": [float(e / r) if r else None
                                for e, r in zip(self.prompt_emitted, self.prompt_rounds)],
            "rounds_by_sequence": self.prompt_rounds.tolist(),
            "accepted_by_call": self.by_call,
        }
