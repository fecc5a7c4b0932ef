"""A continuous batch (`mlx_spec.core.batch`): several requests' verify passes in one target
forward, and their draft models' steps in one draft forward, each request exact as if alone.

Greedy answers are compared with mlx-lm's own plain decoding (`generate_step`) and with
the same request decoded alone; the batched pass's logits with each row's own pass alone
(so no padding or neighbour leaks in); at temperature 1 each row of a batch of four must
fit the target's exact distribution (chi-square), and a broken acceptance rule must not.
"""

import mlx.core as mx
import pytest
from batch_support import (  # noqa: F401
    ROW_PROMPTS,  # noqa: F401
    batched,
    exact_joints,
    sampled_joints,
)
from conftest import greedy_reference, recorded_verify_passes
from distribution_support import PARAMS, VOCAB, chi_square, exact_joint, models, recovered_from_p  # noqa: F401
from grammar_support import ADDRESS, EOS, TOKENIZER, constrained_reference
from grammar_support import PROMPT as ADDRESS_PROMPT
from trees_support import BRANCHING_PROMPT

import mlx_spec.core.verify as verify_module
from mlx_spec.cache.layers import KVQuantization
from mlx_spec.cache.sequence import SequenceCache
from mlx_spec.core.batch import Batch
from mlx_spec.core.cost_model import CostCurve
from mlx_spec.core.engine import Engine
from mlx_spec.core.grammar import compile_grammar
from mlx_spec.core.passes import TargetPass, run_passes
from mlx_spec.core.policy import AutoGamma, TreePolicy
from mlx_spec.core.sampling import SamplingParams
from mlx_spec.core.stats import Stats
from mlx_spec.drafters import ModelDrafter, NgramDrafter
from mlx_spec.testing.tiny import TINY_VOCAB

WINDOW = 16  # the tiny models' sliding window
MAX_TOKENS = 40
PROMPTS = [
    [2, 40, 41, 42, 43, 44, 45, 40, 41],  # shorter than the window
    [2] + [(7 * i) % 250 + 6 for i in range(44)],  # longer than the window
    [2, 9, 8, 7],
    [2] + [40, 41, 42, 43] * 6,  # repetitive: n-gram drafts get accepted
]



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


def auto_gamma():
    """Auto γ on a flat cost curve, from acceptance alone (no clock): the same choices in a
    batch as alone."""
    return AutoGamma(CostCurve(verify=[1.0 + 0.02 * w for w in range(7)], draft_step=0.05, context=256),
                     learn_costs=False)


def test_batched_draft_model_rows_equal_plain_decoding_and_each_alone(tiny_target, tiny_draft):
    """Four draft-model rows (γ 3, 0, auto, 5) whose draft steps share forwards, joining at
    different rounds past the sliding window (the 45-token prompt prefilled in chunks of 16
    while the others draft): each answer is mlx-lm's greedy decoding and the request's
    alone, with the same drafts accepted and rejected (the batched draft forward drafted
    what the row's own would have)."""
    gammas = [3, 0, auto_gamma, 5]
    joins = [0, 1, 1, 4]
    out, requests, stats = {}, [], []
    for prompt, gamma in zip(PROMPTS, gammas):
        stats.append(Stats())
        rounds = Engine(tiny_target, ModelDrafter(tiny_draft, TINY_VOCAB), prefill_chunk=16).rounds(
            prompt, gamma=gamma() if callable(gamma) else gamma, max_tokens=MAX_TOKENS, stats=stats[-1],
            batched=True)
        out[rounds] = []
        requests.append(rounds)
    assert max(batched(requests, joins, out)) == 4
    for prompt, gamma, rounds, seen in zip(PROMPTS, gammas, requests, stats):
        alone = Stats()
        tokens = [t for r in Engine(tiny_target, ModelDrafter(tiny_draft, TINY_VOCAB)).rounds(
            prompt, gamma=gamma() if callable(gamma) else gamma, max_tokens=MAX_TOKENS, stats=alone)
            for t in r.tokens]
        assert out[rounds] == greedy_reference(tiny_target, prompt, MAX_TOKENS) == tokens
        assert (seen.drafted, seen.accepted) == (alone.drafted, alone.accepted)
        if gamma:
            assert 0 < seen.accepted < seen.drafted


def counting_calls(model, monkeypatch):
    """A list that gets one entry per forward of `model` (its class's other instances uncounted)."""
    calls, real = [], type(model).__call__

    def counted(self, *args, **kwargs):
        if self is model:
            calls.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(type(model), "__call__", counted)
    return calls


def test_a_batchs_draft_step_is_one_draft_forward_for_all_its_rows(tiny_target, tiny_draft, monkeypatch):
    """Four rows at γ = 3: after the first step (each row's draft prefill), a step costs the
    draft model one forward per draft step, not one per row and step."""
    requests = [Engine(tiny_target, ModelDrafter(tiny_draft, TINY_VOCAB)).rounds(
        prompt, gamma=3, max_tokens=12, batched=True) for prompt in PROMPTS]
    calls = counting_calls(tiny_draft, monkeypatch)
    batch, per_step, rows = Batch(), [], []
    for rounds in requests:
        batch.add(rounds)
    while len(batch):
        before = len(calls)
        rows.append(len(batch.step()))
        per_step.append(len(calls) - before)
    assert rows[1] == 4 and per_step[1] == 3
    assert all(n <= 3 for n in per_step[1:])


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


def test_a_grammar_row_and_a_draft_model_row_answer_as_alone(tiny_target, tiny_draft):
    """A row whose draft chain ends early under a JSON schema (a host sync per draft step)
    beside a draft-model row without one: each answers as it does alone, the constrained
    one as mlx-lm's decoding masked by llguidance."""
    def requests(batched):
        grammar = compile_grammar(TOKENIZER, "json_schema", ADDRESS, EOS).matcher(EOS)
        engines = [Engine(tiny_target, ModelDrafter(tiny_draft, TINY_VOCAB), eos_ids=EOS) for _ in range(2)]
        return [engines[0].rounds(ADDRESS_PROMPT, gamma=4, max_tokens=90, constraint=grammar, batched=batched),
                engines[1].rounds(PROMPTS[1], gamma=3, max_tokens=MAX_TOKENS, batched=batched)]

    together = requests(batched=True)
    out = {rounds: [] for rounds in together}
    assert max(batched(together, [0, 0], out)) == 2
    alone = [[t for r in rounds for t in r.tokens] for rounds in requests(batched=False)]
    assert [out[rounds] for rounds in together] == alone
    assert alone[0] == constrained_reference(tiny_target, ADDRESS_PROMPT, ADDRESS, 90)
    assert alone[1] == greedy_reference(tiny_target, PROMPTS[1], MAX_TOKENS)


def test_rows_with_quantized_kv_answer_as_alone(tiny_target, tiny_draft):
    """With --kv-bits and --draft-kv-bits (4-bit from the first token) every row still
    switches its caches to quantized K/V where it would alone (a batch's forward cannot
    stack packed K/V, so such rows run their passes one after another)."""
    kv = KVQuantization(4, 32)

    def requests(batched):
        return [Engine(tiny_target, ModelDrafter(tiny_draft, TINY_VOCAB), kv=kv, draft_kv=kv).rounds(
            prompt, gamma=3, max_tokens=MAX_TOKENS, batched=batched) for prompt in PROMPTS[:2]]

    together = requests(batched=True)
    out = {rounds: [] for rounds in together}
    batched(together, [0, 0], out)
    alone = [[t for r in rounds for t in r.tokens] for rounds in requests(batched=False)]
    assert [out[rounds] for rounds in together] == alone
    assert alone[1] != greedy_reference(tiny_target, PROMPTS[1], MAX_TOKENS)  # 4 bits tell


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


ROW_SETUPS = [("model", 3), ("ngram", 2), ("model", 1), ("model", 2)]  # three share draft forwards
DRAWS = 400  # ~20 s on a quiet 2-core CPU
BROKEN_DRAWS = 250  # row 0's drafts meet many rejections: the broken rule shows at once



def row_engines(target, draft):
    kinds = {"model": lambda: ModelDrafter(draft, VOCAB), "ngram": lambda: NgramDrafter(min_ngram=1),
             "none": lambda: None}
    return [Engine(target, kinds[kind]()) for kind, _ in ROW_SETUPS]



def test_each_row_of_a_batch_of_four_samples_the_target_distribution(models):
    target, draft = models
    params = SamplingParams(**PARAMS)
    gammas = [gamma for _, gamma in ROW_SETUPS]
    for counts, joint in zip(sampled_joints(row_engines(target, draft), gammas, params, DRAWS),
                             exact_joints(target, params)):
        stat, critical = chi_square(counts, joint)
        assert stat < critical


@pytest.mark.slow  # ~12 s quiet, more under load: the check's power, shown once
def test_the_batched_check_catches_a_broken_rule(models, monkeypatch):
    target, draft = models
    params = SamplingParams(**PARAMS)
    monkeypatch.setattr(verify_module, "verify_sampled", recovered_from_p)
    counts = sampled_joints(row_engines(target, draft), [gamma for _, gamma in ROW_SETUPS], params, BROKEN_DRAWS)[0]
    stat, critical = chi_square(counts, exact_joints(target, params)[0])
    assert stat > critical  # row 0: a model drafter at γ = 3, where the rule breaks most


def test_a_request_alone_in_its_batch_decodes_as_without_one_until_another_decodes(tiny_target, monkeypatch):
    """Plain decoding alone in a batch prepares the passes it would without a batch (each
    plain round pipelined), and still does while a 600-token prompt that joined is prefilled
    a chunk a step; once that one decodes, the two share forwards and none is queued; once
    it has left, pipelined again. Both answers are mlx-lm's."""
    passes = recorded_verify_passes(monkeypatch)
    engine = Engine(tiny_target, prefill_chunk=64)
    list(engine.rounds(PROMPTS[1], max_tokens=MAX_TOKENS))
    serial, passes[:] = list(passes), []
    assert sum(queued for queued, _ in serial) > MAX_TOKENS // 2

    batch = Batch()
    alone = engine.for_request().rounds(PROMPTS[1], max_tokens=MAX_TOKENS, batched=True, alone=batch.alone)
    out = {alone: []}
    assert max(batched([alone], [0], out, batch)) == 1
    assert out[alone] == greedy_reference(tiny_target, PROMPTS[1], MAX_TOKENS)
    assert passes == serial
    passes[:] = []

    long_prompt = [2] + [(11 * i) % 250 + 6 for i in range(600)]
    batch = Batch()
    requests = [engine.for_request().rounds(prompt, max_tokens=n, batched=True, alone=batch.alone)
                for prompt, n in ((PROMPTS[1], MAX_TOKENS), (long_prompt, 8))]
    out = {r: [] for r in requests}
    batch.out = lambda generator, r: out[generator].extend(r.tokens)
    batch.add(requests[0])
    rows, queued_by_step, prefilling = [], [], []
    while len(batch):
        if len(rows) == 3:
            batch.add(requests[1])
        prefilling.append(requests[1] in batch.prefilling)
        before = len(passes)
        rows.append(len(batch.step()))
        queued_by_step.append([queued for queued, _ in passes[before:]])
    assert sum(prefilling) == 600 // 64  # the steps after each of its chunks but the last
    assert all(True in queued for queued, other in zip(queued_by_step, prefilling) if other)
    shared = [step for step, n in enumerate(rows) if n == 2]  # the long one's 8 rounds
    assert len(shared) == 8 and not any(True in queued_by_step[step] for step in shared)
    assert True in sum(queued_by_step[shared[-1] + 1:], [])  # alone again, pipelined again
    assert out[requests[0]] == greedy_reference(tiny_target, PROMPTS[1], MAX_TOKENS)
    assert out[requests[1]] == greedy_reference(tiny_target, long_prompt, 8)


def tree_policy():
    return TreePolicy(CostCurve([0.01] * 17, 0.0, 256), max_gamma=3, learn_costs=False)


def test_a_request_alone_in_its_batch_drafts_trees_and_chains_beside_others(tiny_target):
    """Under a tree policy an n-gram row draws trees while it is alone in its batch and
    chains while another decodes beside it (a batch's forward takes no tree masks); both
    answers are mlx-lm's, the tree row's also what it answers without a batch."""
    prompt = BRANCHING_PROMPT  # 40 41 42 goes on four ways: the drafts branch
    alone_stats = Stats()
    serial = [t for r in Engine(tiny_target, NgramDrafter()).rounds(
        prompt, gamma=tree_policy(), max_tokens=MAX_TOKENS, stats=alone_stats) for t in r.tokens]
    assert alone_stats.tree_rounds > 0

    batch, stats = Batch(), Stats()
    requests = [Engine(tiny_target, NgramDrafter()).rounds(prompt, gamma=tree_policy(), max_tokens=MAX_TOKENS,
                                                          stats=stats, batched=True, alone=batch.alone),
                Engine(tiny_target, NgramDrafter()).rounds(PROMPTS[3], gamma=2, max_tokens=12, batched=True,
                                                          alone=batch.alone)]
    out, trees = {r: [] for r in requests}, []
    batch.out = lambda generator, r: out[generator].extend(r.tokens)
    batch.add(requests[0])
    rows = []
    while len(batch):
        if len(rows) == 2:
            batch.add(requests[1])
        before = stats.tree_rounds
        rows.append(len(batch.step()))
        trees.append(stats.tree_rounds - before)
    assert sum(trees[:2]) > 0 and max(rows) == 2
    assert not any(n for n, width in zip(trees, rows) if width == 2)
    assert out[requests[0]] == serial == greedy_reference(tiny_target, prompt, MAX_TOKENS)
    assert out[requests[1]] == greedy_reference(tiny_target, PROMPTS[3], 12)


def test_a_seeded_sample_runs_its_rounds_in_the_batch_even_alone(tiny_target, monkeypatch):
    """A seeded request at temperature 1 alone in a batch prepares the passes it prepares
    beside others (no pipelined plain round: that would split its key another way), and
    draws the same tokens."""
    passes = recorded_verify_passes(monkeypatch)
    params = SamplingParams(temperature=1.0, seed=7)
    draws = []
    for alone in (True, False):
        batch = Batch()
        rounds = Engine(tiny_target).rounds(PROMPTS[1], params, max_tokens=MAX_TOKENS, batched=True,
                                            alone=batch.alone if alone else None)
        out = {rounds: []}
        batched([rounds], [0], out, batch)
        draws.append(out[rounds])
    assert draws[0] == draws[1] and not any(queued for queued, _ in passes)
    unseeded = Batch()
    rounds = Engine(tiny_target).rounds(PROMPTS[1], SamplingParams(temperature=1.0), max_tokens=MAX_TOKENS,
                                        batched=True, alone=unseeded.alone)
    batched([rounds], [0], {rounds: []}, unseeded)
    assert any(queued for queued, _ in passes)  # unseeded, its draws depend on nobody's choices: pipelined alone
