"""Draft trees: one target pass over a flattened tree, exact at every temperature.

References outside the tree code: mlx-lm's own model called on each root path without a
cache (the logits a tree row must give), mlx-lm's generate_step (greedy output), and the
exact joint distribution of the first two tokens computed from the target's logits
(the chi-square check of tests/core/test_distribution.py.py).
"""

import mlx.core as mx
import pytest
from conftest import greedy_reference
from distribution_support import BROKEN_DRAWS, DRAWS, PARAMS, PROMPT, VOCAB, chi_square, exact_joint
from trees_support import BRANCHING_PROMPT, LONG_BRANCHING, SecondSiblingDrafter, flat_policy  # noqa: F401

import mlx_spec.core.verify as verify_module
from mlx_spec.cache.sequence import SequenceCache
from mlx_spec.core.cost_model import CostCurve
from mlx_spec.core.engine import Engine
from mlx_spec.core.policy import TreePolicy
from mlx_spec.core.sampling import LogitProcessor, SamplingParams, draw
from mlx_spec.core.stats import Stats
from mlx_spec.core.tree import TreeShape
from mlx_spec.core.verify import (
    TreeVerdict,
    _walk,
    first_among_siblings,
    verify_tree_greedy,
    verify_tree_sampled,
)
from mlx_spec.drafters import Draft, Drafter, ModelDrafter, NgramDrafter
from mlx_spec.testing.tiny import perturbed_copy, tiny_gemma3

WINDOW = 16
SHAPE = TreeShape((-1, -1, 0, 0, 1, 2, 5, -1, 7, 8, 9, 10, 11, 12))



@pytest.mark.parametrize("prompt_length", [5, 40])  # within the 16-token window, and past it
@pytest.mark.parametrize("arch", ["gemma3", "gemma4"])  # Gemma 4: KV shared across layers too
def test_tree_rows_equal_each_path_decoded_alone(tiny_target, arch, prompt_length):
    """Every row of one tree pass gives the logits mlx-lm's model gives for prefix + that
    row's root path, fed without any cache; after keeping a path that is not a prefix of
    the block, the next token's logits are those of prefix + path."""
    if arch == "gemma4":
        from mlx_spec.testing.tiny_gemma4 import WINDOW as gemma4_window
        from mlx_spec.testing.tiny_gemma4 import tiny_gemma4

        assert prompt_length < 10 or prompt_length > gemma4_window
        tiny_target = tiny_gemma4(seed=0)
    prefix = [(11 * i) % 250 + 6 for i in range(prompt_length)]
    x = [(37 * i) % 250 + 6 for i in range(SHAPE.size)]
    seq = SequenceCache(tiny_target, slack=17)
    seq.prefill(prefix[:-1])
    logits = seq.forward(mx.array([prefix[-1]] + x, mx.uint32), tree=SHAPE)
    for row in range(SHAPE.size + 1):
        path = [x[j] for j in (SHAPE.path(row - 1) if row else [])]
        reference = tiny_target(mx.array(prefix + path)[None])[0, -1]
        assert mx.allclose(logits[row], reference, atol=1e-4).item(), row
    path = SHAPE.path(6)  # nodes 0 -> 2 -> 5 -> 6: block rows 1, 3, 6, 7
    seq.settle([prefix[-1]] + [x[j] for j in path], rows=[0] + [j + 1 for j in path])
    after = seq.forward(mx.array([17], mx.uint32))[0]
    reference = tiny_target(mx.array(prefix + [x[j] for j in path] + [17])[None])[0, -1]
    assert mx.allclose(after, reference, atol=1e-4).item()
    assert seq.ids == prefix[:-1] + [prefix[-1]] + [x[j] for j in path]


def test_tree_shape_bookkeeping():
    shape = TreeShape((-1, -1, 0, 0, 2))
    assert shape.depth == [1, 1, 2, 2, 3] and shape.rank == [0, 1, 0, 1, 0]
    assert shape.path(4) == [0, 2, 4]
    # path 0 -> 3: at the root node 0 is taken first; under node 0, node 2 is tried and
    # rejected, then node 3 taken; node 3 is a leaf
    assert shape.attempts([0, 3]) == [(1, 0, True), (2, 0, False), (2, 1, True)]
    assert shape.attempts([]) == [(1, 0, False), (1, 1, False)]
    assert shape.subtree([0, 2, 4]) == TreeShape.chain(3)
    with pytest.raises(ValueError):
        TreeShape((0,))


def test_greedy_tree_rule_takes_the_longest_argmax_path():
    shape = TreeShape((-1, -1, 0, 1, 1, 4))  # rows: root 0, nodes 1..6
    x = mx.array([5, 6, 7, 8, 9, 3], mx.uint32)
    # argmax at each row: root -> 6 (node 1), node 1 -> 9 (node 4), node 4 -> 3 (node 5)
    verdict = verify_tree_greedy(x, shape, mx.array([6, 0, 9, 0, 0, 3, 4]))
    assert (verdict.n.item(), verdict.token.item()) == (3, 4)
    assert verdict.path.tolist() == [False, True, False, False, True, True]
    verdict = verify_tree_greedy(x, shape, mx.array([1, 0, 0, 0, 0, 0, 0]))
    assert (verdict.n.item(), verdict.token.item()) == (0, 1)


def run(engine, prompt, policy, max_tokens=48):
    stats = Stats()
    tokens = [t for r in engine.rounds(prompt, gamma=policy, max_tokens=max_tokens, stats=stats) for t in r.tokens]
    return tokens, stats


@pytest.mark.parametrize("prompt", [BRANCHING_PROMPT, LONG_BRANCHING], ids=["short", "past-window"])
def test_greedy_ngram_trees_match_plain_decoding(tiny_target, prompt):
    tokens, stats = run(Engine(tiny_target, NgramDrafter(min_ngram=1)), prompt, flat_policy(max_gamma=4))
    assert tokens == greedy_reference(tiny_target, prompt, 48)
    assert len(prompt) + len(tokens) > WINDOW
    assert stats.tree_rounds > 0 and sum(stats.tried_at_rank[1:]) > 0  # it branched
    # by sibling rank: accepted / tried, from the raw counts (rank 0 at least once right)
    by_rank = stats.as_dict()["acceptance_by_rank"]
    assert len(by_rank) == len(stats.tried_at_rank) >= 2 and by_rank[0] > 0
    assert by_rank == [a / t if t else 0.0 for a, t in zip(stats.accepted_at_rank, stats.tried_at_rank)]


@pytest.mark.parametrize("prompt", [BRANCHING_PROMPT, LONG_BRANCHING], ids=["short", "past-window"])
def test_greedy_model_drafter_trees_match_plain_decoding(tiny_target, prompt):
    """A draft that disagrees with the target often (a noisier copy of it) branches where
    its top-1 probability is split; its second guesses are sometimes the target's, so paths
    run through siblings and the draft's cache must follow them back."""
    draft = perturbed_copy(tiny_target, noise=0.1, seed=1)
    drafter = ModelDrafter(draft, tiny_target.args.vocab_size)
    tokens, stats = run(Engine(tiny_target, drafter), prompt, flat_policy(max_gamma=4), 60)
    assert tokens == greedy_reference(tiny_target, prompt, 60)
    assert len(prompt) + len(tokens) > WINDOW
    assert stats.tree_rounds > 0 and sum(stats.accepted_at_rank[1:]) > 0  # siblings taken
    assert stats.draft_forwards < stats.drafted  # siblings cost no draft forward



def test_accepted_paths_off_the_block_prefix_stay_exact_far_past_the_window(tiny_target):
    prompt = [2, 40, 41, 42, 43, 44, 45, 40, 41]
    reference = greedy_reference(tiny_target, prompt, 120)
    drafter = SecondSiblingDrafter(prompt, reference)
    tokens, stats = run(Engine(tiny_target, drafter), prompt, flat_policy(max_gamma=3), 120)
    assert tokens == reference
    assert stats.accepted_at_rank[0] == 0 and stats.accepted_at_rank[1] > 0
    assert stats.mean_accepted_length > 3  # most rounds took all three levels


def test_log_probs_of_a_tree_round_come_from_the_rows_of_the_accepted_path(tiny_target):
    """The server's log-probs on a tree round: each emitted token scored by the row of its
    parent on the accepted path (not block row i), equal to mlx-lm's own for plain decoding."""
    from mlx_lm.generate import generate_step

    prompt, n, top = [2, 40, 41, 42, 43, 44, 45, 40, 41], 40, 3
    expected = list(generate_step(mx.array(prompt), tiny_target, max_tokens=n))
    drafter = SecondSiblingDrafter(prompt, [int(t) for t, _ in expected])
    rounds = list(Engine(tiny_target, drafter).rounds(prompt, gamma=flat_policy(max_gamma=3), max_tokens=n,
                                                       stats=Stats(), logprobs=top))
    scored = [entry for r in rounds for entry in r.logprobs]
    assert [t for r in rounds for t in r.tokens] == [int(t) for t, _ in expected]
    assert any(r.accepted > 0 for r in rounds)  # rows off the block prefix were read
    for (logprob, alternatives), (token, reference) in zip(scored, expected, strict=True):
        assert logprob == pytest.approx(reference[int(token)].item(), abs=2e-4)
        assert [i for i, _ in alternatives] == mx.argsort(-reference)[:top].tolist()


# ---------------------------------------------------------------------------------------
# Temperature > 0


@pytest.fixture(scope="module")
def small_target():
    return tiny_gemma3(seed=0, vocab_size=VOCAB, logit_scale=2.0)


class LikeliestSiblingsDrafter(Drafter):
    """Test drafter: at the root, the target's own `width` likeliest next tokens (target
    sampling processed as `params`, from the history alone), each with one child, its
    likeliest follower; so high-probability siblings are tried in turn. Its choices never
    see the verify pass's randomness, so the rule must stay exact for them."""

    name, can_branch = "likeliest", True

    def __init__(self, target, params, width=3):
        self.target, self.processor, self.width = target, LogitProcessor(params), width
        self.ranked: dict[tuple, list[int]] = {}  # history -> tokens by p, most likely first

    def begin(self, prompt_ids, prompt_cache=None, processor=None):
        return 0

    def _likeliest(self, ids, k):
        if tuple(ids) not in self.ranked:  # every draw starts from the same prompt
            logits = self.target(mx.array(ids)[None])[0, -1:]
            probs = self.processor.distribution(logits, self.processor.windows(ids, None, 1))[0]
            self.ranked[tuple(ids)] = mx.argsort(-probs).tolist()
        return self.ranked[tuple(ids)][:k]

    def propose(self, gamma, history, key=None):
        return Draft.empty()

    def propose_tree(self, gamma, branches, history, key=None):
        parents, tokens = [], []
        for t in self._likeliest(history, self.width):
            parents.append(-1)
            tokens.append(t)
            if gamma > 1:
                parents.append(len(parents) - 1)
                tokens.append(self._likeliest(history + [t], 1)[0])
        return Draft(mx.array(tokens, mx.uint32), tree=TreeShape(tuple(parents)))

    def accept(self, committed, target_hidden=None):
        pass


def sampled_tree_joint(engine, params, draws):
    counts = {}
    cache = engine.make_prompt_cache()
    for seed in range(draws):
        run_params = SamplingParams(**{**params.__dict__, "seed": seed})
        rounds = engine.rounds(PROMPT, run_params, gamma=flat_policy(max_gamma=2), max_tokens=3, prompt_cache=cache)
        tokens = [t for r in rounds for t in r.tokens]
        counts[tokens[0], tokens[1]] = counts.get((tokens[0], tokens[1]), 0) + 1
    return counts


def test_tree_sampling_matches_target_distribution(small_target):
    """T = 1 with top-k, top-p and a repetition penalty (whose windows follow each path)."""
    params = SamplingParams(**PARAMS)
    engine = Engine(small_target, LikeliestSiblingsDrafter(small_target, params))
    counts = sampled_tree_joint(engine, params, DRAWS)
    stat, critical = chi_square(counts, exact_joint(small_target, params))
    assert stat < critical


def no_sibling_removal(x, shape, p, key, q=None):
    """Broken: a rejected sibling stays in the residual (each sibling is accepted with its
    plain p, and the recovered token is drawn from p)."""
    key_accept, key_token = mx.random.split(key)
    V = p.shape[-1]
    p_x = mx.take(p.reshape(-1), (mx.array(shape.parents) + 1) * V + x.astype(mx.int32))
    accepted = mx.random.uniform(shape=(shape.size,), key=key_accept) < p_x
    n, path, end = _walk(shape, first_among_siblings(shape, accepted))
    return TreeVerdict(n, draw(mx.take(p, end, axis=0), key_token), path)


def test_the_check_catches_a_wrong_residual_update(small_target, monkeypatch):
    params = SamplingParams(**PARAMS)
    monkeypatch.setattr(verify_module, "verify_tree_sampled", no_sibling_removal)
    engine = Engine(small_target, LikeliestSiblingsDrafter(small_target, params))
    stat, critical = chi_square(sampled_tree_joint(engine, params, BROKEN_DRAWS), exact_joint(small_target, params))
    assert stat > critical


@pytest.fixture(scope="module")
def small_draft():
    return tiny_gemma3(seed=9, vocab_size=VOCAB, logit_scale=2.0)  # unrelated: split and often wrong


def test_model_drafter_tree_sampling_matches_target_distribution(small_target, small_draft):
    """A sampled chain (its q: Leviathan's test) plus the draft's next likeliest tokens as
    one-hot siblings, tried against the residual norm(max(p - q, 0))."""
    params = SamplingParams(**PARAMS)
    engine = Engine(small_target, ModelDrafter(small_draft, VOCAB))
    shapes = []
    real = verify_module.verify_tree_sampled

    def recording(x, shape, p, key, q=None):
        shapes.append((shape, q is not None))
        return real(x, shape, p, key, q)

    verify_module.verify_tree_sampled = recording
    try:
        counts = sampled_tree_joint(engine, params, DRAWS)
    finally:
        verify_module.verify_tree_sampled = real
    assert len(shapes) >= DRAWS // 2 and all(with_q for _, with_q in shapes)
    assert any(max(shape.rank) >= 2 for shape, _ in shapes)  # several siblings at a node
    stat, critical = chi_square(counts, exact_joint(small_target, params))
    assert stat < critical


def one_hot_residual(x, shape, p, key, q=None):
    """Broken: a sampled first child gets Leviathan's test, but after its rejection the
    siblings and the recovered token use p without that child (the one-hot residual), not
    norm(max(p - q, 0))."""
    if q is None:
        return verify_tree_sampled(x, shape, p, key)
    V, N = p.shape[-1], shape.size
    key_accept, key_token = mx.random.split(key)
    xi = x.astype(mx.int32)
    p_x = mx.take(p.reshape(-1), (mx.array(shape.parents) + 1) * V + xi)
    q_x = mx.take(q.reshape(-1), mx.arange(N) * V + xi)
    r = mx.random.uniform(shape=(N,), key=key_accept)
    rejected = shape.device["earlier_f"] @ p_x  # p of every earlier sibling, the first included
    first = mx.array([k == 0 for k in shape.rank])
    accepted = mx.where(first, r * q_x < p_x, r * (1.0 - rejected) < p_x)
    n, path, end = _walk(shape, first_among_siblings(shape, accepted))
    residual = mx.take(p, end, axis=0).at[x].multiply(1.0 - mx.take(shape.device["children_f"], end, axis=0))
    return TreeVerdict(n, draw(residual / mx.sum(residual), key_token), path)


def test_the_check_catches_a_one_hot_residual_after_a_sampled_child(small_target, small_draft, monkeypatch):
    params = SamplingParams(**PARAMS)
    monkeypatch.setattr(verify_module, "verify_tree_sampled", one_hot_residual)
    engine = Engine(small_target, ModelDrafter(small_draft, VOCAB))
    stat, critical = chi_square(sampled_tree_joint(engine, params, BROKEN_DRAWS), exact_joint(small_target, params))
    assert stat > critical


# ---------------------------------------------------------------------------------------
# The cut by the cost curve


def taught_policy(verify, draft_step=0.0):
    """A TreePolicy on the verify curve `verify`, taught that first children are accepted
    60% of the time and second ones 50%."""
    policy = TreePolicy(CostCurve(verify, draft_step, 256), max_gamma=4, learn_costs=False)
    for _ in range(20):
        policy.observe_tree(TreeShape((-1, -1)), [0])
        policy.observe_tree(TreeShape((-1, -1)), [1])
        policy.observe_tree(TreeShape((-1, -1, 0)), [0, 2])
        policy.observe_tree(TreeShape((-1, -1)), [])
        policy.observe_tree(TreeShape((-1, -1)), [])
    return policy


def test_the_cut_follows_the_cost_of_width():
    draft = NgramDrafter(min_ngram=1)
    draft.begin(BRANCHING_PROMPT)
    tree = draft.propose_tree(4, 4)
    shape = tree.tree
    assert shape.size == 16 and [r for r, p in zip(shape.rank, shape.parents) if p < 0] == [0, 1, 2, 3]

    def kept(verify):
        return taught_policy(verify).prune(tree)

    flat = kept([0.01] * 17)
    assert flat.tree is not None and flat.tokens.shape[0] == 16  # width is free: all of it
    gentle = kept([0.01 * (1 + 0.15 * w) for w in range(17)])  # each row costs 15% of a step
    assert gentle.tree is None and 0 < gentle.tokens.shape[0] < 16  # a chain: the first branch
    assert gentle.tokens.tolist() == draft.propose(gentle.tokens.shape[0]).tokens.tolist()
    linear = kept([0.01 * (w + 1) for w in range(17)])  # every row costs a step
    assert linear.tokens.shape[0] == 0  # plain decoding


def test_the_cut_keeps_the_model_drafter_chain_where_width_is_dear(tiny_target):
    """Sibling leaves cost verify width only (no draft forward): with cheap width but dear
    draft steps they are kept; where width is dear the cut is the chain `propose` drafts,
    still carrying its q (so a chain at T > 0 keeps Leviathan's acceptance)."""
    draft = perturbed_copy(tiny_target, noise=0.3, seed=1)
    prompt = LONG_BRANCHING

    def proposal(params):
        drafter = ModelDrafter(draft, tiny_target.args.vocab_size)
        drafter.begin(prompt, Engine(tiny_target).make_prompt_cache(), LogitProcessor(params))
        return drafter.propose_tree(4, 4, prompt, mx.random.key(3))

    def cut(tree, verify, draft_step):
        return taught_policy(verify, draft_step).prune(tree)

    tree = proposal(SamplingParams())
    assert tree.tree is not None and tree.tree.size > 4 and tree.forwards == 4
    # width free, a draft step a fifth of a target step: every sibling stays (charged a
    # draft step each, as a chain's nodes are, the least likely would be cut)
    assert cut(tree, [0.01] * 17, 0.002).tokens.shape[0] == tree.tree.size
    gentle = cut(tree, [0.01 * (1 + 0.2 * w) for w in range(17)], 0.001)
    assert gentle.tree is None and 0 < gentle.tokens.shape[0] <= 4  # each row costs 20% of a step: a chain
    assert gentle.tokens.tolist() == tree.tokens[:gentle.tokens.shape[0]].tolist()
    assert cut(tree, [0.01 * (w + 1) for w in range(17)], 0.001).tokens.shape[0] == 0  # plain
    sampled = proposal(SamplingParams(temperature=1.0, seed=0))
    chain = cut(sampled, [0.01 * (1 + 0.2 * w) for w in range(17)], 0.001)
    assert chain.tree is None and 0 < chain.tokens.shape[0] and chain.q.shape == (chain.tokens.shape[0], tiny_target.args.vocab_size)
    assert mx.array_equal(chain.q, sampled.q[: chain.tokens.shape[0]]).item()


# ---------------------------------------------------------------------------------------
# The real Gemma 3 270M (512-token sliding window)


@pytest.mark.slow
def test_real_270m_greedy_trees_match_plain_decoding_across_the_window(gemma270m):
    from importlib.resources import files

    text = files("mlx_spec.prompts").joinpath("window.txt").read_text()
    prompt = list(gemma270m.tokenizer.encode(text))[:500]
    reference = greedy_reference(gemma270m.model, prompt, 40)
    tokens, stats = run(Engine(gemma270m.model, NgramDrafter()), prompt, flat_policy(), 40)
    assert len(prompt) + len(tokens) > 512 + 20  # the sliding layers wrapped mid-generation
    assert tokens == reference
    assert stats.tree_rounds > 0 and sum(stats.tried_at_rank[1:]) > 0
