"""mlx-lm's prompt cache files (`mlx_lm.cache_prompt`, `mlx_lm.generate --prompt-cache-file`),
read and written for `generate --prompt-cache FILE`.

mlx-lm's layout (`mlx_lm.models.cache.save_prompt_cache`) is one model's per-layer cache
states as arrays "layer.item", and metadata `[user metadata, class names, scalars]`
flattened. It holds no token ids: the prompt given with the file continues whatever the
cache holds. Our files add the ids, the key (`files.cache_key`) and a digest under the
user metadata key "mlx_spec", which mlx-lm ignores; a file without them (made by mlx-lm)
is checked as far as it can be: its layers' kinds, windows and shapes against this model's,
and the model it names.

Our caches become mlx-lm's on the way out (`TreeKVCache` a `KVCache`, `WindowKVCache` a
`RotatingKVCache` holding its window's last positions in order) and ours on the way in; a
`RotatingKVCache` is taken only when it holds every position the next query's window needs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache, RotatingKVCache, load_prompt_cache

from mlx_spec.core.cache.files import CacheFileError, _mismatch, content_digest, write_safetensors
from mlx_spec.core.cache.global_layers import TreeKVCache
from mlx_spec.core.cache.layers import make_cache
from mlx_spec.core.cache.sequence import PromptCache, SequenceCache
from mlx_spec.core.cache.window_layers import WindowKVCache

PLACEHOLDER = -1  # the id of a cached position whose id a file made by mlx-lm does not say


def _theirs(layer):
    """Our layer as the mlx-lm cache it stands for."""
    if getattr(layer, "bits", None) is not None:  # mlx-lm's files have no quantized sliding windows
        raise CacheFileError("a quantized K/V cache (--kv-bits) cannot be written in mlx-lm's layout")
    if isinstance(layer, WindowKVCache):
        held = layer.offset - layer.start
        kept = min(held, layer.window)  # a RotatingKVCache holds the window's last positions
        keys = layer.keys[..., held - kept : held, :]
        values = layer.values[..., held - kept : held, :]
        return RotatingKVCache.from_state((keys, values, layer.offset, 0, layer.window, kept))
    if isinstance(layer, KVCache):
        return KVCache.from_state((layer.keys[..., : layer.offset, :], layer.values[..., : layer.offset, :],
                                   layer.offset))
    return layer


def _state_arrays(layers: list) -> tuple[dict, list]:
    """mlx-lm cache layers' states as the arrays its `save_prompt_cache` writes (scalars as
    0-d arrays), and its list of the names that were scalars."""
    arrays, scalars = {}, [""]
    for name, value in tree_flatten([layer.state for layer in layers]):
        if isinstance(value, mx.array):
            arrays[name] = value
        elif isinstance(value, (int, float, bool)):
            scalars.append((name, "scalar"))
            arrays[name] = mx.array(value)
        else:
            raise CacheFileError(f"a cache state of type {type(value).__name__} cannot be saved")
    return arrays, scalars


def save_mlx_lm_cache(path: Path, seq: SequenceCache, key: dict, model_name: str) -> int:
    """Write the target's cache in mlx-lm's layout (what `mlx_lm.cache_prompt` writes for
    `model_name`), with our ids and key, atomically. Every id it holds must have been fed
    (mlx-lm continues right after them). Raises OSError when the write fails."""
    layers = [_theirs(layer) for layer in seq.cache]
    arrays, scalars = _state_arrays(layers)
    ours = {"key": key, "ids": seq.ids, "digest": content_digest(arrays)}
    user = {"model": model_name, "tokenizer_config": json.dumps({}), "mlx_spec": json.dumps(ours)}
    metadata = dict(tree_flatten([user, [type(layer).__name__ for layer in layers], scalars]))
    return write_safetensors(path, arrays, metadata)


def load_mlx_lm_cache(path: Path, engine, key: dict, model_names: tuple) -> tuple[PromptCache, Optional[list]]:
    """The target's cache from an mlx-lm prompt cache file, and the ids it holds (None for a
    file made by mlx-lm, which does not say them). `model_names`: what the target may be
    called in such a file (as given, its folder). Raises CacheFileError (one line) for a
    file that cannot be read or does not fit this model."""
    try:
        layers, user = load_prompt_cache(str(path), return_metadata=True)
    except FileNotFoundError:
        raise CacheFileError(f"no such file: {path}") from None
    except Exception as error:  # mx.load's errors, or a layout that is not mlx-lm's
        first = (str(error).splitlines() or [type(error).__name__])[0]
        raise CacheFileError(f"{path} is not an mlx-lm prompt cache ({first})") from None
    ids = None
    if "mlx_spec" in user:
        try:
            ours = json.loads(user["mlx_spec"])
            ids = [int(t) for t in ours["ids"]]
        except (ValueError, KeyError, TypeError):
            raise CacheFileError(f"{path} is damaged (its mlx_spec metadata)") from None
        why = _mismatch(ours.get("key") or {}, key)
        if why:
            raise CacheFileError(f"{path} does not fit this model: {why}")
        # the loaded layers' states are the file's arrays: no second read of the file
        if ours.get("digest") != content_digest(_state_arrays(layers)[0]):
            raise CacheFileError(f"{path} is damaged (its arrays do not match their digest)")
    elif user.get("model") not in (None, *model_names) and not any(_same_path(user["model"], name)
                                                                  for name in model_names):
        raise CacheFileError(f"{path} was made for model {user['model']!r}, not {model_names[0]!r}")
    cache = engine.make_prompt_cache()
    try:
        cache.target.cache = _ours(layers, engine.target, cache.slack)
    except CacheFileError as error:
        raise CacheFileError(f"{path} does not fit this model: {error}") from None
    offset = cache.target.cache[0].offset
    if ids is not None and len(ids) != offset:
        raise CacheFileError(f"{path} is damaged: {len(ids)} ids for {offset} cached positions")
    cache.target.ids = ids if ids is not None else [PLACEHOLDER] * offset
    return cache, ids


def _same_path(a: str, b: str) -> bool:
    try:
        return Path(a).expanduser().resolve() == Path(b).expanduser().resolve() and Path(a).exists()
    except OSError:
        return False


def _ours(layers: list, model, slack: int) -> list:
    """mlx-lm's layers as ours, checked against the ones `model` makes (kinds, windows,
    head shapes: a probe of one token through a fresh cache shows them)."""
    probe = make_cache(model, slack)
    model(mx.array([[0]]), cache=probe)
    if len(layers) != len(probe):
        raise CacheFileError(f"it holds {len(layers)} cache layers, the model makes {len(probe)}")
    offsets = {getattr(layer, "offset", None) for layer in layers}
    if len(offsets) != 1 or None in offsets:
        raise CacheFileError("its layers hold different numbers of positions")
    result = []
    for i, (layer, made) in enumerate(zip(layers, probe)):
        if isinstance(made, WindowKVCache) and type(layer) is RotatingKVCache and layer.keep == 0 \
                and layer.max_size == made.window:
            keys, values = (layer._temporal_order(v) for v in (layer.keys, layer.values))
            held = keys.shape[2]
            if held < min(layer.offset, made.window - 1):
                raise CacheFileError(f"layer {i} holds {held} positions, its window needs {made.window - 1}")
            mine = WindowKVCache.from_state((keys, values), (made.window, slack, layer.offset, layer.offset - held))
        elif isinstance(made, TreeKVCache) and type(layer) is KVCache:
            mine = TreeKVCache.from_state((layer.keys[..., : layer.offset, :],
                                           layer.values[..., : layer.offset, :], layer.offset))
        else:
            window = getattr(layer, "max_size", None)
            raise CacheFileError(f"layer {i} is a {type(layer).__name__}"
                                 + (f" of window {window}" if window else "")
                                 + f" where the model makes a {type(made).__name__}")
        if layer.offset and (mine.keys.shape[1] != made.keys.shape[1] or mine.keys.shape[3] != made.keys.shape[3]
                             or mine.keys.dtype != made.keys.dtype):
            raise CacheFileError(f"layer {i}'s keys are {mine.keys.shape[1]} heads × {mine.keys.shape[3]} "
                                 f"{mine.keys.dtype}, the model's {made.keys.shape[1]} × {made.keys.shape[3]} "
                                 f"{made.keys.dtype}")
        result.append(mine)
    return result


def open_prompt_ids(tokenizer, text: str, chat: bool, template_kwargs: Optional[dict] = None) -> list[int]:
    """The prompt as `mlx_lm.cache_prompt` caches it: with a chat template, one user message
    left open (a later prompt continues it); else the text's ids."""
    if chat:
        return list(tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                  add_generation_prompt=False, continue_final_message=True,
                                                  **(template_kwargs or {})))
    return list(tokenizer.encode(text))


def continuation_ids(tokenizer, text: str, chat: bool, template_kwargs: Optional[dict] = None) -> list[int]:
    """The ids that follow a cached prompt, as `mlx_lm.generate --prompt-cache-file` makes
    them: with a chat template, the rest of the open user message (the template rendered
    around a stand-in, cut where it stood) and the assistant's opener; else the text's ids."""
    if not chat:
        return list(tokenizer.encode(text, add_special_tokens=False))
    render = lambda content: tokenizer.apply_chat_template(  # noqa: E731
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True,
        **(template_kwargs or {}))
    full = render(text)
    rest = full[render("<query>").index("<query>"):]
    return list(tokenizer.encode(rest, add_special_tokens=False))
