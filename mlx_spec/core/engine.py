"""The speculative round loop. Token ids in, token ids out: the engine knows no text.

One round (Leviathan et al. 2023, Algorithm 1), each phase one call of `Generation`:
  1. choose γ     the policy is asked once per round, capped by max_tokens and the caches
  2. draft        x_1..x_γ and q_1..q_γ from the drafter (lazy, on device), or a draft tree
                  where the policy and drafter branch (`mlx_spec.core.tree`; siblings one-hot);
                  2b. under a grammar, cut to what it allows and extended by what it forces
                  (`mlx_spec.core.constraint`)
  3. score        one target forward over [last, x_1..x_γ] → p_1..p_γ+1, and the acceptance
                  rule → a `Verdict`, still lazy (a tree: one forward over the flattened tree)
  4. decide       the round's one host sync on the verdict
  5. commit       cut at the first EOS id or at max_tokens, even mid-block; both caches
                  forget every position that was not committed
  6. observe      the policy and the stats learn the round's outcome and time

A plain round (γ = 0) followed by another is pipelined as mlx-lm's generate_step is: the
next round's pass is queued on the device, fed the token still being computed, before the
host waits for it (3b, `queue_plain_round`). A queued pass that turns out not to be needed
is rolled back with the rest of the round.

In a batch (`rounds(batched=True)`) step 2's draft passes and step 3's target pass are
yielded to the caller, which runs each in one forward with other requests'
(`mlx_spec.core.batch`); everything else stays per request. A round that finds the request
alone in its batch runs as without one (pipelined, and in trees where it draws them), so
a lone client of a batching server decodes as fast as a serial one.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass
from time import perf_counter
from typing import Callable, Iterable, Iterator, Optional

import mlx.core as mx

from mlx_spec.core.batch import PREFILLING, RAN_ALONE
from mlx_spec.core.cache.layers import KVQuantization
from mlx_spec.core.cache.sequence import PromptCache
from mlx_spec.core.constraint import Constraint
from mlx_spec.core.drafter import KEEP, Draft, Drafter
from mlx_spec.core.grammar import Matcher, constrain
from mlx_spec.core.passes import RoundClock, TargetPass, run_alone
from mlx_spec.core.policy import MAX_GAMMA, GammaPolicy, as_policy
from mlx_spec.core.sampling import UNDECIDED, KeyStream, LogitProcessor, SamplingParams, likeliest
from mlx_spec.core.stats import Stats
from mlx_spec.core.verify import Verdict, verify_block
from mlx_spec.errors import MlxSpecError


@dataclass
class Round:
    tokens: list[int]  # committed this round: accepted drafts + recovered/bonus, after cuts
    gamma: int  # draft tokens verified
    accepted: int  # n, of the γ drafted (before any stop cut)
    finish_reason: Optional[str] = None  # "stop" (an EOS id), "length" (max_tokens) or None
    # With `rounds(logprobs=k)`: per committed token, (its log-prob under the target's p,
    # the k likeliest (id, log-prob)), from the verify pass that scored it.
    logprobs: Optional[list[tuple[float, list[tuple[int, float]]]]] = None


@dataclass
class Request:
    """One generation, typed once where it enters (the CLI, the server) and carried whole
    into the engine. Arguments as `Engine.rounds`; `constraint` is the request's grammar
    state (a `grammar.Matcher`, fresh per generation)."""

    prompt_ids: list[int]
    params: SamplingParams = SamplingParams()
    gamma: "int | GammaPolicy" = 3
    max_tokens: int = 256
    logprobs: Optional[int] = None
    images: object = None  # an `mlx_spec.models.vision.ImagePrompt`
    constraint: Optional[Matcher] = None
    keys: Optional[KeyStream] = None  # the random stream to continue (None: a fresh one from the seed)
    # A generated-token count no round crosses while it is set (γ is capped to end a round
    # there), so the caller can end the run at it (a thought budget). Read every round: the
    # caller may lift it (set None) mid-run.
    pause_at: Optional[int] = None


@dataclass
class Scored:
    """Step 3's outcome, lazy until step 4: the draft verified, the acceptance rule's
    verdict and what the target pass gave."""

    draft: Draft
    drafted_by: int  # of the draft's tokens, those the drafter proposed (the rest a grammar forced)
    verdict: Verdict  # or a `TreeVerdict`
    hidden: Optional[mx.array]  # the target's hidden states [rows, H] (or taps [rows, k·H]), for drafters that read them
    scores: Optional[mx.array]  # the target's log-probs [rows, V], with `logprobs`
    settle: Optional[Callable[[], Verdict]]  # greedy: the exact decision, for a near-tie

    @property
    def gamma(self) -> int:
        return self.draft.tokens.shape[0]


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
        vision: the target's `mlx_spec.models.vision.Vision`, for prompts with images; None: it
            reads none.
        kv, draft_kv: quantize the target's / the draft model's K/V cache (None: full
            precision); see `mlx_spec.core.cache`.
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
        # the target pass computes hidden states (final ones, or a block drafter's tap
        # layers': `Drafter.hidden_wanted`) only for drafters that read them
        self.wants_hidden = drafter.hidden_wanted() if drafter is not None else False

    def for_request(self, memory=KEEP) -> "Engine":
        """This engine with a drafter of its own (drafters keep one request's state between
        begin and accept), for a request decoded beside others; models are shared, and so
        is a drafter's memory of earlier requests unless `memory` names another (or None:
        `Drafter.fork`)."""
        twin = copy.copy(self)
        twin.drafter = None if self.drafter is None else self.drafter.fork(memory)
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
        constraint: Optional[Matcher] = None,
        batched: bool = False,
        alone: Optional[Callable[[], bool]] = None,
    ) -> Iterator[Round]:
        """Generate from `prompt_ids`, one `Round` per target forward (`run` with a `Request`).

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
            images: an `mlx_spec.models.vision.ImagePrompt` whose ids are `prompt_ids`: the target's
                prefill reads its image features; drafters see the ids as they are.
            constraint: the request's grammar state (`grammar.Grammar.matcher()`, fresh per
                generation) the output must follow (`mlx_spec.core.constraint`); it ends
                generation ("stop") once the value is complete.
            batched: yield each round's draft steps as passes (`passes.DraftPass`, the MTP
                assistant's `AssistantPass`) and its target pass as a `passes.TargetPass`
                before the round goes on, for the caller to run (`passes.run_passes`,
                beside other requests'), and `batch.PREFILLING` between the prompt's prefill
                chunks; such rounds are chains (no trees) and plain rounds are not pipelined.
            alone: with `batched`, asked at each round's start whether no other request
                decodes beside this one now (`batch.Batch.alone`). If so, the round runs
                as without a batch (its passes at once, a plain round pipelined, a tree
                where the policy shapes one) and yields `batch.RAN_ALONE` after its
                `Round`. Never for a seeded sample: its draws must not depend on others.
        Yields:
            `Round`s (with `batched`, also the passes, `PREFILLING`s and `RAN_ALONE`s);
            the last `Round` has a finish_reason.
        """
        request = Request(prompt_ids, params, gamma, max_tokens, logprobs, images, constraint)
        return self.run(request, prompt_cache=prompt_cache, stats=stats, prefill_progress=prefill_progress,
                        company=in_company(params, batched, alone))

    def run(self, request: Request, *, prompt_cache: Optional[PromptCache] = None, stats: Optional[Stats] = None,
            prefill_progress: Optional[Callable[[int, int], None]] = None,
            company: Optional[Callable[[], bool]] = None) -> Iterator[Round]:
        """`rounds` for a `Request`. `company`: None decoding alone; in a batch, asked at each
        round's start whether other requests share this round's forwards (`in_company`)."""
        g = Generation(self, request, prompt_cache, stats, company)
        try:
            yield from g.prefill(prefill_progress)
            while g.generated < g.max_tokens:
                start, clock = perf_counter(), RoundClock()  # in a batch: its share of the forwards
                scored = g.take_queued()  # steps 1-3 of a plain round queued by the last round
                together = scored is None and g.in_company()  # this round's passes go to the batch
                if scored is None:
                    key_draft, key_verify = g.keys(2)
                    branching = g.can_branch and not together
                    gamma = g.choose_gamma(branching)  # 1
                    proposal = yield from clock.through(g.draft(gamma, key_draft, together, branching))  # 2
                    scored = yield from clock.through(g.score(proposal, key_verify, together))  # 3
                drafted = perf_counter()
                g.queue_plain_round(scored)  # 3b
                verdict = g.decide(scored)  # 4
                rnd, path = g.commit(scored, verdict)  # 5
                g.observe(scored, rnd, path, start, drafted, clock)  # 6
                yield rnd
                if rnd.finish_reason:
                    return
                if company is not None and not together:  # the batch's step is over for this request
                    yield RAN_ALONE
        finally:  # finished, failed, or closed between rounds
            if g.drafter is not None:
                g.drafter.end()

    def check_prompt(self, prompt_ids: list[int]) -> None:
        """Refuse, in one line, a prompt the target cannot take (empty, or past its context)."""
        if not prompt_ids:
            raise MlxSpecError("the prompt is empty")
        if self.context_length is not None and len(prompt_ids) >= self.context_length:
            raise MlxSpecError(f"the prompt is {len(prompt_ids):,} tokens, but the model's context "
                               f"is {self.context_length:,} tokens")

    def can_draft(self, cache: PromptCache) -> bool:
        """Whether both caches roll back exactly; warns and decodes plainly if not."""
        for name, ok in (("target", cache.target.rollbackable), ("draft", self.drafter.rollbackable)):
            if not ok:
                warnings.warn(
                    f"the {name} model's cache cannot roll back exactly (recurrent layers); "
                    "decoding without drafting (γ = 0)",
                    stacklevel=4,
                )
                return False
        return True


def in_company(params: SamplingParams, batched: bool,
               alone: Optional[Callable[[], bool]]) -> Optional[Callable[[], bool]]:
    """`Engine.run`'s `company` for `rounds`' batched / alone: None outside a batch; a
    seeded sample always keeps the batch's way, so its key splits the same whoever else is
    served."""
    if not batched:
        return None
    if alone is None or not (params.greedy or params.seed is None):
        return lambda: True
    return lambda: not alone()


class Generation:
    """One request being decoded: its caches, drafter, policy, sampling and history, with
    the phases of its rounds (`Engine.run` is the loop over them)."""

    def __init__(self, engine: Engine, request: Request, prompt_cache: Optional[PromptCache],
                 stats: Optional[Stats], company: Optional[Callable[[], bool]]):
        engine.check_prompt(request.prompt_ids)
        self.engine, self.request, self.company = engine, request, company
        self.max_tokens = request.max_tokens
        if engine.context_length is not None:
            self.max_tokens = min(self.max_tokens, engine.context_length - len(request.prompt_ids))
        self.cache = prompt_cache or engine.make_prompt_cache()
        self.stats = stats if stats is not None else Stats()
        self.policy = as_policy(request.gamma)
        self.constraint = Constraint(request.constraint, forced_drafts=engine.grammar_drafts)
        self.processor = LogitProcessor(request.params, request.constraint)
        self.random = request.keys if request.keys is not None else KeyStream(request.params.seed)
        self.drafter = engine.drafter
        self.history = list(request.prompt_ids)
        self.last, self.generated = request.prompt_ids[-1], 0
        self.drafting = self.can_branch = False  # known once the prefill is done
        self.queued: Optional[Scored] = None  # the next plain round's pass, on the device (3b)
        self.gamma_next: Optional[int] = None  # the next round's γ, when this round asked already

    def in_company(self) -> bool:
        """Whether this round's passes are shared with other requests' (not run here)."""
        return self.company is not None and self.company()

    def keys(self, n: int) -> list[mx.array]:
        """n fresh PRNG keys split off the request's (greedy rounds draw nothing). Every
        round takes two (draft, verify), whether it runs alone, in a batch or queued (3b),
        so a seed draws the same tokens on every path."""
        if self.request.params.greedy:
            return [self.random.key] * n
        return self.random.split(n)

    def _limit(self) -> int:
        """The generated-token count this round may reach: max_tokens, or a `pause_at`
        still ahead."""
        pause = self.request.pause_at
        return self.max_tokens if pause is None or pause <= self.generated else min(pause, self.max_tokens)

    def prefill(self, progress):
        """Both caches end up holding the prompt except its last token, which the first
        verify pass feeds. A drafter that reads hidden states gets the last prefilled
        position's from the prefill's own pass (`SequenceCache.prefill_hidden`), in begin.
        In a batch, smaller chunks, yielding `PREFILLING` between them: the others decode
        meanwhile, waiting one chunk a round."""
        engine, request, cache = self.engine, self.request, self.cache
        start = perf_counter()
        keys = inputs = None
        if request.images is not None:  # the target reads the images' features; drafters, the ids
            images = request.images
            if engine.vision is None:
                raise MlxSpecError("the target model reads no images (it has no vision tower)")
            if len(images.keys) != len(request.prompt_ids):
                raise ValueError(f"the ImagePrompt has {len(images.keys)} positions for "
                                 f"{len(request.prompt_ids)} prompt ids")
            keys, inputs = images.keys, lambda begin, end: engine.vision.embed(images, begin, end)
        batched = self.company is not None
        chunk = min(engine.prefill_chunk, engine.batch_prefill_chunk) if batched else engine.prefill_chunk
        prompt = (request.prompt_ids[:-1], chunk, progress)
        extra = dict(hidden=engine.wants_hidden, keys=keys, inputs=inputs)
        if batched:
            processed = yield from _pausing(cache.target.prefill_chunks(*prompt, **extra))
        else:
            processed = cache.target.prefill(*prompt, **extra)
        if self.drafter is not None:
            processed += self.drafter.begin(request.prompt_ids, cache, self.processor)
        self.stats.observe_prefill(len(request.prompt_ids), processed, perf_counter() - start)
        self.drafting = self.drafter is not None and engine.can_draft(cache)
        # Trees where the policy shapes them, the drafter branches, and the target's layers
        # take tree masks; not under a grammar, nor across ranks (agree), nor in company.
        self.can_branch = (self.drafting and not self.constraint.active and self.policy.branches > 0
                           and self.drafter.can_branch and engine.agree is None and cache.target.tree_capable)

    def take_queued(self) -> Optional[Scored]:
        scored, self.queued = self.queued, None
        return scored

    def choose_gamma(self, branching: bool) -> int:
        """1. γ from the policy (unless asked already, 3b); the round adds one token of the
        target's own, hence the - 1."""
        gamma = self.policy.choose() if self.gamma_next is None else self.gamma_next
        return min(gamma, self.engine.max_gamma, self._limit() - self.generated - 1,
                   self.cache.target.draft_room(tree=branching))

    def draft(self, gamma: int, key: mx.array, together: bool, branching: bool):
        """2. The drafter's proposal (a pruned tree where `branching`); in company each of its
        passes is yielded to run beside the others'. 2b: cut to the grammar. Returns (the
        draft, how many of its tokens the drafter proposed, the grammar's masks or None)."""
        draft = Draft.empty()
        if self.drafting and gamma and branching:
            tree = self.drafter.propose_tree(gamma, self.policy.branches, self.history, key)
            draft = self.policy.prune(tree, self.engine.max_gamma)
        elif self.drafting and gamma and together:
            draft = yield from self.drafter.drafting(gamma, self.history, key)
        elif self.drafting and gamma:
            draft = self.drafter.propose(gamma, self.history, key)
        room = min(self.engine.max_gamma, self._limit() - self.generated - 1)
        draft, drafted_by, masks = self.constraint.cut(draft, room)
        if self.engine.profile:
            mx.eval(draft.tokens)
        return draft, drafted_by, masks

    def score(self, proposal, key: mx.array, together: bool, unseen: Optional[mx.array] = None):
        """3. One target pass over the block [last, x_1..x_γ] (a tree's flattened, under its
        tree masks) and the acceptance rule, lazily; in company the pass is yielded to run
        beside the others'. `unseen`: the block of a queued round, whose input is not on
        the host yet (for the repetition penalty). `proposal`: what `draft` returned.
        Returns a `Scored`."""
        draft, drafted_by, masks = proposal
        block = unseen if unseen is not None else mx.concatenate([mx.array([self.last], mx.uint32), draft.tokens])
        target_pass = TargetPass(self.cache.target, block, self.engine.wants_hidden, draft.tree)
        if together:
            yield target_pass
        else:
            target_pass.run()
        logits = target_pass.logits
        if masks is not None:
            mx.async_eval(logits)  # the host computes the grammar's masks meanwhile
            logits = constrain(logits, masks())
        windows = self._penalty_windows(block, draft, unseen)
        processor = self.processor

        def verdict(target_tokens=None):
            chosen = verify_block(draft.tokens, draft.tree, draft.q, target_tokens=target_tokens,
                                  p=None if target_tokens is not None else processor.distribution(logits, windows),
                                  key=key)
            return chosen if self.engine.agree is None else self.engine.agree(chosen)

        settle = None
        if processor.params.greedy:  # the cheap choice; a near-tie waits for the exact one (4)
            first = verdict(processor.greedy(logits, windows))
            settle = lambda: verdict(processor.greedy(logits, windows, settle=True))  # noqa: E731
        else:
            first = verdict()
        scores = None if self.request.logprobs is None else log_softmax(processor.penalize(logits, windows))
        return Scored(draft, drafted_by, first, target_pass.hidden_states, scores, settle)

    def _penalty_windows(self, block: mx.array, draft: Draft, unseen: Optional[mx.array]) -> Optional[mx.array]:
        """The repetition penalty's window for each block row (None where it is off)."""
        if draft.tree is not None:
            return self.processor.tree_windows(self.history, draft.tokens, draft.tree)
        if not self.processor.params.penalized:
            return None
        lead = 0 if unseen is None else unseen.shape[0]
        after = draft.tokens if unseen is None else mx.concatenate([unseen, draft.tokens])
        return self.processor.windows(self.history, after, lead + block.shape[0], first=lead)

    def queue_plain_round(self, scored: Scored) -> None:
        """3b. Another plain round next? Then queue its pass, fed this round's token, so the
        device computes it while the host waits in step 4. A plain round teaches the policy
        nothing, so asking it now for the next round's γ is asking it once."""
        self.gamma_next = None
        if scored.gamma != 0 or self.generated + 1 >= self._limit():
            return
        self.gamma_next = self.policy.choose() if self.drafting else 0
        if (self.gamma_next == 0 and self.engine.pipeline_plain_rounds and not self.constraint.active
                and not self.in_company()):
            _, key = self.keys(2)  # split as any round's (draft, verify): one schedule, pipelined or not
            block = scored.verdict.token.astype(mx.uint32).reshape(1)
            if scored.settle is not None:  # an UNDECIDED token is no id: the pass is dropped in 4
                block = mx.where(block == UNDECIDED, 0, block).astype(mx.uint32)
            self.queued = run_alone(self.score((Draft.empty(), 0, None), key, False, unseen=block))
            mx.async_eval(self.queued.verdict)

    def decide(self, scored: Scored) -> Verdict:
        """4. The round's one host synchronisation (two where the cheap greedy choice met a
        near-tie it leaves to the exact one: `LogitProcessor.greedy`)."""
        mx.eval(scored.verdict)
        if scored.settle is None or scored.verdict.token.item() != UNDECIDED:
            return scored.verdict
        self.queued = None  # it was fed no token: rolled back in 5
        verdict = scored.settle()
        mx.eval(verdict)
        return verdict

    def commit(self, scored: Scored, verdict: Verdict) -> tuple[Round, list[int]]:
        """5. The accepted drafts and the recovered or bonus token, cut at the first EOS id
        or where max_tokens is reached; the target's cache keeps [last] + emitted minus the
        new last token (and a queued pass still needed), the drafter rolls back its own.
        Returns the `Round` and the accepted draft nodes (a chain's first n, a tree's path)."""
        draft, n, token = scored.draft, verdict.n.item(), verdict.token.item()
        path = list(range(n)) if draft.tree is None else [i for i, on in enumerate(verdict.path.tolist()) if on]
        rows = [0] + [i + 1 for i in path]  # the block rows that scored each emitted token
        x = draft.tokens.tolist()
        emitted = self.constraint.until_complete([x[i] for i in path] + [token])
        emitted, finish = self._cut(emitted)
        if finish:
            self.queued = None  # its position is rolled back with the rest
        kept = ([self.last] + emitted)[:-1]
        self.cache.target.settle(kept, queued=int(self.queued is not None), rows=rows[: len(kept)])
        if self.drafting:
            hidden = scored.hidden  # a tree's: the rows of its accepted path
            if draft.tree is not None and hidden is not None:
                hidden = hidden[mx.array(rows)]
            self.drafter.accept(emitted, target_hidden=hidden)
        if self.constraint.commit(emitted) and finish is None:
            finish = "stop"  # the value is complete: only EOS could follow
        self.history.extend(emitted)
        self.last, self.generated = emitted[-1], self.generated + len(emitted)
        logprobs = None
        if scored.scores is not None:
            logprobs = token_logprobs(scores=scored.scores[mx.array(rows[: len(emitted)])], emitted=emitted,
                                       top=self.request.logprobs)
        return Round(emitted, scored.gamma, n, finish, logprobs), path

    def _cut(self, emitted: list[int]) -> tuple[list[int], Optional[str]]:
        for i, t in enumerate(emitted):
            if t in self.engine.eos_ids:
                return emitted[: i + 1], "stop"
        room = self.max_tokens - self.generated
        if len(emitted) >= room:
            return emitted[:room], "length"
        return emitted, None

    def observe(self, scored: Scored, rnd: Round, path: list[int], start: float, drafted: float,
                clock: RoundClock) -> None:
        """6. The round's outcome and measured time teach the policy (auto γ learns its
        costs from the drafter's tokens) and go into the stats: draft time up to the target
        pass, verify time after it, each in a batch with this request's share of the shared
        forwards in place of the wait for them (`passes.RoundClock`); decode time is the
        round's wall time."""
        end = perf_counter()
        draft, drafted_by = scored.draft, scored.drafted_by
        accepted = min(rnd.accepted, drafted_by)
        if draft.tree is not None:
            self.policy.observe_tree(draft.tree, path, end - start)
            self.stats.observe_tree(draft.tree.attempts(path))
        else:
            self.policy.observe(drafted_by, accepted, end - start)
        stats = self.stats
        stats.grammar_forced += max(0, min(rnd.accepted, len(rnd.tokens)) - drafted_by)
        depth = draft.tree.max_depth if draft.tree is not None else drafted_by
        draft_s = drafted - start - clock.waited + clock.draft_share
        verify_s = end - drafted + clock.verify_share
        stats.observe_round(drafted_by, accepted, len(rnd.tokens), draft_s, verify_s, depth=depth, decode_s=end - start)
        if self.drafting:
            stats.draft_forwards += (draft.forwards if draft.forwards is not None
                                     else drafted_by * self.drafter.passes_per_token)
        if draft.sources is not None:
            stats.observe_sources(draft.sources[:drafted_by], path if draft.tree is not None else range(accepted))
        stats.peak_memory = max(stats.peak_memory, mx.get_peak_memory())


def _pausing(chunks):
    """A prefill's chunks with `PREFILLING` yielded after each but the last; returns the
    tokens processed."""
    while True:
        try:
            next(chunks)
        except StopIteration as done:
            return done.value
        yield PREFILLING


def log_softmax(logits: mx.array) -> mx.array:
    """The target's log-probs of (repetition-penalized) logits, before temperature, top-k,
    top-p or min-p: what mlx-lm's `generate_step` reports, after its logits processors."""
    scores = logits.astype(mx.float32)
    return scores - mx.logsumexp(scores, axis=-1, keepdims=True)


def token_logprobs(scores: mx.array, emitted: list[int], top: int) -> list:
    """Row i of `scores` (log-probs [len(emitted), V]) scored emitted token i: its log-prob and the
    `top` likeliest alternatives, for the committed tokens only (one extra host sync)."""
    rows = scores[: len(emitted)]
    chosen = mx.take_along_axis(rows, mx.array(emitted)[:, None], axis=-1)[:, 0]
    if top > 0:
        ids, values = likeliest(rows, top)
        mx.eval(chosen, ids, values)
        alternatives = [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    else:
        mx.eval(chosen)
        alternatives = [[] for _ in emitted]
    return list(zip(chosen.tolist(), alternatives))
