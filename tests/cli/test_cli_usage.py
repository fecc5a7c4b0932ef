"""A flag value our own code refuses after Click has parsed it (issue 20 item 3) is a usage
error like one Click refuses: one line naming the flag, pointing at the command's --help,
exit 2, before any model loads. Errors about the world (a path that is not there) stay at
exit 1; library callers get a ValueError."""

import subprocess
import sys
from pathlib import Path

import pytest
from cli_support import assert_one_line_error, assert_usage_error, invoke

pytest_plugins = ["cli_fixtures"]  # fixtures: tiny_dirs, models, private_cost_cache
pytestmark = pytest.mark.usefixtures("private_cost_cache")

# Checked by mlx-spec's code, not by Click: each names its flag.
MODEL_FLAGS = [
    (["--gamma", "99"], "--gamma"),
    (["--gamma", "many"], "--gamma"),
    (["--drafter", "psychic"], "--drafter"),
    (["--preset", "no-such-preset"], "--preset"),
    (["--draft-on", "rank1"], "--draft-on"),
    (["--quantize", "7"], "--quantize"),
    (["--draft-quantize", "7"], "--draft-quantize"),
    (["--q-group-size", "32"], "--q-group-size"),  # without --quantize
    (["--quantize", "4", "--q-group-size", "48"], "--q-group-size"),
    (["--dtype", "float64"], "--dtype"),
    (["--drafter", "model"], "--drafter"),  # -m alone: no draft model to draft with
]
SAMPLING_FLAGS = [
    (["--seed", "-1"], "--seed"),
    (["--seed", str(2**64)], "--seed"),
    (["--top-p", "0"], "--top-p"),
    (["--top-p", "1.5"], "--top-p"),
    (["--min-p", "1"], "--min-p"),
    (["--repetition-penalty", "0"], "--repetition-penalty"),
]
BENCH_FLAGS = [
    (["--gamma", "0"], "--gamma"),
    (["--gamma", ","], "--gamma"),
    (["--drafter", "none"], "--drafter"),
    (["--plot", "out.jpg"], "--plot"),
    (["--prompt", "lnog"], "--prompt"),
]
SERVE_FLAGS = [
    (["--log-level", "loud"], "--log-level"),
    (["--cors-origin", "localhost:3000/"], "--cors-origin"),
    (["--allowed-hosts", ","], "--allowed-hosts"),
    (["--api-key", "two words"], "--api-key"),
    (["--served-model-name", " "], "--served-model-name"),
]

CASES = (
    [("generate", flags, named) for flags, named in MODEL_FLAGS + SAMPLING_FLAGS]
    + [("chat", flags, named) for flags, named in MODEL_FLAGS + SAMPLING_FLAGS]
    + [("bench", flags, named) for flags, named in MODEL_FLAGS + SAMPLING_FLAGS[:2] + BENCH_FLAGS]
    + [("serve", flags, named) for flags, named in MODEL_FLAGS + SAMPLING_FLAGS + SERVE_FLAGS
       if named != "--draft-on"]  # serve runs on one machine
    + [("models import", ["x.gguf", "--storage", "float8"], "--storage")]  # exit 2 before this change too
)


@pytest.fixture
def no_loading(monkeypatch):
    """Finding or loading any model fails the test: a bad value must be refused first."""
    import mlx_spec.loading.sources as sources

    def resolve_source(*args, **kwargs):
        raise AssertionError("a model was looked for before the flags were checked")

    monkeypatch.setattr(sources, "resolve_source", resolve_source)


def _args(command: str, flags: list, target: str) -> list:
    if command == "models import":
        return ["models", "import", *flags]
    prompt = ["x"] if command == "generate" else []
    port = ["--port", "0"] if command == "serve" else []
    return [command, *prompt, "-m", target, *port, *flags]


@pytest.mark.parametrize("command,flags,named", CASES,
                         ids=[f"{c}:{' '.join(f)}" for c, f, _ in CASES])
def test_a_value_our_code_refuses_is_a_usage_error(tiny_dirs, no_loading, command, flags, named):
    result = invoke(_args(command, flags, tiny_dirs[0]), input="")
    assert_usage_error(result, named)
    assert result.stderr.rstrip().endswith(f"(see 'mlx-spec {command} --help')"), result.stderr


@pytest.mark.parametrize("command", ["generate", "chat", "bench", "serve"])
def test_a_model_that_is_not_there_still_exits_1(no_loading, command):
    """A world error, not a usage one: the path is well formed, the folder is missing."""
    args = _args(command, [], "./no/such/model")
    assert_one_line_error(invoke(args, input=""), "target model: no such file or folder: ./no/such/model")


def test_an_empty_prompt_is_a_usage_error(tiny_dirs, no_loading):
    assert_usage_error(invoke(["generate", "-m", tiny_dirs[0]], input="  \n"), "the prompt is empty")


def test_a_drafter_the_loaded_draft_cannot_serve_is_a_usage_error(tiny_dirs):
    """Checked once the pair has loaded (is the draft an MTP assistant?), still exit 2."""
    target, draft = tiny_dirs
    result = invoke(["generate", "x", "-m", target, "-d", draft, "--drafter", "mtp", "-n", "2"])
    assert_usage_error(result, "--drafter mtp")


def test_in_a_real_process():
    """The console script as a user runs it: our check's line reads like Click's own."""
    script = Path(sys.executable).with_name("mlx-spec")
    command, prog = ([str(script)], "mlx-spec") if script.exists() else \
        ([sys.executable, "-m", "mlx_spec.cli"], "python -m mlx_spec.cli")
    run = subprocess.run(command + ["generate", "x", "--top-p", "0"], capture_output=True, text=True,
                         timeout=180)
    assert run.returncode == 2, run.stderr
    assert run.stderr.strip().splitlines() == [
        f"error: invalid value for --top-p: top-p must be in (0, 1] (see '{prog} generate --help')"]


def test_library_callers_get_a_value_error(tiny_dirs):
    """The engine API and the server catch ValueError (or MlxSpecError) as before."""
    from mlx_spec.apps.runner import Gamma, resolve_choice
    from mlx_spec.core.sampling import SamplingParams
    from mlx_spec.errors import MlxSpecError
    from mlx_spec.loading.loader import load_model

    for call in (lambda: SamplingParams(top_p=0), lambda: Gamma.parse("99"),
                 lambda: resolve_choice(drafter="psychic"), lambda: resolve_choice(preset="nosuch"),
                 lambda: load_model(tiny_dirs[0], dtype="float64", progress=False)):
        with pytest.raises(ValueError) as error:
            call()
        assert isinstance(error.value, MlxSpecError) and "\n" not in str(error.value)
