"""`ServerOptions`: what `mlx-spec serve` serves and how, as `create_app` takes it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from mlx_spec.apps.runner import Gamma
from mlx_spec.core.sampling import SamplingParams
from mlx_spec.server.guards import BODY_TIMEOUT_S
from mlx_spec.server.worker import FOREVER

# The server bounds every answer by the context: for a model whose config names no context
# length (`LoadedModel.context_length` is None, and the engine sets no limit), this one.
DEFAULT_CONTEXT = 8192


@dataclass
class ServerOptions:
    """What the server serves and how.

    Attributes:
        model_name: the served name: the first id in `/v1/models` and the "model" of every
            answer; a request naming another model is answered by this one, under this name.
        aliases: other names of the model (e.g. the preset), listed after it in `/v1/models`.
        strict_model_names: refuse (404) requests that name neither model_name nor an alias.
        public_name: the name /health shows, as it needs no key (None: model_name); the
            CLI passes a local model path's last part only.
        gamma: a `runner.Gamma`, or its text ("auto", "tree" or a whole number).
        defaults: sampling values for fields a request leaves out.
        max_tokens: completion length when a request gives none; None: until the model
            stops or the context is full (OpenAI's meaning of leaving it out).
        context_length: prompt plus completion tokens the model takes.
        queue_size: requests that may wait while `parallel` generate.
        parallel: requests decoded together (`worker.Worker`); 1: one at a time.
        api_key: if set, every request but /health needs "Authorization: Bearer <key>" (or
            "x-api-key: <key>"); printable ASCII (`guards.check_api_key`); a tuple: any of
            these keys (tenants, as `draft_memory` "key" tells apart).
        allowed_hosts: Host names served besides loopback ones; None serves any.
        cache_budget: bytes of KV the cached conversations may hold (None: from the
            device's free memory; see `worker.Worker`).
        cors_origins: origins whose browser pages may call the API (none by default).
        parse_special_in_text: read control-token text in messages ("<start_of_turn>") as
            control tokens; off, it is text and only the chat template writes them
            (`prompt.ChatPrompts`).
        body_timeout: seconds a request's whole body may take to arrive (then 408).
        keep_alive: idle seconds before the models are unloaded (`worker.FOREVER`: never);
            needs `create_app`'s `load`.
        allow_image_urls: fetch images that requests name by http(s) URL (off: a 400).
        allow_private_image_urls: fetch them from loopback, private and link-local addresses
            too (off: refused like any URL that cannot be fetched).
        allow_image_files: read images that requests name by local path or file: URL (off: a 400).
        prompt_cache_dir: a folder for cached conversations that outlive the server (None:
            memory only); prompt_cache_disk: the bytes its files may take.
        draft_memory: whose earlier requests a drafter that remembers (the suffix drafter)
            drafts from: "server" (everyone's), "key" (the same API key's only) or "off";
            draft_memory_tokens: tokens each such memory holds, the oldest evicted.
    """

    model_name: str
    aliases: tuple[str, ...] = ()
    strict_model_names: bool = False
    gamma: Gamma | str = "auto"
    defaults: SamplingParams = SamplingParams()
    max_tokens: Optional[int] = None
    context_length: int = DEFAULT_CONTEXT
    queue_size: int = 8
    parallel: int = 1  # `serve` defaults to 4
    api_key: Optional[str | tuple[str, ...]] = None
    allowed_hosts: Optional[tuple[str, ...]] = ()
    public_name: Optional[str] = None
    cache_budget: Optional[int] = None
    cors_origins: tuple[str, ...] = ()
    parse_special_in_text: bool = False
    body_timeout: float = BODY_TIMEOUT_S
    keep_alive: float = FOREVER
    allow_image_urls: bool = False
    allow_private_image_urls: bool = False
    allow_image_files: bool = False
    prompt_cache_dir: Optional[str] = None
    prompt_cache_disk: int = 10 * 2**30
    draft_memory: str = "server"
    draft_memory_tokens: int = 1 << 20
