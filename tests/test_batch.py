"""A continuous batch (`mlx_spec.batch`): several requests' verify passes in one target
forward, each request exact as if alone.

Greedy answers are compared with mlx-lm's own plain decoding (`generate_step`) and with
the same request decoded alone; the batched pass's logits with each row's own pass alone
(so no padding or neighbour leaks in); at temperature 1 each row of a batch of four must
fit the target's exact distribution (chi-square), and a broken acceptance rule must not.
"""

import mlx.core as mx
import pytest

import mlx_spec.engine as engine_module
from conftest import greedy_reference
from mlx_spec.batch import Batch, TargetPass, run_passes
from mlx_spec.cache import SequenceCache
from mlx_spec.drafters import ModelDrafter, NgramDrafter
from mlx_spec.engine import Engine
from mlx_spec.sampling import SamplingParams
from mlx_spec.stats import Stats
from mlx_spec.testing.tiny import TINY_VOCAB
from test_distribution import PARAMS, VOCAB, chi_square, exact_joint, models, recovered_from_p  # noqa: F401

WINDOW = 16  # the tiny models' sliding window
MAX_TOKENS = 40
PROMPTS = [
    [2, 40, 41, 42, 43, 44, 45, 40, 41],  # shorter than the window
    [2] + [(7 * i) % 250 + 6 for i in range(44)],  # longer than the window
    [2, 9, 8, 7],
    [2] + [40, 41, 42, 43] * 6,  # repetitive: n-gram drafts get accepted
]


def batched(requests, joins, out):
    """Drive `requests` (round generators) in one `Batch`, request i joining before step
    joins[i]; returns the rows of each step's forward."""
    batch, rows, step = Batch(out=lambda generator, r: out[generator].extend(r.tokens)), [], 0
    pending = sorted(zip(joins, range(len(requests))))
    while pending or len(batch):
        while pending and pending[0][0] <= step:
            batch.add(requests[pending.pop(0)[1]])
        rows.append(len(batch.step()))
        step += 1
    return rows


def drafter(kind, tiny_draft):
    return {"model": lambda: ModelDrafter(tiny_draft, TINY_VOCAB), "ngram": NgramDrafter, "none": lambda: None}[kind]()


def test_batched_greedy_answers_equal_plain_decoding_and_each_alone(tiny_target, tiny_draft):
    setups = [("model", 3), ("ngram", 2), ("none", 0), ("model", 5)]
    joins = [0, 0, 2, 5]
    out, requests, stats = {}, [], []
    for prompt, (kind, gamma) in zip(PROMPTS, setups):
        stats.append(Stats())
        rounds = Engine(tiny_target, drafter(kind, tiny_draft)).rounds(
            prompt, gamma=gamma, max_tokens=MAX_TOKENS, stats=stats[-1], batched=True)
        out[rounds] = []
        requests.append(rounds)
    rows = batched(requests, joins, out)
    assert max(rows) == 4  # all four really shared forwards
    for prompt, (kind, gamma), rounds, seen in zip(PROMPTS, setups, requests, stats):
        alone = [t for r in Engine(tiny_target, drafter(kind, tiny_draft)).rounds(
            prompt, gamma=gamma, max_tokens=MAX_TOKENS) for t in r.tokens]
        assert out[rounds] == greedy_reference(tiny_target, prompt, MAX_TOKENS) == alone
        assert len(prompt) + MAX_TOKENS > WINDOW
        if kind == "model":
            assert 0 < seen.accepted < seen.drafted  # it speculated, with rejections


def test_a_long_prompt_is_prefilled_a_chunk_a_step_while_the_others_decode(tiny_target):
    """A 600-token prompt in chunks of 64 takes ten steps to prefill; a short request that
    joins at the next step is answered whole meanwhile (six plain rounds: no n-gram
    matches), and both answers stay exact."""
    engine = Engine(tiny_target, NgramDrafter(), prefill_chunk=64)
    long_prompt = [2] + [(11 * i) % 250 + 6 for i in range(600)]
    lengths = (8, 6)
    requests = [engine.for_request().rounds(prompt, gamma=2, max_tokens=n, batched=True)
                for prompt, n in zip((long_prompt, PROMPTS[2]), lengths)]
    out, ended, step = {r: [] for r in requests}, {}, [0]

    def collect(generator, r):
        out[generator].extend(r.tokens)
        if r.finish_reason:
            ended[generator] = step[0]

    batch = Batch(out=collect)
    batch.add(requests[0])
    while len(batch):
        if step[0] == 1:
            batch.add(requests[1])
        batch.step()
        step[0] += 1
    assert ended[requests[1]] < 9 < ended[requests[0]]  # the long one's first pass: step 9
    for prompt, rounds, n in zip((long_prompt, PROMPTS[2]), requests, lengths):
        assert out[rounds] == greedy_reference(tiny_target, prompt, n)


def prefilled(model, prompt):
    cache = SequenceCache(model, slack=9)
    cache.prefill(prompt)
    return cache


@pytest.mark.parametrize("neighbour", [0, 2, 3])
def test_a_rows_logits_and_cache_do_not_depend_on_its_neighbours(tiny_target, neighbour):
    """Row 0 (past the window, a 2-token block) beside neighbours of other lengths, block
    widths and window states: its logits equal its pass alone, and after each row keeps one
    position and rolls back the rest (padding included), its next pass does too."""
    blocks = [[5, 6], [7, 8, 9, 10, 11, 12], [13], [14, 15, 16, 17]]
    rows = [prefilled(tiny_target, p) for p in PROMPTS]
    alone = [prefilled(tiny_target, p) for p in PROMPTS]
    order = [0] + [i for i in range(1, 4) if i != neighbour] if neighbour else [0, 1, 2, 3]
    for round_ in range(2):
        together = [TargetPass(rows[i], mx.array(blocks[i], mx.uint32)) for i in order]
        run_passes(together)
        for i, batched_pass in zip(order, together):
            single = TargetPass(alone[i], mx.array(blocks[i], mx.uint32))
            single.run()
            assert batched_pass.logits.shape == single.logits.shape
            assert mx.allclose(batched_pass.logits, single.logits, atol=1e-4).item(), (round_, i)
            rows[i].settle(blocks[i][:1])
            alone[i].settle(blocks[i][:1])


ROW_PROMPTS = [[2, 5, 3, 5, 1], [2, 5, 3, 5, 1, 4, 6, 0, 7], [3, 1, 1], [2, 5, 3, 5, 1]]
ROW_SETUPS = [("model", 3), ("ngram", 2), ("model", 1), ("none", 0)]
DRAWS = 400  # ~20 s on a quiet 2-core CPU
BROKEN_DRAWS = 250  # row 0's drafts meet many rejections: the broken rule shows at once


def exact_joints(target, params):
    """P(t1, t2) for each row's prompt under plain sampling from the target, computed."""
    return [exact_joint(target, params, prompt) for prompt in ROW_PROMPTS]


def sampled_joints(target, draft, params, draws):
    """Each draw decodes the four rows (their own seeds, drafters, γ) in one batch."""
    counts = [{} for _ in ROW_PROMPTS]
    kinds = {"model": lambda: ModelDrafter(draft, VOCAB), "ngram": lambda: NgramDrafter(min_ngram=1),
             "none": lambda: None}
    engines = [Engine(target, kinds[kind]()) for kind, _ in ROW_SETUPS]
    caches = [engine.make_prompt_cache() for engine in engines]
    for draw in range(draws):
        out, requests = {}, []
        for row, (engine, cache, prompt, (_, gamma)) in enumerate(zip(engines, caches, ROW_PROMPTS, ROW_SETUPS)):
            run = SamplingParams(**{**params.__dict__, "seed": draw * 4 + row})
            rounds = engine.rounds(prompt, run, gamma=gamma, max_tokens=max(gamma + 1, 2), prompt_cache=cache,
                                   batched=True)
            out[rounds] = []
            requests.append(rounds)
        rows = batched(requests, [0] * 4, out)
        assert rows[0] == 4
        for row, rounds in enumerate(requests):
            key = tuple(out[rounds][:2])
            counts[row][key] = counts[row].get(key, 0) + 1
    return counts


def test_each_row_of_a_batch_of_four_samples_the_target_distribution(models):
    target, draft = models
    params = SamplingParams(**PARAMS)
    for counts, joint in zip(sampled_joints(target, draft, params, DRAWS), exact_joints(target, params)):
        stat, critical = chi_square(counts, joint)
        assert stat < critical


@pytest.mark.slow  # ~12 s quiet, more under load: the check's power, shown once
def test_the_batched_check_catches_a_broken_rule(models, monkeypatch):
    target, draft = models
    params = SamplingParams(**PARAMS)
    monkeypatch.setattr(engine_module, "verify_sampled", recovered_from_p)
    counts = sampled_joints(target, draft, params, BROKEN_DRAWS)[0]
    stat, critical = chi_square(counts, exact_joints(target, params)[0])
    assert stat > critical  # row 0: a model drafter at γ = 3, where the rule breaks most
