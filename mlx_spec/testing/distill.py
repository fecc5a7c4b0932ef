"""Distilling an MTP assistant from its target: a tiny assistant that actually predicts a
tiny target, in seconds, so tests and benchmarks can see acceptance that is not chance.

The data are the target's own greedy continuations. One target pass over each sequence
(plain caches on every layer, so every position's keys stay) gives the final hidden states
and the K/V of the layers the assistant reads. An example is a position p of the generated
part: from the token at p and the hidden state at p − 1 the assistant must draft the next
`steps` tokens, fed back as at inference (its projected hidden state; the embedding of the
previous token, teacher-forced), attending to the keys before p (sliding: the window − 1
newest), with its query at position p (the drafter's default convention).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx_lm.models.cache import KVCache

from mlx_spec.core.cache.forward import logits_and_hidden
from mlx_spec.models.gemma4_assistant import last_kv_layers, target_text_model


@dataclass
class Teacher:
    tokens: mx.array  # [n, N] sequences (prompt + greedy continuation)
    hidden: mx.array  # [n, N, H_target] final post-norm hidden states
    kv: dict  # layer type -> (keys, values) [n, kv_heads, N, head_dim]
    first: int  # the first position p whose labels are all the target's greedy choices


def teacher_data(target, prompts: list[list[int]], length: int) -> Teacher:
    """Greedy continuations of equally long `prompts` to `length` tokens in all, and the
    target's hidden states and shared K/V over them."""
    inner = target_text_model(target)
    layers = last_kv_layers(inner.config)
    rows, hiddens, kvs = [], [], {t: ([], []) for t in layers}
    for prompt in prompts:
        ids = list(prompt)
        cache = [KVCache() for _ in target.make_cache()]
        logits, _ = logits_and_hidden(target, mx.array([ids]), cache)
        while len(ids) < length:  # plain greedy decoding
            ids.append(mx.argmax(logits[0, -1]).item())
            logits, _ = logits_and_hidden(target, mx.array([ids[-1:]]), cache)
        # one pass over the whole sequence: hidden states and K/V for every position
        cache = [KVCache() for _ in target.make_cache()]
        _, hidden = logits_and_hidden(target, mx.array([ids]), cache)
        rows.append(ids)
        hiddens.append(hidden[0])
        for layer_type, index in layers.items():
            kvs[layer_type][0].append(cache[index].keys[0, :, :length])
            kvs[layer_type][1].append(cache[index].values[0, :, :length])
    kv = {t: (mx.stack(k), mx.stack(v)) for t, (k, v) in kvs.items()}
    first = max(len(p) for p in prompts) - 1
    return Teacher(mx.array(rows), mx.stack(hiddens), kv, first)


def _batch_loss(assistant, embed, window: int, teacher: Teacher, seq: mx.array, pos: mx.array, steps: int):
    """Mean cross-entropy of `steps` teacher-forced draft steps at (seq[b], pos[b])."""
    N = teacher.tokens.shape[1]
    keys = mx.arange(N)[None]
    before = keys < pos[:, None]
    masks = {"full_attention": before[:, None, None, :],
             "sliding_attention": (before & (keys >= pos[:, None] - (window - 1)))[:, None, None, :]}
    kv = {t: (k[seq], v[seq]) for t, (k, v) in teacher.kv.items()}
    h = teacher.hidden[seq, pos - 1][:, None]  # [B, 1, H_target]
    loss = 0.0
    for j in range(steps):
        token = teacher.tokens[seq, pos + j][:, None]
        h_d = assistant.hidden(mx.concatenate([embed(token), h], axis=-1), kv, pos, masks)
        label = teacher.tokens[seq, pos + j + 1][:, None]
        logits = assistant.model.embed_tokens.as_linear(h_d)  # the dense head's logits
        loss = loss + nn.losses.cross_entropy(logits, label, reduction="mean")
        h = assistant.post_projection(h_d)
    return loss / steps


def distill(assistant, target, teacher: Teacher, *, steps: int = 3, iterations: int = 300,
            batch: int = 64, learning_rate: float = 3e-3, seed: int = 0) -> list[float]:
    """Train `assistant` (dense head) in place on `teacher`; returns the loss per iteration."""
    inner = target_text_model(target)
    window = inner.config.sliding_window

    def embed(ids):
        return mx.stop_gradient(inner.embed_tokens(ids) * inner.embed_scale)

    n, N = teacher.tokens.shape
    positions = mx.array([(s, p) for s in range(n) for p in range(max(teacher.first, 1), N - steps)])
    loss_and_grad = nn.value_and_grad(
        assistant, lambda s, p: _batch_loss(assistant, embed, window, teacher, s, p, steps))
    optimizer = optim.Adam(learning_rate=learning_rate)
    key, losses = mx.random.key(seed), []
    for _ in range(iterations):
        key, sub = mx.random.split(key)
        pick = positions[mx.random.randint(0, positions.shape[0], (batch,), key=sub)]
        loss, grads = loss_and_grad(pick[:, 0], pick[:, 1])
        optimizer.update(assistant, grads)
        mx.eval(assistant.parameters(), optimizer.state, loss)
        losses.append(loss.item())
    return losses

