"""The speculative round loop. Token ids in, token ids out: the engine knows no text.

One round (Leviathan et al. 2023, Algorithm 1):
  1. choose γ                    policy, capped so no round can pass max_tokens
  2. draft                       x_1..x_γ and q_1..q_γ from the drafter (lazy, on device)
  3. verify pass                 one target forward over [last, x_1..x_γ] → p_1..p_γ+1
  4. accept                      n accepted, then the recovered or bonus token; one host sync
  5. stop                        cut at the first EOS id or at max_tokens, even mid-block
  6. roll back                   both caches forget every position that was not committed

A plain round (γ = 0) followed by another is pipelined as mlx-lm's generate_step is: the
next round's pass is queued on the device, fed the token still being computed, before the
host waits for it (step 4b). A queued pass that turns out not to be needed is rolled back.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from time import perf_counter
from typing import Callable, Iterable, Iterator, Optional

import mlx.core as mx

from mlx_spec.cache import PromptCache
from mlx_spec.drafters import Draft, Drafter
from mlx_spec.errors import MlxSpecError
from mlx_spec.policy import GammaPolicy, as_policy
from mlx_spec.sampling import LogitProcessor, SamplingParams, make_key
from mlx_spec.stats import Stats
from mlx_spec.verify import verify_greedy, verify_sampled


@dataclass
class Round:
    tokens: list[int]  # committed this round: accepted drafts + recovered/bonus, after cuts
    gamma: int  # draft tokens verified
    accepted: int  # n, of the γ drafted (before any stop cut)
    finish_reason: Optional[str] = None  # "stop" (an EOS id), "length" (max_tokens) or None


class Engine:
    """A target model, an optional drafter, and the loop that joins them.

    Args:
        target: an mlx-lm model (called as model(ids[None], cache=...) -> logits).
        drafter: a `Drafter`, or None for plain decoding.
        eos_ids: token ids that end generation (Gemma: <eos> and <end_of_turn>).
        max_gamma: upper bound on γ; caches keep max_gamma + 1 positions of rollback slack.
        prefill_chunk: prompt tokens per prefill forward.
        profile: synchronise after drafting so draft and verify time are measured apart
            (costs one extra host sync per round; off by default).
    """

    def __init__(
        self,
        target,
        drafter: Optional[Drafter] = None,
        *,
        eos_ids: Iterable[int] = (),
        max_gamma: int = 16,
        prefill_chunk: int = 512,
        profile: bool = False,
    ):
        self.target = target
        self.drafter = drafter
        self.eos_ids = frozenset(eos_ids)
        self.max_gamma = max_gamma
        self.prefill_chunk = prefill_chunk
        self.profile = profile

    def make_prompt_cache(self) -> PromptCache:
        return PromptCache(self.target, slack=self.max_gamma + 1)

    def rounds(
        self,
        prompt_ids: list[int],
        params: SamplingParams = SamplingParams(),
        *,
        gamma: "int | GammaPolicy" = 3,
        max_tokens: int = 256,
        prompt_cache: Optional[PromptCache] = None,
        stats: Optional[Stats] = None,
        prefill_progress: Optional[Callable[[int, int], None]] = None,
    ) -> Iterator[Round]:
        """Generate from `prompt_ids`, one `Round` per target forward.

        Args:
            prompt_ids: the prompt as token ids (at least one).
            params: sampling parameters; temperature 0 is greedy.
            gamma: a fixed γ or a `GammaPolicy`; 0 decodes without drafting.
            max_tokens: the most tokens to generate; never exceeded, even mid-block.
            prompt_cache: caches to reuse across calls (multi-turn); a fresh one if None.
            stats: a `Stats` to update in place (a fresh one if None).
            prefill_progress: called with (done, total) prompt tokens during prefill.
        Yields:
            `Round`s; the last has a finish_reason.
        """
        if not prompt_ids:
            raise MlxSpecError("the prompt is empty")
        cache = prompt_cache or self.make_prompt_cache()
        stats = stats if stats is not None else Stats()
        policy = as_policy(gamma)
        processor = LogitProcessor(params)
        key = key_draft = key_verify = make_key(params.seed)
        history = list(prompt_ids)
        drafter = self.drafter

        # Prefill: both caches end up holding the prompt except its last token, which the
        # first verify pass feeds.
        start = perf_counter()
        processed = cache.target.prefill(prompt_ids[:-1], self.prefill_chunk, prefill_progress)
        if drafter is not None:
            processed += drafter.begin(prompt_ids, cache, processor)
        stats.observe_prefill(len(prompt_ids), processed, perf_counter() - start)
        drafting = drafter is not None and self._can_draft(cache)

        last, generated = prompt_ids[-1], 0
        queued = None  # a plain round's verdict, already on the device (step 4b)
        while generated < max_tokens:
            start = perf_counter()
            if queued is not None:  # steps 1-4 of this plain round were queued last round
                verdict, queued = queued, None
                gamma_now, draft = 0, Draft.empty()
            else:
                if not params.greedy:
                    key, key_draft, key_verify = mx.random.split(key, 3)
                # 1. choose γ; the round adds one token of the target's own, hence the - 1
                gamma_now = min(policy.choose(stats), self.max_gamma, max_tokens - generated - 1)
                # 2. draft
                draft = drafter.propose(gamma_now, history, key_draft) if drafting else Draft.empty()
                gamma_now = draft.tokens.shape[0]
                if self.profile:
                    mx.eval(draft.tokens)
                # 3. one target pass over [last, x_1..x_γ], then 4. accept (lazily)
                block = mx.concatenate([mx.array([last], mx.uint32), draft.tokens])
                verdict = self._verify(cache, block, draft, history, None, processor, key_verify)
            x = draft.tokens
            drafted = perf_counter()
            # 4b. another plain round next? Queue its pass, fed this round's token, so the
            # device computes it while the host waits below.
            if gamma_now == 0 and generated + 1 < max_tokens and (not drafting or policy.choose(stats) == 0):
                if not params.greedy:
                    key, key_verify = mx.random.split(key)
                block = verdict[-1].astype(mx.uint32).reshape(1)  # this round's token, lazily
                queued = self._verify(cache, block, Draft.empty(), history, block, processor, key_verify)
                mx.async_eval(queued)
            mx.eval(verdict, x)  # the round's one host synchronisation
            drafts = x.tolist()
            if params.greedy:  # verdict: the target's own choice at each position
                n, token = verify_greedy(drafts, verdict[0].tolist())
            else:  # verdict: (n, recovered or bonus token)
                n, token = verdict[0].item(), verdict[1].item()
            emitted = drafts[:n] + [token]
            # 5. stop conditions, exact mid-block
            finish = None
            for i, t in enumerate(emitted):
                if t in self.eos_ids:
                    emitted, finish = emitted[: i + 1], "stop"
                    break
            if finish is None and generated + len(emitted) >= max_tokens:
                emitted, finish = emitted[: max_tokens - generated], "length"
            if finish:
                queued = None  # not needed: settle() below forgets its position
            # 6. roll back: the target keeps [last] + emitted minus the new last token
            cache.target.settle(([last] + emitted)[:-1], queued=1 if queued else 0)
            if drafting:
                drafter.accept(emitted)
            history.extend(emitted)
            last, generated = emitted[-1], generated + len(emitted)
            policy.observe(gamma_now, n)
            stats.observe_round(gamma_now, n, len(emitted), drafted - start, perf_counter() - drafted)
            stats.draft_forwards += gamma_now * drafter.passes_per_token if drafting else 0
            stats.peak_memory = max(stats.peak_memory, mx.get_peak_memory())
            yield Round(emitted, gamma_now, n, finish)
            if finish:
                return

    def _verify(self, cache, block, draft, history, unseen, processor, key) -> tuple:
        """Steps 3 and 4 without the sync: the target pass over `block` ([last, x_1..x_γ])
        and, lazily, what the acceptance rule needs from the device: greedy, the target's
        argmax at every position (compared on the host); sampled, (n, token). Its last
        entry ends with the round's token when γ = 0. `unseen`: tokens after `history` not
        yet on the host (a queued round's input), for the repetition penalty."""
        logits = cache.target.forward(block)
        windows = None
        if processor.params.penalized:
            lead = 0 if unseen is None else unseen.shape[0]
            after = draft.tokens if unseen is None else mx.concatenate([unseen, draft.tokens])
            windows = processor.windows(history, after, lead + block.shape[0], first=lead)
        if processor.params.greedy:
            return (processor.greedy(logits, windows),)
        p = processor.distribution(logits, windows)
        return verify_sampled(draft.tokens, draft.q, p, key)

    def _can_draft(self, cache: PromptCache) -> bool:
        for name, ok in (("target", cache.target.rollbackable), ("draft", self.drafter.rollbackable)):
            if not ok:
                warnings.warn(
                    f"the {name} model's cache cannot roll back exactly (recurrent layers); "
                    "decoding without drafting (γ = 0)",
                    stacklevel=3,
                )
                return False
        return True
