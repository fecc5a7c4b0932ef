"""`mlx-spec serve`: the OpenAI- and Anthropic-compatible server (mlx_spec.server) on uvicorn.

Takes the model, drafter, γ, dtype and preset flags of `generate`; sampling flags set the
defaults for fields a request leaves out. The socket is bound here, before uvicorn starts,
so a taken port is a one-line error and `--port 0` picks a free port (printed). On SIGTERM
or SIGINT the worker stops at once (`Worker.shut_down`): the running answer ends with an
error event, waiting requests get 503, and the process exits 0.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import re
import socket
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from mlx_spec.apps import calibration
from mlx_spec.apps.runner import Gamma, build_engine
from mlx_spec.cli.app import app
from mlx_spec.cli.common import (
    ChatTemplateOpt,
    DrafterOpt,
    DraftKvBitsOpt,
    DraftOpt,
    DraftQuantizeOpt,
    DtypeOpt,
    GammaOpt,
    GroupSizeOpt,
    KvBitsOpt,
    KvGroupSizeOpt,
    KvStartOpt,
    MinPOpt,
    ModelOpt,
    ModelOptions,
    PresetOpt,
    QuantizeOpt,
    RecalibrateOpt,
    RepPenaltyOpt,
    SamplingOptions,
    SeedOpt,
    TempOpt,
    TopKOpt,
    TopPOpt,
    calibrate_gamma,
    setup_models,
)
from mlx_spec.errors import MlxSpecError, UsageError

API_KEY_ENV = "MLX_SPEC_API_KEY"

SERVER = "Server"
@app.command()
def serve(
    host: Annotated[str, typer.Option(
        "--host", rich_help_panel=SERVER,
        help="Address to listen on. 127.0.0.1 (default) is this machine only; 0.0.0.0 (or ::) "
             "is every interface (use --api-key). Beyond loopback, requests must name this "
             "machine in their Host header (see --allowed-hosts).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(
        "--port", "-p", rich_help_panel=SERVER, min=0, max=65535,
        help="TCP port; 0 picks a free one (printed at start).")] = 8080,
    api_key: Annotated[Optional[list[str]], typer.Option(
        "--api-key", rich_help_panel=SERVER, metavar="KEY",
        help="Require 'Authorization: Bearer KEY' (or 'x-api-key: KEY') on every path but "
             "/health (or set MLX_SPEC_API_KEY, one key); printable ASCII. Repeat it for "
             "several keys, any of which will do (see --draft-memory key).")] = None,
    draft_memory: Annotated[str, typer.Option(
        "--draft-memory", rich_help_panel=SERVER, metavar="WHOSE",
        help="Whose earlier requests the suffix drafter drafts from: 'server' (default: "
             "every request this server answered), 'key' (only the same API key's, so no "
             "key's answers speed up, and so reveal, another's), or 'off' (this request's "
             "own text only).")] = "server",
    draft_memory_tokens: Annotated[int, typer.Option(
        "--draft-memory-tokens", rich_help_panel=SERVER, min=0, metavar="N",
        help="Tokens of earlier requests each draft memory holds, the oldest evicted "
             "(~20 bytes each, plus 16 MB).")] = 1 << 20,
    allowed_hosts: Annotated[Optional[str], typer.Option(
        "--allowed-hosts", rich_help_panel=SERVER, metavar="NAME,...",
        help="Host header names to answer, comma-separated, besides loopback ones and, with "
             "a non-loopback --host, this machine's own (--host, the bound address, host name "
             "and FQDN; on 0.0.0.0 or :: also their addresses and the default route's); '*' "
             "answers any. Against DNS rebinding by web pages.")] = None,
    served_model_name: Annotated[Optional[str], typer.Option(
        "--served-model-name", rich_help_panel=SERVER, metavar="NAME",
        help="The model's name in /v1/models, /health and answers; a request naming any "
             "other model is answered by this one, under this name (see --strict-model-names). "
             "Default: --model as given, which /health (open without a key) shows only by its "
             "last part when it is a local path.")] = None,
    strict_model_names: Annotated[bool, typer.Option(
        "--strict-model-names", rich_help_panel=SERVER,
        help="Answer 404 to requests that name neither the served name nor the preset.")] = False,
    queue_size: Annotated[int, typer.Option(
        "--queue-size", rich_help_panel=SERVER, min=1,
        help="Requests that may wait (or be tokenized) while --parallel generate; more are "
             "answered 503 with Retry-After, before tokenizing.")] = 8,
    parallel: Annotated[int, typer.Option(
        "--parallel", rich_help_panel=SERVER, min=1, max=64,
        help="Requests decoded together: each round one target forward verifies every running "
             "request's draft, each exact as if alone; requests join and leave between rounds. "
             "1 serves one at a time. More wait in the queue (--queue-size).")] = 4,
    max_tokens: Annotated[Optional[int], typer.Option(
        "--max-tokens", "-n", rich_help_panel=SERVER, min=1,
        help="Completion tokens when a request does not say. Default: until the model stops "
             "or the context is full (OpenAI's meaning). A request's own max_tokens past the "
             "context is clamped to what fits.")] = None,
    log_level: Annotated[str, typer.Option(
        "--log-level", rich_help_panel=SERVER, metavar="LEVEL",
        help="uvicorn's log level: warning, info (one line per request) or debug.")] = "warning",
    cache_memory: Annotated[Optional[float], typer.Option(
        "--cache-memory", rich_help_panel=SERVER, min=0.0, metavar="GB",
        help="KV memory for cached conversations (several are kept, least recently used "
             "dropped first); default: half the memory free once the models are "
             "loaded.")] = None,
    prompt_cache_dir: Annotated[Optional[Path], typer.Option(
        "--prompt-cache-dir", rich_help_panel=SERVER, metavar="DIR",
        help="Keep cached conversations in DIR too: the memory pool writes each one it drops "
             "(and all at exit) there, and this or a later server reuses them by longest "
             "prefix, so a restart does not prefill a long prompt again. Files are checked "
             "against the models, tokenizer, dtype and window; unusable ones are skipped with "
             "a warning. Several servers may share DIR. The suffix drafter's memory is kept "
             "there too, one file per --draft-memory scope.")] = None,
    prompt_cache_disk: Annotated[float, typer.Option(
        "--prompt-cache-disk", rich_help_panel=SERVER, min=0.0, metavar="GB",
        help="Disk space the files in --prompt-cache-dir may take; the least recently used "
             "go first.")] = 10.0,
    cors_origin: Annotated[Optional[list[str]], typer.Option(
        "--cors-origin", rich_help_panel=SERVER, metavar="ORIGIN",
        help="Let browser pages from ORIGIN (e.g. http://localhost:3000, or *) call the API "
             "(application/json bodies, with the key if --api-key is set); repeatable. Off by "
             "default: no CORS headers are sent.")] = None,
    parse_special_in_text: Annotated[bool, typer.Option(
        "--parse-special-in-text", rich_help_panel=SERVER,
        help="Read special-token text in messages (e.g. '<start_of_turn>') as those control "
             "tokens, so a message can write turn markers. Off by default: it is plain text "
             "and only the chat template writes control tokens.")] = False,
    allow_image_urls: Annotated[bool, typer.Option(
        "--allow-image-urls", rich_help_panel=SERVER,
        help="Fetch images that requests name by http(s) URL. Off by default: such a request "
             "is answered 400; data: URLs and base64 are read either way.")] = False,
    allow_private_image_urls: Annotated[bool, typer.Option(
        "--allow-private-image-urls", rich_help_panel=SERVER,
        help="With --allow-image-urls, fetch from loopback, private and link-local addresses "
             "too. Off by default: a client could otherwise reach services behind the server.")] = False,
    allow_image_files: Annotated[bool, typer.Option(
        "--allow-image-files", rich_help_panel=SERVER,
        help="Read images that requests name by a local path or file: URL, from this "
             "machine's disk. Off by default (a 400): a client could otherwise probe the "
             "server's files.")] = False,
    body_timeout: Annotated[float, typer.Option(
        "--body-timeout", rich_help_panel=SERVER, min=0.1, metavar="SECONDS",
        help="A request's whole body must arrive within this many seconds of its headers, or "
             "it is answered 408 and its connection closed, so clients that trickle bytes "
             "cannot hold connections; 60 s is 16 MiB (the largest body) at 2.3 Mbit/s.")] = 60.0,
    timeout_keep_alive: Annotated[float, typer.Option(
        "--timeout-keep-alive", rich_help_panel=SERVER, min=0.1, metavar="SECONDS",
        help="Close a kept-alive connection that sends no new request for this many "
             "seconds (uvicorn's option).")] = 5.0,
    keep_alive: Annotated[str, typer.Option(
        "--keep-alive", rich_help_panel=SERVER, metavar="DURATION",
        help="Unload the models (and drop the cached conversations) once no request has run "
             "or waited for this long, and load them again for the next request: e.g. 5m, "
             "30s, 1h, or seconds; -1 or forever (default) keeps them loaded. A request's "
             "keep_alive field (Ollama's) sets it for the time after that request. The "
             "tokenizer stays loaded.")] = "forever",
    model: ModelOpt = None,
    draft_model: DraftOpt = None,
    drafter: DrafterOpt = None,
    preset: PresetOpt = None,
    gamma: GammaOpt = None,
    recalibrate: RecalibrateOpt = False,
    dtype: DtypeOpt = None,
    quantize: QuantizeOpt = None,
    draft_quantize: DraftQuantizeOpt = None,
    group_size: GroupSizeOpt = None,
    kv_bits: KvBitsOpt = None,
    kv_group_size: KvGroupSizeOpt = None,
    kv_start: KvStartOpt = None,
    draft_kv_bits: DraftKvBitsOpt = None,
    chat_template: ChatTemplateOpt = None,
    temp: TempOpt = None,
    top_p: TopPOpt = None,
    top_k: TopKOpt = None,
    min_p: MinPOpt = None,
    repetition_penalty: RepPenaltyOpt = None,
    seed: SeedOpt = None,
) -> None:
    """Serve the model over OpenAI-compatible (chat, completions, responses) and
    Anthropic-compatible (messages) HTTP APIs, streamed or not, with tool calls, the target's log-probs, several
    conversations cached at once, exact speculative decoding and its statistics in each
    answer; GET /metrics for Prometheus.

    Example:  mlx-spec serve --port 8080  ·  then point any OpenAI client at
    http://127.0.0.1:8080/v1, or an Anthropic one at http://127.0.0.1:8080
    """
    import uvicorn

    from mlx_spec.apps.distributed import world
    from mlx_spec.server import ServerOptions, create_app
    from mlx_spec.server.guards import check_api_key
    from mlx_spec.server.options import DEFAULT_CONTEXT

    if world().active:  # requests reach rank 0 only; the other ranks would wait forever
        raise MlxSpecError("serve does not run across ranks (mlx.launch); generate, chat and bench do")
    if log_level not in ("critical", "error", "warning", "info", "debug", "trace"):
        raise UsageError(f"unknown --log-level {log_level!r}: use warning, info or debug")
    if not api_key and os.environ.get(API_KEY_ENV):
        # one key, read here: Click would split a list option's variable at spaces, and
        # a key with a space must be refused, not taken as two keys
        api_key = [os.environ[API_KEY_ENV]]
    check_api_key(api_key)
    if served_model_name is not None and not served_model_name.strip():
        raise UsageError("--served-model-name needs a name")
    for origin in cors_origin or ():
        if not re.fullmatch(r"\*|https?://[^/\s]+", origin):
            raise UsageError(f"--cors-origin {origin!r} is not an origin: give scheme://host[:port] "
                               "(e.g. http://localhost:3000) or *")
    from mlx_spec.server.worker import MEMORY_SCOPES, keep_alive_seconds

    if draft_memory not in MEMORY_SCOPES:
        raise UsageError(f"--draft-memory {draft_memory!r}: use {', '.join(MEMORY_SCOPES)}")

    try:
        idle_seconds = keep_alive_seconds(keep_alive)
    except ValueError as error:
        raise UsageError(f"--keep-alive: {error}") from None
    if prompt_cache_dir is not None:
        from mlx_spec.core.cache.files import writable_folder

        writable_folder(prompt_cache_dir, "--prompt-cache-dir")
    sock = _bind(host, port, keyed=bool(api_key))  # before loading models: a taken port fails fast
    served_hosts = _served_hosts(allowed_hosts, host, sock.getsockname()[0])
    if served_hosts is not None and not _loopback(sock.getsockname()[0]):
        print(f"answering requests for {', '.join(served_hosts)} and loopback names (more: "
              "--allowed-hosts)", file=sys.stderr)
    calibration.recalibrate(recalibrate)
    models = ModelOptions.from_flags(locals(), draft_on=None)
    sampling = SamplingOptions.from_flags(locals())

    def load_setup():
        return setup_models(models, sampling, chat=True)  # /v1/chat/completions renders templates

    setup = load_setup()
    params = setup.params
    engine = build_engine(setup.pair, setup.drafter, **setup.engine_options)
    gamma_mode = setup.gamma if engine.drafter is not None else Gamma.OFF
    calibrate_gamma(engine, gamma_mode, 256)  # measured once now, not in a request

    def load():
        """The engine again after a keep-alive unload: the same files, flags and drafter;
        the cost curve comes from the cache. The new tokenizer is dropped (the server keeps
        its own)."""
        again = build_engine(load_setup().pair, setup.drafter, **setup.engine_options)
        calibrate_gamma(again, gamma_mode, 256)
        return again
    preset_name = getattr(setup.preset, "name", None)
    served = served_model_name.strip() if served_model_name else setup.target
    options = ServerOptions(
        model_name=served,
        aliases=(preset_name,) if preset_name and preset_name != served else (),
        strict_model_names=strict_model_names,
        public_name=served if served_model_name else _public_name(served),
        gamma=gamma_mode,
        defaults=params,
        max_tokens=max_tokens,
        context_length=setup.pair.target.context_length or DEFAULT_CONTEXT,
        queue_size=queue_size,
        parallel=parallel,
        api_key=tuple(api_key) if api_key else None,
        allowed_hosts=served_hosts,
        cache_budget=None if cache_memory is None else int(cache_memory * 2**30),
        cors_origins=tuple(cors_origin or ()),
        parse_special_in_text=parse_special_in_text,
        allow_image_urls=allow_image_urls, allow_private_image_urls=allow_private_image_urls,
        allow_image_files=allow_image_files,
        body_timeout=body_timeout,
        keep_alive=idle_seconds,
        prompt_cache_dir=None if prompt_cache_dir is None else str(prompt_cache_dir),
        prompt_cache_disk=int(prompt_cache_disk * 2**30),
        draft_memory=draft_memory,
        draft_memory_tokens=draft_memory_tokens,
    )
    application = create_app(engine, setup.pair.tokenizer, options, load=load)
    bound_host, bound_port = sock.getsockname()[:2]
    shown = f"[{bound_host}]" if ":" in bound_host else bound_host
    drafter_name = engine.drafter.name if engine.drafter is not None else "none"
    print(f"mlx-spec serve: {options.model_name!r} (drafter {drafter_name}, γ {gamma_mode}) "
          f"at http://{shown}:{bound_port}/v1  (Ctrl-C stops)", file=sys.stderr, flush=True)
    config = uvicorn.Config(application, log_level=log_level, timeout_graceful_shutdown=5,
                            timeout_keep_alive=timeout_keep_alive)
    # Only the worker may hold the models, so that a keep-alive unload frees them.
    del engine
    setup.pair = None
    _run(config, application.state.worker, sock)


def _run(config, worker, sock: socket.socket) -> None:
    """uvicorn's server, which also tells the worker to stop as soon as a signal comes:
    otherwise it would generate through uvicorn's grace period and cut the stream off."""
    import uvicorn

    class Server(uvicorn.Server):
        async def serve(self, sockets=None):
            self.exit_loop = asyncio.get_running_loop()
            await super().serve(sockets)

        def handle_exit(self, sig, frame):
            # A signal handler runs between the loop's callbacks: queue the work on the loop.
            self.exit_loop.call_soon_threadsafe(worker.shut_down)
            super().handle_exit(sig, frame)
            self._captured_signals.clear()  # handled: not re-raised after shutdown, so exit 0

    Server(config).run(sockets=[sock])


def _served_hosts(allowed: Optional[str], host: str, bound: str) -> Optional[tuple[str, ...]]:
    """Host names served besides loopback ones (None: any, for '*'): --allowed-hosts, and
    when listening beyond loopback this machine's names (`_machine_names`). A web page can
    rebind its own name to any address of this machine, but not send another's name."""
    from mlx_spec.server.guards import ANY_HOST

    names: list[str] = []
    if allowed is not None:
        names = [name.strip() for name in allowed.split(",") if name.strip()]
        if not names:
            raise UsageError("--allowed-hosts needs at least one name (or '*')")
        if ANY_HOST in names:
            return None
    if not _loopback(bound):
        names += _machine_names(host, bound)
    return tuple(name for name in dict.fromkeys(names)  # loopback names are always served
                 if name and name.lower() != "localhost" and not _loopback(name))


def _machine_names(host: str, bound: str) -> list[str]:
    """What clients call this machine: --host as given, the bound address, the host name
    and FQDN; on every interface (0.0.0.0, ::) also the addresses those names resolve to
    and the address of the default route (found by a UDP connect, which sends nothing).
    Other interfaces' addresses need --allowed-hosts: listing them takes a library."""
    hostnames = [socket.gethostname(), socket.getfqdn()]
    names = [host, bound, *hostnames]
    if not ipaddress.ip_address(bound).is_unspecified:
        return names
    for name in hostnames:
        try:
            names += [info[4][0] for info in socket.getaddrinfo(name, None)]
        except OSError:  # a host name that does not resolve
            pass
    # Documentation addresses (RFC 5737, RFC 3849): only the route to them is looked up.
    for family, probe in ((socket.AF_INET, "192.0.2.1"), (socket.AF_INET6, "2001:db8::1")):
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as udp:
                udp.connect((probe, 9))
                names.append(udp.getsockname()[0])
        except OSError:  # no such route, or no IPv6
            pass
    return names


def _public_name(model: str) -> str:
    """What /health, which needs no key, calls the model: a local path's last part only
    (the rest tells a stranger about this machine's folders), else the name as given."""
    path = Path(model).expanduser()
    return path.resolve().name if path.exists() else model


def _bind(host: str, port: int, keyed: bool) -> socket.socket:
    """A listening socket, with a warning when it is reachable from other machines."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as error:
        raise MlxSpecError(f"cannot resolve --host {host!r}: {error.strerror}") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(128)
    except OSError as error:
        sock.close()
        raise MlxSpecError(f"cannot listen on {host}:{port}: {error.strerror}") from None
    if not _loopback(address[0]):
        print(f"warning: listening on {host}, which other machines can reach; anyone who can "
              "connect can use the model" + ("" if keyed else " (add --api-key to require "
              "a key)"), file=sys.stderr)
    return sock


def _loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False

