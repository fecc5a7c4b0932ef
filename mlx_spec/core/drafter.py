"""The drafter protocol: what the engine asks of whoever proposes the γ tokens.

After llama.cpp's common/speculative.h (begin / draft / accept), with every capability the
engine uses declared here, so it never has to probe a drafter:

  begin(prompt_ids, prompt_cache, processor) -> int   a new request; returns tokens prefilled
  propose(γ, history, key) -> Draft                   up to γ tokens (lazy) and their q
  drafting(γ, history, key)                           `propose` as a generator that yields each
                                                      model forward as a `passes.Pass` (a batch
                                                      runs it beside other requests')
  propose_tree(γ, branches, history, key) -> Draft    a draft tree (where `can_branch`)
  accept(committed, target_hidden)                    the tokens the round committed; the
                                                      drafter rolls back the rest of its state
  fork(memory)                                        a drafter of its own for another request
                                                      (`memory`: the earlier requests it may
                                                      draft from, where it `remembers`)
  end()                                               the request is over (finished or
                                                      abandoned): one that remembers keeps it

Capabilities, as class attributes (besides `name`, what --drafter takes, and `summary`):
  needs_draft_model  it drafts with the pair's draft model (so one is loaded for it)
  passes_per_token   draft model forwards per proposed token (0: model-free, or a block drafter)
  passes_per_block   draft model forwards per proposed block, whatever its length (a block
                     drafter: 1); the cost model then prices a round's draft per forward,
                     not per token (`CostCurve.block`)
  model              the draft model whose forwards the cost curve times; None: model-free
  own_cache          it keeps a K/V cache of its own (so the draft K/V quantization applies)
  wants_hidden       it reads the target's final hidden states: at `begin` the last
                     prefilled position's (prompt_cache.target.prefill_hidden), at `accept`
                     the round's pass's [γ+1, H] (a tree's: the accepted path's rows)
  tap_layers         with wants_hidden: the target's decoder layers whose outputs it reads
                     instead of the final hidden states (a block drafter's taps), handed
                     over concatenated [rows, len(tap_layers)·H], out of the same passes:
                     at `begin` every position the prefill fed (prefill_hidden [1, fed, k·H]),
                     at `accept` the round's pass's rows [γ+1, k·H]
  can_branch         it implements `propose_tree`
  rollbackable       its state can roll back exactly (a recurrent draft model's cannot)
  remembers          it drafts from a memory of earlier requests (`token_memory.Memory`),
                     shared by its forks; `fork(memory=...)` picks another, None for none

q: a drafter that samples from a distribution returns it ([γ, V] after the same processing
as the target's p); a deterministic one (argmax, lookup) returns q = None, which the
acceptance rule treats as one-hot at the drafted tokens: exact at any temperature.

A new drafter family is one module with a `Drafter` subclass and one line in the registry
(`mlx_spec.drafters.DRAFTERS`); its `for_pair` builds it from the loaded models.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Optional

import mlx.core as mx

from mlx_spec.core.passes import run_alone
from mlx_spec.core.tree import TreeShape
from mlx_spec.errors import UsageError


@dataclass
class Draft:
    tokens: mx.array  # [γ'] uint32, γ' <= γ (a lookup drafter may find fewer)
    q: Optional[mx.array] = None  # [γ', V] processed draft distributions; None = one-hot
    tree: Optional[TreeShape] = None  # the tokens' tree; None = a chain
    forwards: Optional[int] = None  # draft model forwards it took; None: one per token and pass
    sources: Optional[tuple[str, ...]] = None  # per token, where the drafter found it (stats only)

    @staticmethod
    def empty() -> "Draft":
        return Draft(mx.array([], dtype=mx.uint32))


KEEP = object()  # `Drafter.fork`'s memory: the same as this drafter's


class Drafter:
    """Base class of every drafter; see the module for the protocol. A subclass overrides
    `propose` or `drafting` (each defaults to the other), `begin` and `accept`; `reset`
    sets its per-request state, which `fork` starts afresh."""

    name: str = "drafter"
    summary: str = ""  # what drafts, for --drafter's help
    needs_draft_model: bool = False
    passes_per_token: int = 0
    passes_per_block: int = 0
    model = None
    own_cache: bool = False
    wants_hidden: bool = False
    tap_layers: tuple[int, ...] = ()
    can_branch: bool = False
    rollbackable: bool = True
    remembers: bool = False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.propose is Drafter.propose and cls.drafting is Drafter.drafting:
            raise TypeError(f"{cls.__name__} must define propose or drafting")

    @classmethod
    def for_pair(cls, pair, world) -> "Drafter":
        """This drafter for a loaded `models.ModelPair`, where the target is sharded over
        `world` (a `distributed.World`); a one-line `UsageError` where it cannot draft."""
        raise UsageError(f"the {cls.name} drafter cannot be built from loaded models")

    def hidden_wanted(self):
        """What the target's passes must hand over (`cache.forward.Hidden`): False, True
        (final hidden states) or the tap layers' ids."""
        if not self.wants_hidden:
            return False
        return tuple(self.tap_layers) or True

    def reset(self) -> None:
        """Forget the request in progress (called by `fork`; `begin` starts each request)."""

    def fork(self, memory=KEEP) -> "Drafter":
        """A drafter of its own for a request decoded beside others: the same models, no
        state shared with this one but its memory of earlier requests (where it
        `remembers`; `memory` another one, or None)."""
        twin = copy.copy(self)
        twin.reset()
        return twin

    def begin(self, prompt_ids: list[int], prompt_cache, processor) -> int:
        return 0

    def propose(self, gamma: int, history: list[int], key: Optional[mx.array] = None) -> Draft:
        return run_alone(self.drafting(gamma, history, key))

    def drafting(self, gamma: int, history: list[int], key: Optional[mx.array] = None):
        """`propose` as a generator; a model-free drafter yields nothing."""
        return self.propose(gamma, history, key)
        yield  # a generator, though it has no pass to yield

    def propose_tree(self, gamma: int, branches: int, history: list[int], key: Optional[mx.array] = None) -> Draft:
        raise NotImplementedError(f"the {self.name} drafter does not branch")

    def accept(self, committed: list[int], target_hidden: Optional[mx.array] = None) -> None:
        pass

    def end(self) -> None:
        """The request begun last is over (finished, failed or closed)."""


def require_draft_model(name: str, pair) -> None:
    """A one-line `UsageError` unless `pair` holds a draft model for drafter `name`."""
    if pair.draft is None:
        raise UsageError(f"--drafter {name} needs a draft model (--draft-model or a preset with one)")


def require_tapping_draft(family: str, name: str, pair, world, fits: bool, wanted: str) -> None:
    """One-line `UsageError`s for a drafter that reads the target's layer outputs (`family`,
    registered as `name`): not across ranks, which split those outputs; only with a draft
    model, whose config `fits` the family (`wanted` says what checkpoint it needs)."""
    if world.active:
        raise UsageError(f"the {family} drafter reads the target's layer outputs, which the ranks split "
                         "between them: across ranks use --drafter model or ngram")
    require_draft_model(name, pair)
    if not fits:
        raise UsageError(f"--drafter {name} needs {wanted}")
