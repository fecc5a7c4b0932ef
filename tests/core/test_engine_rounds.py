"""Round mechanics: stop conditions mid-block, statistics per position, prompt-cache reuse."""

import mlx.core as mx
import pytest
from conftest import greedy_reference

from mlx_spec.core.engine import Engine
from mlx_spec.core.sampling import SamplingParams
from mlx_spec.core.stats import Stats
from mlx_spec.drafters import Draft, Drafter, ModelDrafter, NgramDrafter
from mlx_spec.testing.tiny import TINY_VOCAB

PROMPT = [2, 60, 61, 62, 63, 64]


def collect(engine, prompt=PROMPT, **kwargs):
    rounds = list(engine.rounds(prompt, **kwargs))
    return [t for r in rounds for t in r.tokens], rounds


class ScriptedDrafter(Drafter):
    """Proposes, for each round, the target's own greedy continuation with the tokens at
    the given positions replaced by a wrong token: position-wise acceptance is known."""

    name = "scripted"

    def __init__(self, reference, prompt_len, wrong_positions):
        self.reference, self.prompt_len, self.wrong = reference, prompt_len, set(wrong_positions)

    def begin(self, prompt_ids, prompt_cache, processor):
        self.done = len(prompt_ids) - self.prompt_len
        return 0

    def propose(self, gamma, history, key):
        truth = self.reference[self.done : self.done + gamma]
        tokens = [(t + 1) % 200 + 6 if i in self.wrong else t for i, t in enumerate(truth)]
        return Draft(mx.array(tokens, mx.uint32))

    def accept(self, committed, target_hidden=None):
        self.done += len(committed)


def test_per_position_acceptance_on_a_constructed_case(tiny_target):
    reference = greedy_reference(tiny_target, PROMPT, 60)
    stats = Stats()
    drafter = ScriptedDrafter(reference, len(PROMPT), wrong_positions=[2])
    tokens, rounds = collect(Engine(tiny_target, drafter), gamma=4, max_tokens=40, stats=stats)
    assert tokens == reference[:40]
    # every round: drafts 1, 2 right, 3 wrong -> n = 2, then the target's own token
    assert all(r.accepted == 2 for r in rounds[:-1])
    assert stats.acceptance_by_position[:3] == [1.0, 1.0, 0.0]
    assert stats.conditional_acceptance[:3] == [1.0, 1.0, 0.0]
    assert stats.mean_accepted_length == pytest.approx(1 + stats.accepted / stats.rounds)
    assert stats.acceptance_rate == pytest.approx(stats.accepted / stats.drafted)
    assert stats.target_forwards == stats.rounds == len(rounds)
    assert stats.generated == 40


def test_eos_inside_an_accepted_block_stops_there(tiny_target):
    reference = greedy_reference(tiny_target, PROMPT, 40)
    eos_at = 9
    eos = reference[eos_at]
    assert eos not in reference[:eos_at]
    # the target drafting for itself: every block is accepted, so EOS lands mid-block
    engine = Engine(tiny_target, ModelDrafter(tiny_target, TINY_VOCAB), eos_ids=[eos])
    tokens, rounds = collect(engine, gamma=5, max_tokens=40)
    assert tokens == reference[: eos_at + 1]
    assert rounds[-1].finish_reason == "stop"
    assert rounds[-1].accepted == 5 and len(rounds[-1].tokens) < 6  # cut inside the block


@pytest.mark.parametrize("max_tokens", [1, 2, 7, 13])
def test_max_tokens_is_exact_mid_block(tiny_target, max_tokens):
    reference = greedy_reference(tiny_target, PROMPT, 20)
    engine = Engine(tiny_target, ModelDrafter(tiny_target, TINY_VOCAB))
    tokens, rounds = collect(engine, gamma=5, max_tokens=max_tokens)
    assert tokens == reference[:max_tokens]
    assert rounds[-1].finish_reason == "length"
    assert all(r.finish_reason is None for r in rounds[:-1])


def test_draft_equal_to_target_accepts_everything_at_temperature_one(tiny_target):
    stats = Stats()
    engine = Engine(tiny_target, ModelDrafter(tiny_target, TINY_VOCAB))
    params = SamplingParams(temperature=1.0, seed=11)
    collect(engine, params=params, gamma=4, max_tokens=80, stats=stats)
    assert stats.drafted > 50
    assert stats.accepted == stats.drafted
    assert stats.acceptance_by_position == [1.0] * 4


def test_prompt_cache_carries_across_calls(tiny_target, tiny_draft):
    engine = Engine(tiny_target, ModelDrafter(tiny_draft, TINY_VOCAB))
    cache = engine.make_prompt_cache()
    first, _ = collect(engine, gamma=3, max_tokens=30, prompt_cache=cache)
    # the second turn extends the first: prompt + answer + new tokens
    follow_up = PROMPT + first + [4, 70, 71, 72, 5]
    stats = Stats()
    second, _ = collect(engine, follow_up, gamma=3, max_tokens=30, prompt_cache=cache, stats=stats)
    assert stats.prompt_tokens == len(follow_up)
    # only the unseen tokens were processed, by the target and by the draft
    assert stats.prefill_tokens <= 2 * 6
    assert second == greedy_reference(tiny_target, follow_up, 30)


def test_seed_reproduces_sampled_output(tiny_target, tiny_draft):
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=5)
    runs = [collect(Engine(tiny_target, ModelDrafter(tiny_draft, TINY_VOCAB)), params=params, gamma=3, max_tokens=30)[0] for _ in range(2)]
    assert runs[0] == runs[1]
    other = collect(Engine(tiny_target, ModelDrafter(tiny_draft, TINY_VOCAB)), params=SamplingParams(temperature=0.8, top_p=0.9, seed=6), gamma=3, max_tokens=30)[0]
    assert other != runs[0]


def test_ngram_drafter_proposes_what_followed_and_continues_periods():
    drafter = NgramDrafter(max_ngram=3, min_ngram=1)
    drafter.begin([5, 6, 7, 8, 9, 5, 6, 7], None, None)
    assert drafter.propose(3).tokens.tolist() == [8, 9, 5]
    drafter.accept([8])
    assert drafter.propose(2).tokens.tolist() == [9, 5]
    drafter.begin([1, 2, 3, 3, 3], None, None)  # a period-1 tail: the copy reads its own output
    assert drafter.propose(4).tokens.tolist() == [3, 3, 3, 3]
    drafter.begin([1, 2, 3, 4], None, None)
    assert drafter.propose(4).tokens.tolist() == []
    drafter.begin([7, 1, 2, 9, 1, 2], None, None)  # the longest suffix wins
    assert drafter.propose(1).tokens.tolist() == [9]


def test_empty_prompt_is_a_clear_error(tiny_target):
    from mlx_spec.errors import MlxSpecError

    with pytest.raises(MlxSpecError, match="empty"):
        collect(Engine(tiny_target), prompt=[])


@pytest.mark.parametrize("drafter_kind", ["model", "ngram"])
def test_repetition_penalty_is_applied_alike_on_every_path(tiny_target, tiny_draft, drafter_kind):
    """Greedy with a repetition penalty: drafted rows, verified rows and queued plain rounds
    each see their own token history, so every γ gives plain decoding's output."""
    params = SamplingParams(repetition_penalty=1.5, repetition_context=8)
    plain, _ = collect(Engine(tiny_target), params=params, gamma=0, max_tokens=40)
    unpenalized, _ = collect(Engine(tiny_target), gamma=0, max_tokens=40)
    assert plain != unpenalized  # the penalty changes the text
    for gamma in (1, 3, 5):
        drafter = ModelDrafter(tiny_draft, TINY_VOCAB) if drafter_kind == "model" else NgramDrafter()
        tokens, _ = collect(Engine(tiny_target, drafter), params=params, gamma=gamma, max_tokens=40)
        assert tokens == plain


def test_plain_rounds_are_pipelined_and_exact(tiny_target):
    """γ = 0 queues each next pass before waiting: output equals mlx-lm, caches hold the
    committed tokens after stops at EOS and at max_tokens."""
    reference = greedy_reference(tiny_target, PROMPT, 30)
    engine = Engine(tiny_target, eos_ids=[reference[20]])
    cache = engine.make_prompt_cache()
    tokens, _ = collect(engine, gamma=0, max_tokens=30, prompt_cache=cache)
    assert tokens == reference[: reference.index(reference[20]) + 1]
    assert cache.target.ids == PROMPT + tokens[:-1] and cache.target.unsettled == 0
    tokens, _ = collect(Engine(tiny_target), gamma=0, max_tokens=17, prompt_cache=cache)
    assert tokens == reference[:17]
    assert cache.target.ids == PROMPT + tokens[:-1] and cache.target.unsettled == 0
