"""One model's cache and the ids it holds (`SequenceCache`), both models' (`PromptCache`),
and exact rollback.

Speculation writes γ+1 positions into the target's cache and keeps only the accepted ones,
so every layer must be able to forget its last few positions exactly: mlx-lm's plain
`KVCache` can, and our layers (`mlx_spec.cache.layers`) replace those that cannot. After a
draft tree, `settle(kept, rows=...)` moves the accepted rows' K/V into place before the rest
is rolled back. A verify pass never straddles the switch to quantized K/V (`draft_room`):
each row sees keys of the precision plain decoding would have given it.

Caches with recurrent state (SSM / linear-attention layers) cannot roll back at all;
`SequenceCache.rollbackable` says so and the engine then decodes without drafting.
"""

from __future__ import annotations

import copy
from typing import Callable, Optional

import mlx.core as mx
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from mlx_spec.cache.forward import feeding_tree, forward_model, images_opened, text_model, tree_capable
from mlx_spec.cache.global_layers import ChannelQuantizedKVCache, TreeKVCache
from mlx_spec.cache.layer_base import buffer_parts
from mlx_spec.cache.layers import KVQuantization, QuantizedKVReader, make_cache
from mlx_spec.cache.window_layers import WindowKVCache
from mlx_spec.core.steps import drive
from mlx_spec.core.tree import TreeShape
from mlx_spec.runtime import blas

MAX_ROOM = 1 << 30  # no limit on a verify pass's draft tokens


def _max_trim(layer) -> int:
    if isinstance(layer, (WindowKVCache, ChannelQuantizedKVCache)):
        return layer.max_trim()
    if isinstance(layer, (KVCache, QuantizedKVCache)):
        return layer.offset
    return 0  # recurrent state or an overwriting ring: no exact rollback


class SequenceCache:
    """One model, its per-layer cache, and the token ids that cache holds.

    `ids` is what the cache holds once a round is settled: token ids, and where an image
    prompt put image tokens, (id, image hash) keys (`mlx_spec.models.vision.ImagePrompt.keys`). Tokens fed with `forward` during
    a round (draft tokens, still lazy on the device) are unsettled until `settle(kept)`
    keeps a prefix of them and rolls the rest back.

    `vocab`: the model's embedding rows, when ids it lacks can reach it (a draft narrower
    than the target); such ids are fed as id 0 (MLX does not bounds-check gathers). `ids`
    keeps the real ids, so prefix reuse still compares what was said.

    `kv`: quantize the K/V (see `mlx_spec.cache.layers`), or None for full precision.
    """

    def __init__(self, model, slack: int, vocab: Optional[int] = None,
                 kv: Optional[KVQuantization] = None):
        self.model = model
        self.slack = slack
        self.vocab = vocab
        self.kv = kv
        self.cache = make_cache(model, slack)
        self.ids: list[int] = []
        self.unsettled = 0
        # [1, 1, H] final hidden state at the last position the latest prefill fed, when it
        # was asked for one (hidden=True) and fed anything; None once the cache moves on.
        self.prefill_hidden: Optional[mx.array] = None

    @property
    def rollbackable(self) -> bool:
        """Whether every layer can forget positions exactly (plain/windowed KV only)."""
        return all(isinstance(c, (KVCache, QuantizedKVCache, WindowKVCache, ChannelQuantizedKVCache))
                   for c in self.cache)

    @property
    def offset(self) -> int:
        """Positions the cache holds, unsettled ones included."""
        return self.cache[0].offset if self.cache else 0

    @property
    def quantized(self) -> bool:
        return any(hasattr(c, "bits") for c in self.cache)

    def _switch(self) -> int:
        # mlx-lm checks after a forward, so an empty cache's first forward is never quantized
        return max(self.kv.start, 1)

    def draft_room(self, tree: bool = False) -> int:
        """The most draft tokens the next verify pass (from position `offset`) may carry
        without straddling the switch to quantized K/V: rows before the switch must see
        full-precision keys, rows after it quantized ones, as in plain decoding. A `tree`
        also stays inside the key group its root is in (`ChannelQuantizedKVCache`: a
        group's keys would mix the tree's branches)."""
        if self.kv is None:
            return MAX_ROOM
        if not self.quantized and self.offset < self._switch():
            return self._switch() - 1 - self.offset
        if tree and any(isinstance(c, (TreeKVCache, ChannelQuantizedKVCache)) for c in self.cache):
            return self.kv.group_size - 1 - self.offset % self.kv.group_size
        return MAX_ROOM

    def _quantize_when_due(self) -> None:
        # Before a forward, as mlx-lm's maybe_quantize_kv_cache after the previous one; and
        # the layers that quantize keys by group learn which positions are settled.
        if self.kv is not None and not self.quantized and self.offset >= self._switch():
            self.cache = [c.to_quantized(group_size=self.kv.group_size, bits=self.kv.bits)
                          if hasattr(c, "to_quantized") else c for c in self.cache]
        for layer in self.cache:
            if isinstance(layer, ChannelQuantizedKVCache):
                layer.settled = self.offset - self.unsettled
                layer.quantize_settled()  # now rather than at the write: the same positions

    def max_rollback(self) -> int:
        return min((_max_trim(c) for c in self.cache), default=0)

    def reset(self) -> None:
        self.cache = make_cache(self.model, self.slack)
        self.ids = []
        self.unsettled = 0
        self.prefill_hidden = None

    @property
    def tree_capable(self) -> bool:
        return tree_capable(self.model, self.cache)

    @property
    def batchable(self) -> bool:
        """Whether a batch may feed it beside other rows (`mlx_spec.core.batch`): what a tree
        needs, and K/V that never switch to quantized (a batch's forward skips the switch
        `forward` makes, and cannot stack packed triples)."""
        return self.tree_capable and self.kv is None

    def fed_ids(self, tokens: mx.array) -> mx.array:
        """`tokens` as fed to the model: ids past its embedding (`vocab`) become 0."""
        return tokens if self.vocab is None else mx.where(tokens < self.vocab, tokens, 0)

    def forget_padding(self, n: int) -> None:
        """Forget the last n positions just fed: a batch's padding after this row's block."""
        self._trim(n)

    def forward(self, tokens: mx.array, hidden: bool = False, tree: Optional[TreeShape] = None):
        """Feed `tokens` ([n] int) and return logits [n, V], lazily; with hidden=True,
        (logits [n, V], final hidden states [n, H]). With a `tree`, tokens are its
        flattened block [root, x_0..x_N-1] (see `mlx_spec.core.tree`), fed in one pass."""
        self._quantize_when_due()
        if tree is not None:
            root = self.cache[0].offset  # the root's position: every layer agrees
            with feeding_tree(self.model, self.cache, tree, root):
                return self.forward(tokens, hidden)
        self.unsettled += tokens.shape[0]
        self.prefill_hidden = None
        out = self._call(tokens[None], hidden)
        return (out[0][0], out[1][0]) if hidden else out[0]

    def fork(self) -> "SequenceCache":
        """A copy holding the same ids, which then moves independently of this one. The
        arrays are shared until either side writes (MLX copies a shared buffer on write)."""
        if self.unsettled:
            self.settle([])
        twin = copy.copy(self)
        twin.cache = [_fork_layer(layer) for layer in self.cache]
        twin.ids = list(self.ids)
        twin.prefill_hidden = None
        return twin

    @property
    def nbytes(self) -> int:
        return sum(getattr(layer, "nbytes", 0) for layer in self.cache)

    def _call(self, tokens: mx.array, hidden: bool = False, head: bool = True, **embedded):
        """Logits; with hidden=True (logits, final hidden states); with head=False the final
        hidden states only. `embedded`: input embeddings for the rows (`final_hidden`)."""
        tokens = self.fed_ids(tokens)
        cache = self.cache
        if self.quantized:  # Gemma 4's KV-shared layers (no cache of their own) read quantized K/V
            shared = len(text_model(self.model).layers) - len(cache)
            cache = cache + [QuantizedKVReader.of(cache[0])] * shared
        try:
            return forward_model(self.model, tokens, cache, hidden, head, **embedded)
        except BaseException:
            # Interrupted half-way through the layers (Ctrl-C): their offsets disagree now,
            # so no rollback can be exact; start over rather than decode from a torn cache.
            self.reset()
            raise

    def settle(self, kept: list[int], queued: int = 0, rows: Optional[list[int]] = None) -> None:
        """Keep the first len(kept) unsettled positions (their ids are `kept`) and forget the
        rest, except the last `queued` ones: a pass already queued for the next round, whose
        ids are not known on the host yet (they stay unsettled). After a tree, `rows` are
        the unsettled rows to keep (ascending: the root, then the accepted path), one per
        id of `kept`; their K/V move into place first."""
        extra = self.unsettled - len(kept) - queued
        if extra < 0 or (queued and extra) or (rows is not None and len(rows) != len(kept)):
            raise ValueError(f"cannot keep {len(kept)} + {queued} of {self.unsettled} fed positions")
        if rows is not None and rows != list(range(len(rows))):
            self._compact(rows)
        self._trim(extra)
        self.ids.extend(kept)
        self.unsettled = queued

    def rollback(self, n: int) -> None:
        """Forget the last n settled positions."""
        self._trim(n)
        del self.ids[len(self.ids) - n :]

    def _compact(self, rows: list[int]) -> None:
        """Move the K/V of unsettled `rows` to the first len(rows) unsettled slots of every
        layer (a row never moves later: rows ascend from where they start)."""
        for layer in self.cache:
            for buffers, end in _row_buffers(layer):
                first = end - self.unsettled
                index = mx.array(rows) + first
                for part in buffer_parts(buffers):
                    part[..., first : first + len(rows), :] = part[..., index, :]

    def _trim(self, n: int) -> None:
        if n == 0:
            return
        self.prefill_hidden = None
        if n > self.max_rollback():
            raise ValueError(f"cannot roll back {n} positions of {type(self.model).__name__}")
        for layer in self.cache:
            layer.trim(n)

    def prefill(
        self,
        ids: list[int],
        chunk_size: int = 512,
        progress: Optional[Callable[[int, int], None]] = None,
        hidden: bool = False,
        keys: Optional[list] = None,
        inputs: Optional[Callable[[int, int], dict]] = None,
    ) -> int:
        """Make the cache hold exactly `ids`, reusing the longest common prefix it already
        holds (multi-turn chat prefills only the new turn). Returns tokens processed.

        hidden=True also keeps the final hidden state at the last position fed, from the
        last chunk's own pass (no extra forward), in `prefill_hidden` (None if nothing was
        fed): an MTP drafter starts its first draft from it.

        keys: what is compared for prefix reuse and held, a list that begins as long as
        `ids` (an image prompt's: image tokens marked by image); `ids` if None.
        inputs: inputs(begin, end) returns more inputs for the forward of rows begin..end of
        `ids`, by row over the whole of `keys` (an image prompt's input embeddings), or {}
        when those rows need none; called once, when there is anything to feed."""
        return drive(self.prefill_chunks(ids, chunk_size, progress, hidden, keys, inputs))

    def prefill_chunks(self, ids: list[int], chunk_size: int = 512,
                       progress: Optional[Callable[[int, int], None]] = None, hidden: bool = False,
                       keys: Optional[list] = None, inputs: Optional[Callable[[int, int], dict]] = None):
        """`prefill` as a generator that yields after each chunk but the last (a batch decodes
        other requests in between) and returns the tokens processed."""
        self.prefill_hidden = None
        if self.unsettled:
            self.settle([])  # an interrupted round: drop its unsettled positions
        keys = ids if keys is None else keys[: len(ids)]
        common = common_prefix_length(self.ids, keys)
        surplus = len(self.ids) - common
        if surplus and self.quantized and common < self._switch():
            self.reset()  # a fresh cache would hold these positions in full precision
            common = 0
        elif surplus and surplus <= self.max_rollback():
            self.rollback(surplus)
        elif surplus:
            self.reset()
            common = 0
        todo = ids[common:]
        if progress is not None and todo:
            progress(0, len(todo))  # shown before the first chunk, which can take a while
        inputs = dict(inputs(common, len(ids))) if inputs is not None and todo else {}
        blocks = inputs.pop("image_blocks", None)
        if blocks is not None:  # an image's rows see each other: one pass, so no chunk splits an image
            chunk_size = max(len(todo), 1)
        for begin in range(0, len(todo), chunk_size):
            chunk = todo[begin : begin + chunk_size]
            last = hidden and begin + chunk_size >= len(todo)
            self._quantize_when_due()
            rows = slice(common + begin, common + begin + len(chunk))
            with images_opened(self.cache, None if blocks is None else blocks[0, rows]):
                out = self._call(mx.array(chunk)[None], head=not last,
                                 **{name: value[:, rows] for name, value in inputs.items()})
            kept = out[:, -1:, :] if last else None  # [1, 1, H]
            with blas.threads_for(len(chunk)):  # evaluated here: every core's BLAS threads
                mx.eval([c.state for c in self.cache] + ([kept] if last else []))
            self.prefill_hidden = kept
            self.ids.extend(keys[rows])
            if progress is not None:
                progress(begin + len(chunk), len(todo))
            if begin + chunk_size < len(todo):
                yield begin + len(chunk)
        return len(todo)


def _row_buffers(layer) -> list:
    """A cache layer's (buffers holding one position per slot along axis 2, slots used)."""
    if isinstance(layer, ChannelQuantizedKVCache):
        return layer.row_buffers()
    end = layer.offset - getattr(layer, "start", 0)  # WindowKVCache's slot 0 moves
    return [(buffer_parts(layer.keys) + buffer_parts(layer.values), end)]


def _fork_layer(layer):
    # New handles for the layer's arrays: an in-place update (`keys[...] = x`) rebinds the
    # handle it is applied to, so the twin must not hold the same ones.
    twin = copy.copy(layer)
    for name, value in vars(layer).items():
        if isinstance(value, mx.array):
            setattr(twin, name, value[...])
        elif isinstance(value, (list, tuple)):  # a quantized (packed, scales, biases) triple
            setattr(twin, name, type(value)(v[...] if isinstance(v, mx.array) else v for v in value))
    return twin


def common_prefix_length(a: list[int], b: list[int]) -> int:
    """How many leading ids two sequences share."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class PromptCache:
    """Both models' caches; pass the same object to successive calls (multi-turn chat) and
    only tokens not already held are prefilled."""

    def __init__(self, target_model, slack: int, kv: Optional[KVQuantization] = None,
                 draft_kv: Optional[KVQuantization] = None):
        self.slack = slack
        self.draft_kv = draft_kv
        self.target = SequenceCache(target_model, slack, kv=kv)
        self.draft: Optional[SequenceCache] = None

    def draft_for(self, draft_model, vocab: Optional[int] = None) -> SequenceCache:
        """The draft model's cache, created on first use (`vocab` as in `SequenceCache`)."""
        if self.draft is None or self.draft.model is not draft_model:
            self.draft = SequenceCache(draft_model, self.slack, vocab, kv=self.draft_kv)
        return self.draft

    def reset(self) -> None:
        self.target.reset()
        if self.draft is not None:
            self.draft.reset()

    def fork(self) -> "PromptCache":
        """A copy of both caches (see `SequenceCache.fork`)."""
        twin = copy.copy(self)
        twin.target = self.target.fork()
        twin.draft = self.draft.fork() if self.draft is not None else None
        return twin

    @property
    def nbytes(self) -> int:
        return self.target.nbytes + (self.draft.nbytes if self.draft is not None else 0)
