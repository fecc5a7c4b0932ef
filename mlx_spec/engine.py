"""The speculative round loop. Token ids in, token ids out: the engine knows no text.

One round (Leviathan et al. 2023, Algorithm 1):
  1. choose γ                    the policy is asked once per round, capped by max_tokens
  2. draft                       x_1..x_γ and q_1..q_γ from the drafter (lazy, on device), or
                                 a draft tree where the policy and drafter branch
                                 (`mlx_spec.tree`; siblings one-hot), at most γ deep
  3. verify pass                 one target forward over [last, x_1..x_γ] → p_1..p_γ+1, and
                                 the acceptance rule → Verdict(n, token), still lazy (a tree:
                                 one forward over the flattened tree, and its accepted path)
  4. accept                      the round's one host sync on the verdict
  5. commit                      cut at the first EOS id or at max_tokens, even mid-block;
                                 both caches forget every position that was not committed

Under a grammar (`mlx_spec.grammar`, `rounds(grammar=...)`) every row's logits, the target's
and the draft model's, are masked to the tokens the grammar allows after that row's path, so
the acceptance rule runs on the constrained p and q; a model-free draft is cut at its first
token the grammar forbids, and the tokens the grammar forces after the draft are appended to
it as one-hot drafts (`grammar_drafts`), which the target accepts wherever it is forced too.
Draft trees are not drawn under a grammar (the policy's chains are).

A plain round (γ = 0) followed by another is pipelined as mlx-lm's generate_step is: the
next round's pass is queued on the device, fed the token still being computed, before the
host waits for it (step 3b). A queued pass that turns out not to be needed is rolled back.

With `rounds(batched=True)` step 2's draft passes (a draft model's or the MTP assistant's)
and step 3's target pass are handed to the caller, which runs each in one forward with
other requests' (`mlx_spec.batch`); everything else stays per request. A round that finds
the request alone in its batch (`alone`) runs as without one, so a lone client of a
batching server decodes as fast as a serial one: pipelined, and in trees where it draws them.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass
from time import perf_counter
from typing import Callable, Iterable, Iterator, Optional

import mlx.core as mx

from mlx_spec.batch import PREFILLING, RAN_ALONE, TargetPass
from mlx_spec.cache.layers import KVQuantization
from mlx_spec.cache.sequence import PromptCache
from mlx_spec.drafters import Draft, Drafter, draft_steps
from mlx_spec.errors import MlxSpecError
from mlx_spec.grammar import Matcher, constrain
from mlx_spec.policy import MAX_GAMMA, GammaPolicy, as_policy
from mlx_spec.sampling import UNDECIDED, LogitProcessor, SamplingParams, make_key
from mlx_spec.stats import Stats
from mlx_spec.verify import (Verdict, verify_greedy, verify_sampled, verify_tree_greedy,
                             verify_tree_sampled)


@dataclass
class Round:
    tokens: list[int]  # committed this round: accepted drafts + recovered/bonus, after cuts
    gamma: int  # draft tokens verified
    accepted: int  # n, of the γ drafted (before any stop cut)
    finish_reason: Optional[str] = None  # "stop" (an EOS id), "length" (max_tokens) or None
    # With `rounds(logprobs=k)`: per committed token, (its log-prob under the target's p,
    # the k likeliest (id, log-prob)), from the verify pass that scored it.
    logprobs: Optional[list[tuple[float, list[tuple[int, float]]]]] = None


class Engine:
    """A target model, an optional drafter, and the loop that joins them.

    `pipeline_plain_rounds` (on by default) queues a plain round's successor before the
    sync (step 3b); benchmarks switch it off to measure what it buys.

    Args:
        target: an mlx-lm model (called as model(ids[None], cache=...) -> logits).
        drafter: a `Drafter`, or None for plain decoding.
        eos_ids: token ids that end generation (Gemma: <eos> and <end_of_turn>).
        max_gamma: upper bound on γ; caches keep max_gamma + 1 positions of rollback slack.
        prefill_chunk: prompt tokens per prefill forward.
        profile: synchronise after drafting so draft and verify time are measured apart
            (costs one extra host sync per round; off by default).
        agree: applied to each round's lazy `Verdict` before the sync, so that processes
            sharing a sharded target make the same decision (e.g. rank 0's, broadcast).
        context_length: positions the target takes; a longer prompt is refused before any
            work, and generation stops ("length") where the context ends.
        vision: the target's `mlx_spec.vision.Vision`, for prompts with images; None: it
            reads none.
        kv, draft_kv: quantize the target's / the draft model's K/V cache (None: full
            precision); see `mlx_spec.cache`.
    """

    pipeline_plain_rounds = True
    # Under a grammar, append the tokens it forces after each draft as free drafts; off, a
    # constrained round verifies only what the drafter proposed (the bench's baseline).
    grammar_drafts = True

    # Prompt tokens per prefill chunk in a batch (`rounds(batched=True)`): ~1 s of a 2-core
    # CPU's prefill under load, so a request arriving meanwhile waits about that long.
    batch_prefill_chunk = 128

    def __init__(
        self,
        target,
        drafter: Optional[Drafter] = None,
        *,
        eos_ids: Iterable[int] = (),
        max_gamma: int = MAX_GAMMA,
        prefill_chunk: int = 512,
        profile: bool = False,
        agree: Optional[Callable[[Verdict], Verdict]] = None,
        context_length: Optional[int] = None,
        vision=None,
        kv: Optional[KVQuantization] = None,
        draft_kv: Optional[KVQuantization] = None,
    ):
        self.target = target
        self.drafter = drafter
        self.eos_ids = frozenset(eos_ids)
        self.max_gamma = max_gamma
        self.prefill_chunk = prefill_chunk
        self.profile = profile
        self.agree = agree
        self.context_length = context_length
        self.vision = vision
        self.kv, self.draft_kv = kv, draft_kv
        # Drafters that read the target's final hidden states (MTP heads) get them with
        # accept(); the target pass computes them only for those.
        self.wants_hidden = bool(getattr(drafter, "wants_hidden", False))

    def for_request(self) -> "Engine":
        """This engine with a drafter of its own (drafters keep one request's state between
        begin and accept), for a request decoded beside others; models are shared."""
        twin = copy.copy(self)
        twin.drafter = copy.copy(self.drafter)
        return twin

    def make_prompt_cache(self) -> PromptCache:
        return PromptCache(self.target, slack=self.max_gamma + 1, kv=self.kv, draft_kv=self.draft_kv)

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
        logprobs: Optional[int] = None,
        images=None,
        grammar: Optional[Matcher] = None,
        batched: bool = False,
        alone: Optional[Callable[[], bool]] = None,
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
            logprobs: if set, each `Round` carries the target's log-probs of its tokens and
                this many top alternatives: of its logits after the repetition penalty,
                before temperature and truncation, as mlx-lm's `generate_step` reports them
                (so at temperature 0 the chosen token is the likeliest one shown).
            images: an `mlx_spec.vision.ImagePrompt` whose ids are `prompt_ids`: the target's
                prefill reads its image features; drafters see the ids as they are.
            grammar: a `Matcher` the output must follow (see the module docstring); it
                ends generation ("stop") once the value is complete.
            batched: yield each round's draft steps as passes (`batch.DraftPass`, the MTP
                assistant's `AssistantPass`) and its target pass as a `batch.TargetPass`
                before the round goes on, for the
                caller to run (`batch.run_passes`, beside other requests'),
                and `batch.PREFILLING` between the prompt's prefill chunks; such rounds are
                chains (no trees) and plain rounds are not pipelined.
            alone: with `batched`, asked at each round's start whether no other request
                decodes beside this one now (`batch.Batch.alone`). If so, the round runs
                as without a batch (its passes at once, a plain round pipelined, a tree
                where the policy shapes one) and yields `batch.RAN_ALONE` after its
                `Round`. Never for a seeded sample: its draws must not depend on others.
        Yields:
            `Round`s (with `batched`, also the passes, `PREFILLING`s and `RAN_ALONE`s);
            the last `Round` has a finish_reason.
        """
        self.check_prompt(prompt_ids)
        if self.context_length is not None:
            max_tokens = min(max_tokens, self.context_length - len(prompt_ids))
        cache = prompt_cache or self.make_prompt_cache()
        stats = stats if stats is not None else Stats()
        policy = as_policy(gamma)
        processor = LogitProcessor(params, grammar)
        key = key_draft = key_verify = make_key(params.seed)
        history = list(prompt_ids)
        drafter = self.drafter

        # Prefill: both caches end up holding the prompt except its last token, which the
        # first verify pass feeds. A drafter that reads hidden states gets the last prefilled
        # position's from the prefill's own pass (`SequenceCache.prefill_hidden`), in begin.
        start = perf_counter()
        keys = inputs = None
        if images is not None:  # the target reads the images' features; drafters, the ids
            if self.vision is None:
                raise MlxSpecError("the target model reads no images (it has no vision tower)")
            if len(images.keys) != len(prompt_ids):
                raise ValueError(f"the ImagePrompt has {len(images.keys)} positions for {len(prompt_ids)} prompt ids")
            keys, inputs = images.keys, lambda begin, end: self.vision.embed(images, begin, end)
        # in a batch, smaller chunks: the others wait one chunk a round
        chunk = min(self.prefill_chunk, self.batch_prefill_chunk) if batched else self.prefill_chunk
        prompt = (prompt_ids[:-1], chunk, prefill_progress)
        extra = dict(hidden=self.wants_hidden, keys=keys, inputs=inputs)
        if batched:  # the batch decodes the other requests between chunks
            processed = yield from _pausing(cache.target.prefill_chunks(*prompt, **extra))
        else:
            processed = cache.target.prefill(*prompt, **extra)
        if drafter is not None:
            processed += drafter.begin(prompt_ids, cache, processor)
        stats.observe_prefill(len(prompt_ids), processed, perf_counter() - start)
        drafting = drafter is not None and self._can_draft(cache)
        # Trees where the policy shapes them, the drafter branches, and the target's
        # layers take tree masks; a sharded target (agree) keeps chains, so does a batch.
        can_branch = (drafting and grammar is None and hasattr(policy, "prune")
                      and hasattr(drafter, "propose_tree")
                      and self.agree is None and cache.target.tree_capable)
        # a seeded sample splits its key the same way whoever else is in the batch
        may_run_alone = batched and alone is not None and (params.greedy or params.seed is None)

        def runs_here() -> bool:
            """Whether a pass prepared now runs here, not in the batch."""
            return not batched or (may_run_alone and alone())

        last, generated = prompt_ids[-1], 0
        queued = None  # the next plain round's (verdict, hidden), already on the device (3b)
        gamma_next = None  # the next round's γ, when this round already asked the policy
        while generated < max_tokens:
            start = perf_counter()
            # this round's passes go to the batch, or run here (alone, or queued last round)
            together = queued is None and not runs_here()
            branching = can_branch and not together
            if queued is not None:  # steps 1-3 of this plain round were queued last round
                (verdict, hidden, scores, settle), queued = queued, None
                gamma, draft, drafted_by = 0, Draft.empty(), 0
            else:
                if not params.greedy:
                    key, key_draft, key_verify = mx.random.split(key, 3)
                # 1. choose γ; the round adds one token of the target's own, hence the - 1
                gamma = policy.choose(stats) if gamma_next is None else gamma_next
                gamma = min(gamma, self.max_gamma, max_tokens - generated - 1,
                            cache.target.draft_room(tree=branching))
                # 2. draft
                draft = Draft.empty()
                if drafting and gamma and branching:
                    draft = policy.prune(drafter.propose_tree(gamma, policy.branches, history, key_draft),
                                         self.max_gamma)
                elif drafting and gamma:  # in a batch, each draft step's pass runs beside the others'
                    draft = ((yield from draft_steps(drafter, gamma, history, key_draft)) if together else
                             drafter.propose(gamma, history, key_draft))
                masks, drafted_by = None, draft.tokens.shape[0]
                if grammar is not None:  # 2b. cut to the grammar, add what it forces, mask each row
                    room = min(self.max_gamma, max_tokens - generated - 1)
                    draft, drafted_by, masks = _constrain_draft(draft, grammar, room, self.grammar_drafts)
                gamma = draft.tokens.shape[0]
                if self.profile:
                    mx.eval(draft.tokens)
                # 3. one target pass over [last, x_1..x_γ] and the acceptance rule, lazily
                block = mx.concatenate([mx.array([last], mx.uint32), draft.tokens])
                verdict, hidden, scores, settle = yield from self._verify(
                    cache, block, draft, history, None, processor, key_verify, logprobs, masks, together)
            drafted = perf_counter()
            # 3b. Another plain round next? Then queue its pass, fed this round's token, so
            # the device computes it while the host waits below. A plain round teaches the
            # policy nothing, so asking it now for the next round's γ is asking it once.
            gamma_next = None
            if gamma == 0 and generated + 1 < max_tokens:
                gamma_next = policy.choose(stats) if drafting else 0
                if gamma_next == 0 and self.pipeline_plain_rounds and grammar is None and runs_here():
                    if not params.greedy:
                        key, key_verify = mx.random.split(key)
                    block = verdict.token.astype(mx.uint32).reshape(1)
                    if settle is not None:  # an UNDECIDED token is no id: the pass is dropped below
                        block = mx.where(block == UNDECIDED, 0, block).astype(mx.uint32)
                    queued = yield from self._verify(cache, block, Draft.empty(), history, block, processor,
                                                     key_verify, logprobs)
                    mx.async_eval(queued[0])
            # 4. accept: the round's one host synchronisation (two where the cheap greedy
            # choice met a near-tie it leaves to the exact one: `LogitProcessor.greedy`)
            mx.eval(verdict)
            if settle is not None and verdict.token.item() == UNDECIDED:
                verdict, queued = settle(), None  # the queued pass was fed no token: rolled back
                mx.eval(verdict)
            n, token = verdict.n.item(), verdict.token.item()
            # the accepted nodes: a chain's first n, a tree's accepted path
            path = list(range(n)) if draft.tree is None else [i for i, on in enumerate(verdict.path.tolist()) if on]
            # 5. commit
            x = draft.tokens.tolist()
            rows = [0] + [i + 1 for i in path]  # the block rows that scored each emitted token
            if draft.tree is not None and hidden is not None:  # an MTP drafter reads the path's rows
                hidden = hidden[mx.array(rows)]
            emitted = [x[i] for i in path] + [token]
            if grammar is not None:  # nothing after the value's end (plain decoding stops there too)
                emitted = grammar.until_complete(emitted)
            emitted, finish = self._commit(cache, last, emitted, max_tokens - generated,
                                           queued is not None, drafting, hidden, rows)
            if finish:
                queued = None  # its position was rolled back with the rest
            if grammar is not None:
                grammar.commit(emitted)
                stats.grammar_forced += max(0, min(n, len(emitted)) - drafted_by)
                if finish is None and grammar.stopped:
                    finish = "stop"  # the value is complete: only EOS could follow
            history.extend(emitted)
            last, generated = emitted[-1], generated + len(emitted)
            end = perf_counter()
            if draft.tree is not None:
                policy.observe_tree(draft.tree, path, end - start)
                stats.observe_tree(draft.tree.attempts(path))
            else:  # the round's measured time teaches auto γ its costs (of the drafter's tokens)
                policy.observe(drafted_by, min(n, drafted_by), end - start)
            depth = draft.tree.max_depth if draft.tree is not None else drafted_by
            stats.observe_round(drafted_by, min(n, drafted_by), len(emitted), drafted - start, end - drafted,
                                depth=depth)
            stats.draft_forwards += (draft.forwards if draft.forwards is not None else
                                     drafted_by * drafter.passes_per_token) if drafting else 0
            stats.peak_memory = max(stats.peak_memory, mx.get_peak_memory())
            yield Round(emitted, gamma, n, finish,
                        None if scores is None else
                        _token_logprobs(scores[mx.array(rows[:len(emitted)])], emitted, logprobs))
            if finish:
                return
            if batched and not together:  # the batch's step is over for this request
                yield RAN_ALONE

    def check_prompt(self, prompt_ids: list[int]) -> None:
        """Refuse, in one line, a prompt the target cannot take (empty, or past its context)."""
        if not prompt_ids:
            raise MlxSpecError("the prompt is empty")
        if self.context_length is not None and len(prompt_ids) >= self.context_length:
            raise MlxSpecError(f"the prompt is {len(prompt_ids):,} tokens, but the model's context "
                               f"is {self.context_length:,} tokens")

    def _verify(self, cache, block, draft, history, unseen, processor, key, logprobs=None, masks=None,
                batched=False):
        """Step 3 without the sync: the target pass over `block` ([last, x_1..x_γ]) and the
        acceptance rule, as a lazy (`Verdict` or `TreeVerdict`, hidden states or None, log-probs
        [rows, V] or None unless `logprobs` is set). `unseen`: tokens after `history` not yet on
        the host (a queued round's input), for the repetition penalty. `masks`: a function
        giving the grammar's allowed tokens per block row [rows, V] (bool), called once the
        pass is on the device, so the host computes them meanwhile; or None. A generator: with
        `batched` it yields the `TargetPass` for the caller to run; it returns the tuple."""
        # one target pass over the block (a tree's flattened, under its tree masks)
        target_pass = TargetPass(cache.target, block, self.wants_hidden, draft.tree)
        if batched:
            yield target_pass
        else:
            target_pass.run()
        logits, hidden = target_pass.logits, target_pass.hidden_states
        if masks is not None:
            mx.async_eval(logits)
            logits = constrain(logits, masks())
        if draft.tree is not None:
            windows = processor.tree_windows(history, draft.tokens, draft.tree)
        else:
            windows = None
            if processor.params.penalized:
                lead = 0 if unseen is None else unseen.shape[0]
                after = draft.tokens if unseen is None else mx.concatenate([unseen, draft.tokens])
                windows = processor.windows(history, after, lead + block.shape[0], first=lead)

        def decide(target_tokens=None):
            if target_tokens is not None:
                verdict = (verify_greedy(draft.tokens, target_tokens) if draft.tree is None else
                           verify_tree_greedy(draft.tokens, draft.tree, target_tokens))
            elif draft.tree is None:
                verdict = verify_sampled(draft.tokens, draft.q, processor.distribution(logits, windows), key)
            else:
                verdict = verify_tree_sampled(draft.tokens, draft.tree, processor.distribution(logits, windows),
                                              key, draft.q)
            return verdict if self.agree is None else self.agree(verdict)

        settle = None
        if processor.params.greedy:
            verdict = decide(processor.greedy(logits, windows))
            settle = lambda: decide(processor.greedy(logits, windows, settle=True))  # noqa: E731
        else:
            verdict = decide()
        scores = None if logprobs is None else _log_softmax(processor.penalize(logits, windows))
        return verdict, hidden, scores, settle

    def _commit(self, cache: PromptCache, last: int, emitted: list[int], room: int, queued: bool,
                drafting: bool, hidden: Optional[mx.array], rows: list[int]):
        """Step 5: cut `emitted` (accepted drafts + the recovered or bonus token) at the first
        EOS id, or to the `room` left before max_tokens; roll the target's cache back to
        [last] + emitted minus the new last token (plus a queued pass, if it is still
        needed), and tell the drafter, which rolls back its own state. `rows`: the block
        rows the kept positions were fed at (a tree's accepted path is not a prefix of it).
        Returns (emitted, finish reason or None)."""
        finish = None
        for i, t in enumerate(emitted):
            if t in self.eos_ids:
                emitted, finish = emitted[: i + 1], "stop"
                break
        if finish is None and len(emitted) >= room:
            emitted, finish = emitted[:room], "length"
        kept = ([last] + emitted)[:-1]
        cache.target.settle(kept, queued=1 if queued and not finish else 0, rows=rows[: len(kept)])
        if drafting:
            self.drafter.accept(emitted, **({"target_hidden": hidden} if self.wants_hidden else {}))
        return emitted, finish

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


def _constrain_draft(draft: Draft, grammar: Matcher, room: int, forced: bool) -> tuple[Draft, int, mx.array]:
    """Step 2b: the draft cut before its first token the grammar forbids (or an EOS), then
    (`forced`) the run the grammar forces after it (up to `room` tokens in all), appended
    with one-hot q. Returns (the draft, how many of its tokens the drafter proposed, a
    function giving the block's masks [γ+1, V]: row i allows what may follow x_1..x_i)."""
    x = draft.tokens.tolist()
    n = grammar.valid_prefix(x)
    x = x[: min(n, room)]
    forced = grammar.forced(x, room - len(x)) if forced and grammar.continues(x) else []
    path = x + forced
    q = draft.q
    if q is not None:
        q = q[: len(x)]
        if forced:
            one_hot = mx.arange(q.shape[-1])[None, :] == mx.array(forced)[:, None]
            q = mx.concatenate([q, one_hot.astype(q.dtype)])
    return (Draft(mx.array(path, dtype=mx.uint32), q, forwards=draft.forwards), len(x),
            lambda: grammar.path_masks(path))


def _pausing(chunks):
    """A prefill's chunks with `PREFILLING` yielded after each but the last; returns the
    tokens processed."""
    while True:
        try:
            next(chunks)
        except StopIteration as done:
            return done.value
        yield PREFILLING


def _log_softmax(logits: mx.array) -> mx.array:
    """The target's log-probs of (repetition-penalized) logits, before temperature, top-k,
    top-p or min-p: what mlx-lm's `generate_step` reports, after its logits processors."""
    scores = logits.astype(mx.float32)
    return scores - mx.logsumexp(scores, axis=-1, keepdims=True)


def _token_logprobs(scores: mx.array, emitted: list[int], top: int) -> list:
    """Row i of `scores` (log-probs [len(emitted), V]) scored emitted token i: its log-prob and the
    `top` likeliest alternatives, for the committed tokens only (one extra host sync)."""
    rows = scores[: len(emitted)]
    chosen = mx.take_along_axis(rows, mx.array(emitted)[:, None], axis=-1)[:, 0]
    if top > 0:
        ids = mx.argpartition(-rows, top - 1, axis=-1)[:, :top]  # the top, in no order
        values = mx.take_along_axis(rows, ids, axis=-1)
        order = mx.argsort(-values, axis=-1)
        ids, values = mx.take_along_axis(ids, order, axis=-1), mx.take_along_axis(values, order, axis=-1)
        mx.eval(chosen, ids, values)
        alternatives = [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    else:
        mx.eval(chosen)
        alternatives = [[] for _ in emitted]
    return list(zip(chosen.tolist(), alternatives))
