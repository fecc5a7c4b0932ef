"""Gemma 4's multi-token-prediction assistant as the drafter.

The assistant has no cache of its own: it reads the target's. Each round it starts from the
target's final hidden state h at the last accepted position (handed over by the engine with
`accept`) and the token the round committed after it, and drafts γ tokens greedily, each
step feeding its own projected hidden state and the target's embedding of the token it just
drafted. All steps query one position, so nothing is ever written and nothing needs rollback.

Round 1 drafts too, as in LiteRT-LM, transformers and mlx-vlm: the engine's prefill keeps
the final hidden state at the last prefilled token (prompt_ids[-2]) from its own last chunk
(no extra target pass; only when a drafter wants hidden states), and `begin` starts from it,
so the first proposal, fed prompt_ids[-1], is made exactly as any later round's. Otherwise
every request would begin with a plain round, a real share of a short chat answer. When the
prefill fed nothing (a one-token prompt, or a chat turn that adds a single token), the h of
the previous round is still right if the cache has not moved since; else round 1 is plain.

Which keys it sees: the target's cache after a round holds exactly the committed tokens
before the newest one, so every step attends to the committed context only. Sliding layers
see the window − 1 newest keys, the keys the target's own sliding layer would see at the
newest token's position besides that token's own (as mlx-vlm's assistant does).
transformers' generation loop differs in two corners we do not copy: after a rejection it
crops the verify pass's K/V to the new length, so the rejected draft's key at the newest
position stays visible, and its sliding mask admits window + 1 keys.

The draft is the argmax at every step, so q is one-hot (Draft.q = None) and the Leviathan
rule stays exact at any temperature, as for the n-gram drafter. `propose_tree` adds the
assistant's next likeliest tokens as sibling leaves where its top-1 probability is split;
the engine then hands over the hidden states of the tree rows on the accepted path.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import mlx.core as mx

from mlx_spec.cache.layer_base import kv_slots
from mlx_spec.core.passes import Pass, pad_left, run_alone
from mlx_spec.core.sampling import likeliest
from mlx_spec.drafters.base import Draft, Drafter, require_draft_model
from mlx_spec.drafters.siblings import sibling_leaves, with_leaves
from mlx_spec.errors import MlxSpecError, UsageError
from mlx_spec.models.gemma4_assistant import is_assistant_config, last_kv_layers, target_text_model

# The query position of every draft step, as the number of tokens in the target's cache
# minus this. 0: the position the newest token will take (transformers'
# SinglePositionMultiTokenCandidateGenerator: position_ids = len(input_ids) - 1).
# 1: the position of the token whose hidden state h is (Ollama, mlx-vlm and vLLM).
# The default is transformers'; MLX_SPEC_MTP_POSITION=previous (or position=) switches.
POSITIONS = {"transformers": 0, "previous": 1}
POSITION_ENV = "MLX_SPEC_MTP_POSITION"


def shared_kv(layer_caches: list, layers: dict[str, int], window: int) -> dict:
    """{"sliding_attention": (keys, values), "full_attention": (keys, values)} from the
    target's per-layer caches (plain `KVCache` or our `WindowKVCache`, or their quantized
    twins, whose K/V are (packed, scales, biases) triples, `ChannelKeys` for a global
    layer's keys), each [1, kv_heads, S, head_dim]
    in temporal order; sliding layers cut to window − 1 keys."""
    out = {}
    for layer_type, index in layers.items():
        cache = layer_caches[index]
        if hasattr(cache, "held_kv"):  # a global layer's keys quantized by channel: all of them
            out[layer_type] = cache.held_kv()
            continue
        used = cache.offset - getattr(cache, "start", 0)  # WindowKVCache drops old slots
        first = max(0, used - (window - 1)) if layer_type == "sliding_attention" else 0
        out[layer_type] = (kv_slots(cache.keys, first, used), kv_slots(cache.values, first, used))
    return out


@dataclass
class AssistantPass(Pass):
    """One assistant step of one request: h_d [1, 1, H] for `inputs` [1, 1, 2·H_target]
    over the request's `kv` (see `shared_kv`) at RoPE `position`. In a batch the rows'
    steps run as one assistant call: their K/V left-padded to the longest row's, the
    padding masked, each row at its own position."""

    assistant: object
    inputs: mx.array
    kv: dict
    position: int
    h_d: Optional[mx.array] = None

    def group(self) -> tuple:
        return AssistantPass, id(self.assistant)

    def run(self) -> None:
        self.h_d = self.assistant.hidden(self.inputs, self.kv, self.position)

    @classmethod
    def run_together(cls, passes: list["AssistantPass"]) -> None:
        # quantized target K/V (--kv-bits) are packed triples: not stacked, each row alone
        if len(passes) == 1 or any(isinstance(k, (tuple, list)) for p in passes for k, _ in p.kv.values()):
            return super().run_together(passes)
        kv, masks = {}, {}
        for layer_type in passes[0].kv:
            lengths = [p.kv[layer_type][0].shape[2] for p in passes]
            width = max(lengths)
            kv[layer_type] = tuple(mx.concatenate([pad_left(p.kv[layer_type][j], width, 2) for p in passes])
                                   for j in (0, 1))
            first = mx.array([width - n for n in lengths])[:, None]  # the row's first real key
            masks[layer_type] = (mx.arange(width)[None] >= first)[:, None, None]  # [B, 1, 1, keys]
        positions = mx.array([p.position for p in passes], mx.int32)
        h_d = passes[0].assistant.hidden(mx.concatenate([p.inputs for p in passes]), kv, positions, masks)
        for i, p in enumerate(passes):
            p.h_d = h_d[i : i + 1]


def greedy_steps(assistant, embed, token: mx.array, h: mx.array, kv: dict, position, gamma: int,
                 ranked: int = 0):
    """`draft_greedy` as a generator that yields each step's `AssistantPass` (a batch runs
    it beside other requests') and returns what `draft_greedy` returns."""
    tokens, tops = [], []
    for _ in range(gamma):
        step = AssistantPass(assistant, mx.concatenate([embed(token), h], axis=-1), kv, position)
        yield step
        h_d = step.h_d
        token = assistant.greedy(h_d)  # [1, 1]
        if ranked:
            tops.append(likeliest(mx.softmax(assistant.logits(h_d)[0].astype(mx.float32), axis=-1), ranked))
        h = assistant.post_projection(h_d)
        tokens.append(token)
    chain = mx.concatenate(tokens, axis=1)[0]
    if not ranked:
        return chain
    return chain, mx.concatenate([ids for ids, _ in tops]), mx.concatenate([p for _, p in tops])


def draft_greedy(assistant, embed, token: mx.array, h: mx.array, kv: dict, position, gamma: int,
                 ranked: int = 0):
    """γ greedy assistant steps from one position.

    Args:
        assistant: `gemma4_assistant.Model`.
        embed: the target's scaled input embedding (ids -> E[id]·√H_target).
        token: [1, 1] the last committed token; h: [1, 1, H_target] the target's final
            hidden state at the position before it.
        kv: the target's shared K/V (see `shared_kv`); position: the query's RoPE position.
        ranked: if > 0, also the `ranked` likeliest ids per step and their probabilities
            under the assistant's softmax (the full-vocabulary row is built for them).
    Returns:
        [γ] drafted token ids (lazy); with `ranked`, (those, ids [γ, ranked], probs [γ, ranked]).
    """
    return run_alone(greedy_steps(assistant, embed, token, h, kv, position, gamma, ranked))


class MtpDrafter(Drafter):
    """Drafts with a Gemma 4 MTP assistant over the target's own caches.

    Args:
        assistant: the loaded assistant (`gemma4_assistant.Model`).
        target: the Gemma 4 target it was trained with (text-only or multimodal build).
        position: "transformers" or "previous" (see POSITIONS); None reads
            $MLX_SPEC_MTP_POSITION, else "transformers". Implementations disagree; only
            acceptance on real weights can tell which one the checkpoints were trained with,
            and exactness holds either way.
    """

    name = "mtp"
    summary = "a Gemma 4 MTP assistant as the draft model, drafting from the target's own states"
    needs_draft_model = True  # the assistant checkpoint
    passes_per_token = 1  # assistant forwards per drafted token
    wants_hidden = True  # the engine hands over the target's final hidden states
    can_branch = True
    split_below, sibling_floor = 0.8, 0.02  # where `propose_tree` branches (see ModelDrafter)

    def __init__(self, assistant, target, *, position: Optional[str] = None):
        inner = target_text_model(target)
        if inner is None:
            raise MlxSpecError("the MTP assistant drafts for Gemma 4 targets only "
                               f"(the target is {type(target).__module__.rsplit('.', 1)[-1]})")
        position = position or os.environ.get(POSITION_ENV) or "transformers"
        if position not in POSITIONS:
            raise MlxSpecError(f"unknown MTP position {position!r} (choose from {', '.join(POSITIONS)}; "
                               f"set by position= or ${POSITION_ENV})")
        backbone = assistant.args.backbone_hidden_size
        if backbone != inner.config.hidden_size:
            raise MlxSpecError(f"the assistant was built for a target of hidden size {backbone}, "
                               f"this target's is {inner.config.hidden_size}")
        self.model = assistant
        self.target = target
        self.inner = inner
        self.layers = last_kv_layers(inner.config)
        self.window = inner.config.sliding_window
        self.position = position
        self.reset()

    @classmethod
    def for_pair(cls, pair, world) -> "MtpDrafter":
        if world.active:
            raise UsageError("the MTP drafter reads the target's K/V cache, which the ranks split "
                             "between them: across ranks use --drafter model or ngram")
        require_draft_model(cls.name, pair)
        if not is_assistant_config(pair.draft.config):
            raise UsageError("--drafter mtp needs a Gemma 4 MTP assistant checkpoint as the draft "
                             "(model_type gemma4_assistant or gemma4_unified_assistant)")
        return cls(pair.draft.model, pair.target.model)

    def reset(self) -> None:
        self.state = None  # the target's SequenceCache
        self.h: Optional[mx.array] = None  # [1, 1, H_target] at the last committed position
        self.h_at = 0  # tokens in the target's cache when h was taken (h is at the newest)

    def embed(self, token: mx.array) -> mx.array:
        return self.inner.embed_tokens(token) * self.inner.embed_scale

    def begin(self, prompt_ids: list[int], prompt_cache, processor=None) -> int:
        """Start from the target's final hidden state at the last prefilled token
        (prompt_ids[-2]), so round 1 drafts as any later round does. The engine's prefill
        kept it (`prefill_hidden`). If the prefill fed nothing (the cache already held
        prompt_ids[:-1]: a one-token prompt, or a turn adding one token), the h the last
        round handed over is the right one only if the cache has not moved since; otherwise
        there is no h and round 1 is plain (it costs one target pass and yields a token, as
        any round does)."""
        state = prompt_cache.target
        held = len(prompt_ids) - 1  # what the prefill left in the cache
        if state.prefill_hidden is not None and len(state.ids) == held:
            self.h = state.prefill_hidden
        elif not (state is self.state and self.h_at == held == len(state.ids)):
            self.h = None
        self.state = state
        self.h_at = held
        return 0

    def _draft(self, gamma: int, history: list[int], ranked: int = 0):
        """`greedy_steps` from the last committed token (`ranked`: as there)."""
        layer_caches = self.state.cache
        context = layer_caches[0].offset  # tokens the target has seen: all but history[-1]
        kv = shared_kv(layer_caches, self.layers, self.window)
        token = mx.array([[history[-1]]])
        position = context - POSITIONS[self.position]
        return greedy_steps(self.model, self.embed, token, self.h, kv, position, gamma, ranked=ranked)

    def drafting(self, gamma: int, history: list[int], key=None):
        """`propose` as a generator that yields each step's `AssistantPass` (a batch runs it
        beside other requests') and returns the Draft."""
        if gamma == 0 or self.h is None:
            return Draft.empty()
        return Draft((yield from self._draft(gamma, history)).astype(mx.uint32))

    def propose_tree(self, gamma: int, branches: int, history: list[int], key=None) -> Draft:
        """The greedy chain `propose` drafts, plus sibling leaves where the assistant's top-1
        probability is below `split_below` (`sibling_leaves`): deterministic, so one-hot."""
        if gamma == 0 or self.h is None:
            return Draft.empty()
        chain, ids, probs = run_alone(self._draft(gamma, history, ranked=branches))
        mx.eval(chain, ids, probs)
        probs = probs.tolist()
        leaves = sibling_leaves(chain.tolist(), ids.tolist(), probs, [p[0] for p in probs], branches,
                                self.split_below, self.sibling_floor)
        return with_leaves(chain.astype(mx.uint32), leaves, None, forwards=gamma)

    def accept(self, committed: list[int], target_hidden: Optional[mx.array] = None) -> None:
        """`target_hidden`: the target's final hidden states from the round's pass [γ+1, H],
        row i at block token i; the round's last token was chosen at row len(committed) − 1,
        which is the h the next draft starts from."""
        if target_hidden is None:
            self.h = None
        else:
            self.h = target_hidden[len(committed) - 1].reshape(1, 1, -1)
        self.h_at = len(self.state.ids)  # h is the hidden state at the newest cached token
