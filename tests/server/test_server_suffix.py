"""`mlx-spec serve --drafter suffix` on the tiny target, driven by the official `openai`
client: answers are mlx-lm's greedy decoding; a prompt sent again in a new request drafts
its first answer from the server's memory; with two API keys and `--draft-memory key`, a
key's request learns nothing from another key's text (issue 44's timing side channel),
while the default one memory per server does (so the check can fail)."""

import httpx
import pytest
from mlx_lm import generate, load

from conftest import greedy_reference
from server_support import Server, server_env

pytest_plugins = ["cli_fixtures"]  # fixtures: tiny_dirs, cost_cache, private_cost_cache
pytestmark = pytest.mark.usefixtures("private_cost_cache")

KEYS = ("first-key", "second-key")
PROMPT = [2, 40, 41, 42, 43, 44, 45, 40, 41]
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def reference(tiny_dirs):
    """mlx-lm's greedy tokens and text, loaded independently of mlx-spec."""
    model, tokenizer = load(tiny_dirs[0])
    return greedy_reference(model, PROMPT, MAX_TOKENS), generate(model, tokenizer, PROMPT, max_tokens=MAX_TOKENS)


def completion(server, key):
    """(the answer's text, its `mlx_spec` statistics)."""
    answer = server.client(api_key=key).completions.create(
        model=server.model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    return answer.choices[0].text, answer.model_extra["mlx_spec"]


def start(tiny_dirs, cost_cache, *flags):
    args = ["--model", tiny_dirs[0], "--drafter", "suffix", "--gamma", "4", "--parallel", "2",
            *sum((["--api-key", k] for k in KEYS), []), *flags]
    server = Server(args, server_env(cost_cache))
    server.model = tiny_dirs[0]
    return server


@pytest.mark.parametrize("scope", ["key", "server"])
def test_a_second_key_learns_from_the_first_only_in_one_server_memory(tiny_dirs, cost_cache, reference, scope):
    server = start(tiny_dirs, cost_cache, "--draft-memory", scope)
    try:
        text, first = completion(server, KEYS[0])
        again, repeat = completion(server, KEYS[0])
        other, second = completion(server, KEYS[1])
        metrics = httpx.get(server.url + "/metrics", headers={"x-api-key": KEYS[0]}, timeout=10).text
        assert "Traceback" not in server.log
    finally:
        server.stop()
    tokens, expected = reference
    assert text == again == other == expected
    assert first["generated"] == repeat["generated"] == second["generated"] == len(tokens)
    assert first["drafted_from"].get("memory", 0) == 0
    assert repeat["accepted_from"]["memory"] > 0  # the same key: its first answer, remembered
    assert repeat["target_forwards"] < first["target_forwards"]
    memory_total = repeat["accepted_from"]["memory"] + second["accepted_from"].get("memory", 0)
    assert f'mlx_spec_source_accepted_tokens_total{{source="memory"}} {memory_total}' in metrics
    if scope == "key":
        assert second["drafted_from"].get("memory", 0) == 0
        assert second["target_forwards"] == first["target_forwards"]  # not sped up
    else:
        assert second["accepted_from"]["memory"] > 0
        assert second["target_forwards"] < first["target_forwards"]


@pytest.mark.parametrize("scope", ["key", "server"])
def test_a_restarted_server_drafts_from_the_memory_it_saved(tiny_dirs, cost_cache, reference, tmp_path, scope):
    """`--prompt-cache-dir`: the memory is written when the server stops and read by the
    next one, in its scope: the first key's repeat drafts from it after the restart; with
    `--draft-memory key` the second key's first request still learns nothing from it."""
    flags = ("--draft-memory", scope, "--prompt-cache-dir", str(tmp_path / "caches"))
    server = start(tiny_dirs, cost_cache, *flags)
    try:
        text, first = completion(server, KEYS[0])
    finally:
        server.stop()
    assert any(p.name.startswith("draft-memory-") for p in (tmp_path / "caches").iterdir())
    server = start(tiny_dirs, cost_cache, *flags)
    try:
        again, repeat = completion(server, KEYS[0])
        other, second = completion(server, KEYS[1])
        assert "Traceback" not in server.log and "skipping the draft memory" not in server.log
    finally:
        server.stop()
    assert text == again == other == reference[1]
    assert first["drafted_from"].get("memory", 0) == 0
    assert repeat["accepted_from"]["memory"] > 0  # what the stopped server remembered
    assert repeat["target_forwards"] < first["target_forwards"]
    if scope == "key":
        assert second["drafted_from"].get("memory", 0) == 0  # another key's file is not read for it
    else:
        assert second["accepted_from"]["memory"] > 0
