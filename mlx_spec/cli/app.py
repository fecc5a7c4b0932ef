"""The root command: `app`, its global flags, and one-line errors for everything beneath it."""

from __future__ import annotations

import os
import sys
import time

import typer
from typer.core import TyperGroup

try:  # newer Typer parses with its own copy of click, so its errors are that copy's classes
    from typer._click import exceptions as click_errors
except ImportError:
    from click import exceptions as click_errors

from mlx_spec.errors import MlxSpecError, UsageError

DEBUG_ENV = "MLX_SPEC_DEBUG"


class _FriendlyErrors(TyperGroup):
    """Every error is one line on stderr, `error: ...`: known errors exit 1, and `--debug`
    (or MLX_SPEC_DEBUG=1) re-raises them with the traceback; usage errors (a bad flag
    value, whether Click or our own checks refuse it, an unknown flag or command, a
    missing argument) exit 2 and name the flag."""

    debug = False  # set by --debug for this invocation only

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        from mlx_spec.cli.help_names import readable_value_names

        readable_value_names(self)  # the whole tree: built before its root

    def make_context(self, info_name, args, parent=None, **extra):
        try:  # the root's own flags: `mlx-spec --bogus`
            return super().make_context(info_name, args, parent, **extra)
        except click_errors.UsageError as error:
            _usage_error(error)

    def invoke(self, ctx):
        from mlx_spec.apps.distributed import quiet_error, world

        _FriendlyErrors.debug = False
        try:
            return super().invoke(ctx)
        except click_errors.UsageError as error:  # a subcommand's flags, or an unknown command
            _usage_error(error, ctx)
        except (typer.Exit, typer.Abort, click_errors.ClickException):
            raise  # typer.Exit is a RuntimeError: let it through untouched
        except Exception as error:
            # Across ranks (mlx.launch), each error is said once: by rank 0 when every rank
            # hit it, else by the rank it happened on (World.check names it); a rank whose
            # peer failed ends without a message.
            w = world()
            debug = _FriendlyErrors.debug or os.environ.get(DEBUG_ENV)
            if w.active and (quiet_error(error) or not (w.is_root or debug or getattr(error, "rank_local", False))):
                if not w.is_root:
                    # mlx.launch kills every rank once one exits with an error: leaving at
                    # once could end rank 0 before it says the error every rank hit
                    time.sleep(QUIET_RANK_GRACE_S)
                raise typer.Exit(1) from None
            if not isinstance(error, MlxSpecError):
                raise
            if debug:
                raise
            stderr = sys.__stderr__ if w.active else sys.stderr  # a rank's own error (see follow_quietly)
            message = _one_line(str(error))
            if isinstance(error, UsageError):
                named = f"invalid value for {error.flag}: {message}" if error.flag else message
                _usage_line(named, _command_path(None, ctx), stderr)
            print(f"error: {message} {DEBUG_HINT}", file=stderr)
            raise typer.Exit(1) from None


DEBUG_HINT = "(--debug for the traceback)"
QUIET_RANK_GRACE_S = 2.0  # how long a rank that stays quiet about an error waits before it exits


def _one_line(message: str) -> str:
    lines = message.strip().splitlines()
    return lines[0] if lines else "unknown error"


def _usage_error(error, parent=None):
    """Click's usage error as one line in our style, naming the flag, then exit 2.
    `no_args_is_help` raises one too: that one shows the help as usual."""
    if isinstance(error, click_errors.NoArgsIsHelpError):
        raise error
    param = getattr(error, "param", None)
    if isinstance(error, click_errors.BadParameter) and getattr(param, "param_type_name", "") == "option" \
            and error.param_hint is None:
        # "Invalid value for '--temp' / '-t': ..." names every alias; the long flag is enough
        message = f"invalid value for {param.opts[0]}: {_lower_first(error.message)}"
    else:
        message = _lower_first(error.format_message())
    _usage_line(_one_line(message).rstrip("."), _command_path(error.ctx, parent))


def _command_path(ctx, parent) -> str:
    """The command whose --help to point at: the one that raised (`ctx`), else the
    subcommand `parent` was invoking."""
    if ctx is not None:
        return ctx.command_path
    if parent is not None:  # raised while the subcommand's flags were parsed, or while it ran
        return " ".join(filter(None, (parent.command_path, parent.invoked_subcommand)))
    return "mlx-spec"


def _usage_line(message: str, command: str, stderr=None) -> None:
    print(f"error: {message} (see '{command} --help')", file=stderr or sys.stderr)
    raise typer.Exit(2)


def _lower_first(text: str) -> str:
    return text[:1].lower() + text[1:]


app = typer.Typer(
    name="mlx-spec",
    cls=_FriendlyErrors,
    help=(
        "Exact speculative decoding on MLX: a small draft proposes γ tokens, the target "
        "verifies them in one forward pass, and the output keeps the target's distribution "
        "(identical text at temperature 0). Under `mlx.launch` the target is sharded across "
        "the ranks (tensor parallel); see docs/distributed.md."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",  # joins a docstring's wrapped lines into paragraphs
)


def versions() -> list[str]:
    """mlx-spec's, MLX's and mlx-lm's versions, the device, and the BLAS MLX's CPU runs with."""
    from importlib.metadata import PackageNotFoundError, version

    import mlx.core as mx

    import mlx_spec
    from mlx_spec.platform import blas
    try:
        mlx_lm = version("mlx-lm")
    except PackageNotFoundError:
        mlx_lm = "not installed"
    return [f"mlx-spec {mlx_spec.__version__}", f"mlx {mx.__version__}", f"mlx-lm {mlx_lm}",
            f"device {mx.default_device()}",
            f"BLAS {blas.summary()}" + (f" ({problem})" if (problem := blas.load()["problem"]) else "")]


def _print_version(value: bool) -> None:
    if value:
        print("\n".join(versions()))
        raise typer.Exit()


def _check_blas() -> None:
    """A BLAS asked for by $MLX_SPEC_BLAS that could not be loaded is a one-line error."""
    from mlx_spec.platform import blas
    info = blas.load()
    if info["problem"] and info["requested"] != "auto":
        print(f"error: {info['problem']}", file=sys.stderr)
        raise typer.Exit(2)


@app.callback()
def _root(
    debug: bool = typer.Option(
        False, "--debug", help=f"Show full tracebacks on errors (or set {DEBUG_ENV}=1)."
    ),
    version: bool = typer.Option(
        False, "--version", callback=_print_version, is_eager=True,
        help="Print mlx-spec's, MLX's and mlx-lm's versions, the device and the BLAS, then exit.",
    ),
) -> None:
    # Not written to os.environ: in-process callers (tests, notebooks) would inherit it.
    _FriendlyErrors.debug = debug
    _check_blas()
    from mlx_spec.apps.distributed import follow_quietly, world

    follow_quietly(world(), debug or bool(os.environ.get(DEBUG_ENV)))  # across ranks: rank 0 prints


def main() -> None:
    """Console entry point."""
    app()
