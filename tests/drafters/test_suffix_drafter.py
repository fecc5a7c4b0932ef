"""The suffix drafter (`mlx_spec.drafters.suffix`) and its token memory
(`mlx_spec.drafters.token_memory`).

The index is checked against a brute-force scan of the same tokens (every earlier
position, its match length and what followed), through eviction, growth and separators.
Greedy output is mlx-lm's plain decoding (`generate_step`) with the drafter alone, as a
tree, in a batch and on a repeated request (where its drafts come from the memory and are
accepted); a fork shares its memory (not a copy), another memory or none isolates.
"""

import random

import numpy as np
import pytest

from batch_support import batched
from conftest import greedy_reference
from trees_support import flat_policy

from mlx_spec.core.engine import Engine
from mlx_spec.core.stats import Stats
from mlx_spec.drafters import DRAFTERS, SuffixDrafter
from mlx_spec.drafters.token_memory import SEPARATOR, Memories, TokenIndex

SHORT_PROMPT = [2, 40, 41, 42, 43, 44, 45, 40, 41]  # shorter than the tiny models' window (16)
LONG_PROMPT = [2] + [(7 * i) % 250 + 6 for i in range(44)]
MAX_TOKENS = 48


def run(engine, prompt, gamma, max_tokens=MAX_TOKENS, **kwargs):
    stats = Stats()
    tokens = [t for r in engine.rounds(prompt, gamma=gamma, max_tokens=max_tokens, stats=stats, **kwargs)
              for t in r.tokens]
    return tokens, stats


def brute_matches(seq, start, end, context, depth, grams):
    """(position, match length) of every held position whose match is at least the longest
    gram that matched anywhere, as `TokenIndex.lookup` should find them (no limit)."""
    def match(p):
        m = 0
        while m < min(depth, len(context)) and p - m >= start and seq[p - m] == context[-1 - m]:
            m += 1
        return m

    for g in sorted(grams, reverse=True):
        found = [(p, match(p)) for p in range(start, end) if match(p) >= g]
        if len(context) >= g and found:
            return sorted(found)
    return []


@pytest.mark.parametrize("seed", range(6))
def test_index_finds_what_a_brute_force_scan_finds(seed):
    rng = random.Random(seed)
    for _ in range(40):
        vocab = rng.choice([3, 5, 20])
        index = TokenIndex(rng.choice([50, 1000]), grams=(2, 4), bucket_bits=rng.choice([2, 8]),
                           growable=rng.random() < 0.3)
        seq = []
        for _ in range(rng.randint(1, 6)):
            if rng.random() < 0.3:
                index.separate()
                if seq and seq[-1] != SEPARATOR:
                    seq.append(SEPARATOR)
            chunk = [rng.randrange(vocab) for _ in range(rng.randint(0, 80))]
            step = rng.choice([1, 3, 40])  # a few at a time (a round's commit), or in bulk
            for i in range(0, len(chunk), step):
                index.extend(chunk[i : i + step])
                seq += chunk[i : i + step]
        assert index.end == len(seq) and len(index) == min(len(seq), index.capacity)
        held = range(index.start, index.end)
        assert index.at(np.array(held, np.int64)).tolist() == [seq[p] for p in held]
        context = [rng.randrange(vocab) for _ in range(rng.randint(0, 8))]
        found = index.lookup(context, depth=8, length=3, limit=10**6)
        assert sorted(zip(found.ends.tolist(), found.lengths.tolist())) == brute_matches(
            seq, index.start, index.end, context, 8, (2, 4))
        for end, row in zip(found.ends.tolist(), found.follow.tolist()):
            after = [seq[q] if q < len(seq) else SEPARATOR for q in range(end + 1, end + 4)]
            cut = after.index(SEPARATOR) if SEPARATOR in after else 3
            assert row == after[:cut] + [SEPARATOR] * (3 - cut)


def test_memory_is_bounded_and_evicts_the_oldest():
    memories = Memories(tokens=1000)
    memory = memories.get()
    rng = random.Random(1)
    requests = [[rng.randrange(5000) for _ in range(300)] for _ in range(6)]
    for text in requests:
        memory.remember(text[:100], text[100:])
    assert len(memory) == 1000
    oldest, newest = requests[0], requests[-1]
    assert memory.lookup(oldest[:40], depth=32, length=4).ends.size == 0
    found = memory.lookup(newest[:140], depth=32, length=4)
    assert found.lengths.max() == 32 and found.follow[0].tolist() == newest[140:144]
    assert Memories(tokens=0).get() is None


def test_a_resent_conversation_adds_only_its_new_turn():
    memory = Memories(tokens=10_000).get()
    first = list(range(100, 400))
    memory.remember(first, [7, 8, 9])
    before = len(memory)
    memory.remember(first + [7, 8, 9] + list(range(500, 520)), [1, 2])
    assert len(memory) - before < 3 + 20 + 2 + 16 + 4  # the turn, its overlap and separators


def test_the_latest_occurrence_outvotes_an_older_majority():
    """A line rewritten with a change: the old version thrice, then the new one. The drafter
    drafts what the text did last, as the n-gram drafter does, this request's text over the
    memory's; plain counts followed the old majority (bench/suffix_replay.py: an editing
    turn where the suffix drafter took a forward more than n-gram)."""
    line, old, new = [10, 11, 12, 13, 14, 15, 16, 17], [20, 21, 22], [30, 31, 32]
    drafter = SuffixDrafter()
    drafter.begin((line + old) * 3 + line + new + line)
    assert drafter.propose(3).tokens.tolist() == new
    remembering = SuffixDrafter()
    for _ in range(3):
        remembering.memory.remember(line + old, [])
    remembering.begin([5] + line + new + line)
    assert remembering.propose(3).tokens.tolist() == new
    remembering.begin([5] + line)  # where this request has no vote, the memory's majority drafts
    assert remembering.propose(3).tokens.tolist() == old


@pytest.mark.parametrize("prompt", [SHORT_PROMPT, LONG_PROMPT], ids=["short", "long"])
@pytest.mark.parametrize("gamma", [1, 3, 8])
def test_greedy_matches_plain_decoding_first_and_repeated(tiny_target, prompt, gamma):
    reference = greedy_reference(tiny_target, prompt, MAX_TOKENS)
    engine = Engine(tiny_target, SuffixDrafter())
    first, _ = run(engine, prompt, gamma)
    again, stats = run(engine, prompt, gamma)
    assert first == again == reference
    # the repeat drafts the first answer from the memory, and the target takes it
    assert stats.accepted_from.get("memory", 0) > 0 and stats.accepted >= MAX_TOKENS // 2
    assert stats.target_forwards <= MAX_TOKENS // 2
    assert sum(stats.drafted_from.values()) == stats.drafted and sum(stats.accepted_from.values()) == stats.accepted


def test_greedy_trees_match_plain_decoding(tiny_target):
    """Two earlier answers to the prompt that part after five tokens: the drafter branches
    there (equal counts, both likely enough), and the tree's verify keeps the target's."""
    reference = greedy_reference(tiny_target, SHORT_PROMPT, MAX_TOKENS)
    drafter = SuffixDrafter()
    drafter.memory.remember(SHORT_PROMPT, reference)
    drafter.memory.remember(SHORT_PROMPT, reference[:5] + [(t + 1) % 200 for t in reference[5:]])
    tokens, stats = run(Engine(tiny_target, drafter), SHORT_PROMPT, flat_policy(max_gamma=8))
    assert tokens == reference
    assert stats.tree_rounds > 0 and stats.tried_at_rank[1:] and stats.accepted > MAX_TOKENS // 2


def test_batched_forks_share_one_memory_and_match_plain_decoding(tiny_target):
    engine = Engine(tiny_target, SuffixDrafter())
    run(engine, SHORT_PROMPT, 3)  # remembered by the engine's drafter
    twins = [engine.for_request() for _ in range(3)]
    assert all(t.drafter.memory is engine.drafter.memory for t in twins)  # shared, not copied
    prompts = [SHORT_PROMPT, LONG_PROMPT, [2] + [40, 41, 42, 43] * 6]
    out, requests, stats = {}, [], []
    for twin, prompt in zip(twins, prompts):
        stats.append(Stats())
        rounds = twin.rounds(prompt, gamma=3, max_tokens=MAX_TOKENS, stats=stats[-1], batched=True)
        out[rounds] = []
        requests.append(rounds)
    assert max(batched(requests, [0, 0, 1], out)) == 3
    for prompt, rounds in zip(prompts, requests):
        assert out[rounds] == greedy_reference(tiny_target, prompt, MAX_TOKENS)
    assert stats[0].accepted_from.get("memory", 0) > 0  # the first request's answer, remembered before
    # each batched request was remembered in the one memory when it ended
    alone, again = run(engine, LONG_PROMPT, 3)
    assert again.accepted_from.get("memory", 0) > 0


def test_another_memory_or_none_learns_nothing_from_this_one(tiny_target):
    engine = Engine(tiny_target, SuffixDrafter())
    run(engine, LONG_PROMPT, 3)
    for memory in (Memories().get("another tenant"), None):
        tokens, stats = run(engine.for_request(memory=memory), LONG_PROMPT, 3)
        assert tokens == greedy_reference(tiny_target, LONG_PROMPT, MAX_TOKENS)
        assert stats.drafted_from.get("memory", 0) == 0


def test_registered_under_its_name():
    assert DRAFTERS["suffix"] is SuffixDrafter
