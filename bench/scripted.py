"""A drafter whose acceptance is scripted, and the acceptance profiles it plays.

With random-weight models a real draft agrees with the target by chance only, so the
loop's speed at a realistic acceptance cannot be measured with one. `ScriptedDrafter` runs
the draft model's forwards exactly as `ModelDrafter` does (same cache, same catch-up after
a fully accepted round, a vocabulary-wide argmax per step, so its cost is real), but what
it proposes comes from the target's own greedy continuation, computed beforehand by plain
decoding: at draft position i it proposes the reference token with probability a_i and a
token the target cannot choose otherwise. Under greedy verification (T = 0) the target
accepts position i exactly when the reference token is proposed there, so the conditional
acceptance P(i accepted | 1..i-1 accepted) is a_i by construction, and the output is still
plain greedy decoding's.

`ScriptedMtpDrafter` does the same for Gemma 4's MTP assistant: it runs the assistant's
greedy steps over the target's cache (`MtpDrafter`'s forwards) and proposes the script, and
`scripted_block_drafter` for a block drafter (DSpark, DFlash): its one block forward over
the target's tapped layers, then the script in place of the block's tokens.
"""

from __future__ import annotations

import random
from typing import Sequence

import mlx_spec  # noqa: F401,E402  (first: it loads the optimised BLAS before mlx.core)
import mlx.core as mx

from mlx_spec.drafters import Draft, ModelDrafter
from mlx_spec.drafters.dflash import DFlashDrafter
from mlx_spec.drafters.dspark import DSparkDrafter
from mlx_spec.drafters.mtp import MtpDrafter

# The seed's reference measurement (DESIGN §2: M3 Pro, 12B 4-bit target, T = 0) reported
# per-position acceptance 0.951, 0.889, 0.852 at γ = 3: rounds that accepted token i over
# rounds that drafted it (unconditional, as llama.cpp and Ollama count it). Their mean is
# its α̂ = 0.901, and its γ = 1 and γ = 2 runs (α̂ 0.954, 0.919) agree with the same
# rates; read as conditional they would give α̂ 0.839. The script needs conditional
# acceptances a_i = u_i / u_{i-1}: 0.951, 0.935, 0.958. Its γ = 5 run (α̂ 0.828, so
# u_4 + u_5 = 5 · 0.828 − 2.692 = 1.448) gives positions 4 and 5 one conditional rate a:
# 0.852 · (a + a²) = 1.448, a = 0.896; past the list the last value repeats.
SEED = (0.951, 0.889 / 0.951, 0.852 / 0.889, 0.896)


def flat_for_accepted_length(length: float, gamma: int) -> float:
    """The one conditional acceptance a at which a round of γ drafts commits `length` tokens
    on average, the bonus token counted: E = (1 − a^(γ+1)) / (1 − a), solved by bisection.
    Block drafters' papers and READMEs report this mean accepted length (τ)."""
    if not 1 <= length <= gamma + 1:
        raise ValueError(f"a mean accepted length of {length} is outside 1..{gamma + 1} at γ = {gamma}")
    lo, hi = 0.0, 1.0
    for _ in range(60):
        a = (lo + hi) / 2
        if sum(a**k for k in range(gamma + 1)) < length:
            lo = a
        else:
            hi = a
    return round((lo + hi) / 2, 4)


# Published mean accepted lengths of the block drafters for Gemma 4 12B, as flat profiles
# (a block's acceptance decays along it; a flat rate over the block is the simplest
# profile with the published mean, so the longest γ is where it errs most):
# - DSpark (deepseek-ai/dspark_gemma4_12b_block7): mean accepted length 4.98 at its cap of
#   7 (mlx-dspark's README, M4 Pro, 12B 8-bit, its chat/code/math mix), read as counting
#   the bonus token (the lower, conservative reading).
# - DFlash (z-lab/gemma4-12B-it-DFlash): "accept ~6" with its block of 16 on code and math
#   (mlx-dspark's DSpark vs DFlash comparison on the same Mac); read the same way.
DSPARK_12B = (flat_for_accepted_length(4.98, 7),)
DFLASH_12B = (flat_for_accepted_length(6.0, 15),)
PROFILES = {
    "seed": SEED,
    "flat0.8": (0.8,),  # the paper's independence assumption, α = 0.8
    "dspark12b": DSPARK_12B,
    "dflash12b": DFLASH_12B,
}


def profile_at(profile: Sequence[float], i: int) -> float:
    """a_{i+1}: the conditional acceptance at draft position i + 1 (0-based i)."""
    return profile[min(i, len(profile) - 1)]


def parse_profile(spec: str) -> tuple[str, tuple[float, ...]]:
    """A named profile ('seed', 'flat0.8') or comma-separated a_1,a_2,... in [0, 1]."""
    if spec in PROFILES:
        return spec, PROFILES[spec]
    try:
        values = tuple(float(v) for v in spec.split(","))
    except ValueError:
        raise ValueError(f"unknown profile {spec!r}: a name ({', '.join(PROFILES)}) or a_1,a_2,...") from None
    if not values or not all(0.0 <= v <= 1.0 for v in values):
        raise ValueError(f"acceptances must lie in [0, 1]: {spec!r}")
    return spec, values


class Script:
    """What a scripted drafter proposes: after `generated` committed tokens, γ tokens where
    token j is the reference's with probability a_j, else one the target does not choose
    there (reference + 1). One generator per drafter (`seed`), so a run is reproducible."""

    def __init__(self, reference: Sequence[int], profile: Sequence[float], vocab: int, seed: int = 0):
        self.reference = list(reference)
        self.profile = tuple(profile)
        self.vocab = vocab
        self.rng = random.Random(seed)

    def tokens(self, generated: int, gamma: int) -> list[int]:
        out = []
        for j in range(gamma):
            at = generated + j
            right = self.reference[at] if at < len(self.reference) else 0
            accept = self.rng.random() < profile_at(self.profile, j)
            out.append(right if accept else (right + 1) % self.vocab)
        return out

    def through(self, own: mx.array, generated: int) -> mx.array:
        """The script's tokens in place of a drafter's own proposals `own` [γ], computed
        from them so that MLX (lazy) still runs the forwards whose cost this is about."""
        scripted = mx.array(self.tokens(generated, own.shape[0]), dtype=mx.uint32)
        return mx.where(own >= 0, scripted, own).astype(mx.uint32)


class ScriptedDrafter(ModelDrafter):
    """`ModelDrafter`'s forwards and cache, the reference continuation's tokens.

    Args:
        model: the draft model (its forwards are what a real draft step costs).
        target_vocab: width of the target's logits.
        reference: the target's greedy continuation of the prompt (plain decoding), at
            least as long as the generation.
        profile: conditional acceptance a_1, a_2, ... by draft position.
        seed: seeds the acceptance draws.
    """

    name = "scripted"

    def __init__(self, model, target_vocab: int, reference: Sequence[int], profile: Sequence[float], seed: int = 0):
        super().__init__(model, target_vocab)
        self.script = Script(reference, profile, target_vocab, seed)
        self.prompt_len = 0

    def begin(self, prompt_ids: list[int], prompt_cache, processor) -> int:
        self.prompt_len = len(prompt_ids)
        return super().begin(prompt_ids, prompt_cache, processor)

    def propose(self, gamma: int, history: list[int], key: mx.array) -> Draft:
        self.fed_drafts = None
        if gamma == 0:
            return Draft.empty()
        if len(self.pending) > self.catch_up_after:  # as ModelDrafter: after γ = 0 rounds
            self.state.prefill(self.state.ids + self.pending[:-1])
            self.pending = self.pending[-1:]
        # While the output equals plain decoding, history = prompt + reference[:generated].
        scripted = mx.array(self.script.tokens(len(history) - self.prompt_len, gamma), dtype=mx.uint32)
        xs: list[mx.array] = []
        y = mx.array(self.pending, dtype=mx.uint32)
        for j in range(gamma):
            logits = self.state.forward(y)[-1, : self.target_vocab]  # [V]
            own = mx.argmax(logits)  # what a greedy draft would propose
            # Propose the scripted token, but through the draft's own argmax: MLX is lazy
            # and would otherwise never run the forward whose cost this is about.
            y = mx.where(own >= 0, scripted[j], own).astype(mx.uint32).reshape(1)
            mx.async_eval(y)
            xs.append(y)
        self.fed_drafts = gamma - 1  # x_γ is proposed, not fed (ModelDrafter.accept's rule)
        return Draft(mx.concatenate(xs))


class ScriptedMtpDrafter(MtpDrafter):
    """`MtpDrafter`'s assistant steps over the target's cache, the reference's tokens.

    Args: as `ScriptedDrafter`'s, with the assistant and its target in place of the draft
    model (the target's vocabulary is the assistant's)."""

    name = "scripted-mtp"

    def __init__(self, assistant, target, reference: Sequence[int], profile: Sequence[float], seed: int = 0):
        super().__init__(assistant, target)
        self.script = Script(reference, profile, assistant.vocab_size, seed)
        self.prompt_len = 0

    def begin(self, prompt_ids: list[int], prompt_cache, processor=None) -> int:
        self.prompt_len = len(prompt_ids)
        return super().begin(prompt_ids, prompt_cache, processor)

    def propose(self, gamma: int, history: list[int], key=None) -> Draft:
        own = super().propose(gamma, history, key)
        if own.tokens.size == 0:
            return own  # γ = 0, or no hidden state (a first round that prefilled nothing)
        return Draft(self.script.through(own.tokens, len(history) - self.prompt_len))


def scripted_block_drafter(drafter_class: type, name: str) -> type:
    """A block drafter class (`DSparkDrafter`, `DFlashDrafter`) that runs its block forward
    over the target's tapped layers (and DSpark's Markov-head draws) as the real one does,
    then proposes the script's tokens in their place. Built as (draft, target, reference,
    profile, seed), as `ScriptedMtpDrafter`."""

    class ScriptedBlockDrafter(drafter_class):
        def __init__(self, draft, target, reference: Sequence[int], profile: Sequence[float], seed: int = 0):
            super().__init__(draft, target)
            self.script = Script(reference, profile, draft.args.vocab_size, seed)
            self.prompt_len = 0

        def begin(self, prompt_ids: list[int], prompt_cache, processor) -> int:
            self.prompt_len = len(prompt_ids)
            return super().begin(prompt_ids, prompt_cache, processor)

        def drafting(self, gamma: int, history: list[int], key=None):
            own = yield from super().drafting(gamma, history, key)
            if own.tokens.size == 0:
                return own  # γ = 0, or no context yet
            return Draft(self.script.through(own.tokens, len(history) - self.prompt_len), None, forwards=own.forwards)

    ScriptedBlockDrafter.__name__ = ScriptedBlockDrafter.__qualname__ = f"Scripted{drafter_class.__name__}"
    ScriptedBlockDrafter.name = name
    return ScriptedBlockDrafter


ScriptedDSparkDrafter = scripted_block_drafter(DSparkDrafter, "scripted-dspark")
ScriptedDFlashDrafter = scripted_block_drafter(DFlashDrafter, "scripted-dflash")
