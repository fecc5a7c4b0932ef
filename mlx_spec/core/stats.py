"""Decoding statistics: plain counters, one `observe_*` per event, derived metrics as
properties. No printing here; the CLI renders snapshots.

Definitions (as vLLM and llama.cpp use them, so numbers compare across tools):
  acceptance rate α̂         accepted draft tokens / drafted tokens
  acceptance at position i  rounds whose draft token i was accepted / rounds that drafted >= i
  mean accepted length      1 + accepted / rounds (counts the recovered or bonus token)
  acceptance at rank k      draft-tree nodes of sibling rank k accepted / those whose turn
                            came (parent accepted, every earlier sibling rejected)
  decode tok/s              generated tokens / decode time (prompt processing excluded)
  grammar-forced share      grammar_forced / generated: tokens a grammar admitted alone,
                            drafted for free (drafted / accepted count the drafter's only)
  by source                 drafted_from / accepted_from: draft tokens by where the
                            drafter found them (the suffix drafter: "context", this
                            request's prompt and output; "memory", earlier requests only)
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field


@dataclass
class Stats:
    rounds: int = 0
    drafted: int = 0  # draft tokens proposed
    accepted: int = 0  # draft tokens accepted
    generated: int = 0  # tokens emitted (after stop and max-token cuts)
    target_forwards: int = 0  # verify passes, prefill excluded
    draft_forwards: int = 0  # draft model passes (0 for model-free drafters)
    drafted_at: list[int] = field(default_factory=list)  # [i]: rounds that drafted > i tokens
    accepted_at: list[int] = field(default_factory=list)  # [i]: rounds that accepted > i tokens
    reached_at: list[int] = field(default_factory=list)  # [i]: drafted > i and accepted >= i
    prompt_tokens: int = 0  # prompt length
    prefill_tokens: int = 0  # prompt tokens actually processed (cache reuse skips the rest)
    prefill_time: float = 0.0
    draft_time: float = 0.0
    verify_time: float = 0.0
    decode_time: float = 0.0
    peak_memory: int = 0  # bytes, MLX's peak allocation
    grammar_forced: int = 0  # tokens committed as grammar-forced drafts (not the drafter's)
    gamma_last: int = 0
    tree_rounds: int = 0  # rounds that verified a draft tree (position counters then count depth)
    tried_at_rank: list[int] = field(default_factory=list)  # [k]: tree nodes of rank k whose turn came
    accepted_at_rank: list[int] = field(default_factory=list)  # [k]: of those, accepted
    drafted_from: dict[str, int] = field(default_factory=dict)  # source -> draft tokens proposed
    accepted_from: dict[str, int] = field(default_factory=dict)  # source -> draft tokens accepted

    def observe_prefill(self, prompt_tokens: int, processed: int, seconds: float) -> None:
        self.prompt_tokens += prompt_tokens
        self.prefill_tokens += processed
        self.prefill_time += seconds

    def observe_round(
        self, gamma: int, accepted: int, emitted: int, draft_s: float, verify_s: float,
        depth: int | None = None, decode_s: float | None = None,
    ) -> None:
        """One round: `gamma` drafted, the first `accepted` taken, `emitted` tokens kept. A
        draft tree's round drafted `gamma` nodes at most `depth` deep and accepted a path of
        `accepted` (the position counters count depth). `decode_s`: the round's wall time
        where it is more than draft + verify (in a batch, which also waits for the others'
        share of the forwards)."""
        self.rounds += 1
        self.target_forwards += 1
        self.drafted += gamma
        self.accepted += accepted
        self.generated += emitted
        self.gamma_last = gamma
        gamma = gamma if depth is None else depth
        if gamma > len(self.drafted_at):
            grow = gamma - len(self.drafted_at)
            self.drafted_at += [0] * grow
            self.accepted_at += [0] * grow
            self.reached_at += [0] * grow
        for i in range(gamma):
            self.drafted_at[i] += 1
        for i in range(min(accepted + 1, gamma)):
            self.reached_at[i] += 1
        for i in range(accepted):
            self.accepted_at[i] += 1
        self.draft_time += draft_s
        self.verify_time += verify_s
        self.decode_time += draft_s + verify_s if decode_s is None else decode_s

    def observe_tree(self, attempts: list[tuple[int, int, bool]]) -> None:
        """A tree round's tried nodes, as `TreeShape.attempts` lists them."""
        self.tree_rounds += 1
        for _, rank, ok in attempts:
            if rank >= len(self.tried_at_rank):
                grow = rank + 1 - len(self.tried_at_rank)
                self.tried_at_rank += [0] * grow
                self.accepted_at_rank += [0] * grow
            self.tried_at_rank[rank] += 1
            self.accepted_at_rank[rank] += ok

    def observe_sources(self, sources, accepted) -> None:
        """A round's draft tokens' sources (one per token) and the accepted ones' indexes."""
        for source in sources:
            self.drafted_from[source] = self.drafted_from.get(source, 0) + 1
        for i in accepted:
            self.accepted_from[sources[i]] = self.accepted_from.get(sources[i], 0) + 1

    def retract(self, tokens: int) -> None:
        """Tokens generated past a stop string are not part of the answer: uncount them."""
        self.generated -= tokens

    def snapshot(self) -> "Stats":
        return copy.deepcopy(self)

    @property
    def acceptance_rate(self) -> float:
        """α̂ = accepted / drafted (0 when nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at)]

    @property
    def conditional_acceptance(self) -> list[float]:
        """a_i = P(token i accepted | tokens < i accepted), the chain factors of Σj Πi≤j a_i."""
        return [a / r if r else 0.0 for a, r in zip(self.accepted_at, self.reached_at)]

    @property
    def acceptance_by_rank(self) -> list[float]:
        return [a / t if t else 0.0 for a, t in zip(self.accepted_at_rank, self.tried_at_rank)]

    @property
    def mean_accepted_length(self) -> float:
        return 1 + self.accepted / self.rounds if self.rounds else 0.0

    @property
    def grammar_forced_share(self) -> float:
        return self.grammar_forced / self.generated if self.generated else 0.0

    @property
    def decode_tps(self) -> float:
        return self.generated / self.decode_time if self.decode_time > 0 else 0.0

    @property
    def prefill_tps(self) -> float:
        return self.prefill_tokens / self.prefill_time if self.prefill_time > 0 else 0.0

    def as_dict(self) -> dict:
        """Counters and derived metrics, JSON-ready."""
        out = {k: v for k, v in self.__dict__.items()}
        out.update(
            acceptance_rate=self.acceptance_rate,
            acceptance_by_position=self.acceptance_by_position,
            acceptance_by_rank=self.acceptance_by_rank,
            mean_accepted_length=self.mean_accepted_length,
            decode_tps=self.decode_tps,
            grammar_forced_share=self.grammar_forced_share,
            prefill_tps=self.prefill_tps,
        )
        return out
