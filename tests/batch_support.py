"""Shared by several test modules; moved from test_batch.py."""

from distribution_support import (  # noqa: F401
    PARAMS,
    VOCAB,
    chi_square,
    exact_joint,
    models,
    recovered_from_p,
)

from mlx_spec.core.batch import Batch
from mlx_spec.core.sampling import SamplingParams


def batched(requests, joins, out, batch=None):
    """Drive `requests` (round generators) in one `Batch` (a fresh one unless given),
    request i joining before step joins[i]; returns the rows of each step's forward."""
    batch = batch or Batch()
    batch.out = lambda generator, r: out[generator].extend(r.tokens)
    rows, step = [], 0
    pending = sorted(zip(joins, range(len(requests))))
    while pending or len(batch):
        while pending and pending[0][0] <= step:
            batch.add(requests[pending.pop(0)[1]])
        rows.append(len(batch.step()))
        step += 1
    return rows


def exact_joints(target, params):
    """P(t1, t2) for each row's prompt under plain sampling from the target, computed."""
    return [exact_joint(target, params, prompt) for prompt in ROW_PROMPTS]


def sampled_joints(engines, gammas, params, draws):
    """Each draw decodes the four rows (their own engines, seeds and γ) in one batch."""
    counts = [{} for _ in ROW_PROMPTS]
    caches = [engine.make_prompt_cache() for engine in engines]
    for draw in range(draws):
        out, requests = {}, []
        for row, (engine, cache, prompt, gamma) in enumerate(zip(engines, caches, ROW_PROMPTS, gammas)):
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


ROW_PROMPTS = [[2, 5, 3, 5, 1], [2, 5, 3, 5, 1, 4, 6, 0, 7], [3, 1, 1], [2, 5, 3, 5, 1]]
