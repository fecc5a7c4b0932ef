"""Many conversations cached at once, `GET /metrics` and `--cors-origin` (issue 19, items 5
and 6), on the tiny Gemma 3 pair (sliding window 16) through the official `openai` client.
References: mlx-lm's own greedy decoding for every answer, and the answers' own `usage` and
statistics for what /metrics must total (parsed with `prometheus_client`'s parser)."""

import httpx
import pytest
from cli_support import assert_usage_error, invoke
from conftest import greedy_reference
from mlx_lm import generate, load
from prometheus_client.parser import text_string_to_metric_families
from server_support import Server, server_env

pytest_plugins = ["cli_fixtures"]  # fixtures: tiny_dirs, cost_cache, private_cost_cache
pytestmark = pytest.mark.usefixtures("private_cost_cache")

N = 12  # tokens per answer
ORIGIN = "http://localhost:3000"


def _serve(tiny_dirs, cost_cache, *flags):
    target, draft = tiny_dirs
    return Server(["--model", target, "--draft-model", draft, "--gamma", "2", *flags],
                  server_env(cost_cache))


@pytest.fixture(scope="module")
def reference(tiny_dirs):
    model, tokenizer = load(tiny_dirs[0])
    eos = set(tokenizer.eos_token_ids)

    def greedy(ids):
        tokens = greedy_reference(model, ids, N)
        for i, t in enumerate(tokens):
            if t in eos:
                tokens = tokens[: i + 1]
                break
        return tokens, generate(model, tokenizer, ids, max_tokens=N)

    return greedy, tokenizer


OPENINGS = ["The committee met on a rainy Tuesday to discuss the budget for next year and",
            "Dear diary, today I walked along the river and counted seventeen herons standing",
            "def parse(text):\n    # split the configuration file into sections and then"]


def _interleave(server, tiny_dirs, reference, turns=3):
    """Three conversations, one turn each in turn; every prompt is the conversation so far
    as token ids. Returns the answers, per turn per conversation."""
    greedy, tokenizer = reference
    client = server.client()
    prompts = [list(tokenizer.encode(text)) for text in OPENINGS]
    assert all(len(p) > 16 for p in prompts)  # past the sliding window from the first turn
    answers = []
    for turn in range(turns):
        row = []
        for c, prompt in enumerate(prompts):
            answer = client.completions.create(model=tiny_dirs[0], prompt=prompt, max_tokens=N, temperature=0,
                                               extra_body={"skip_special_tokens": False})  # as generate's text
            tokens, text = greedy(prompt)
            assert answer.choices[0].text == text, (turn, c)  # exact whatever came in between
            assert answer.usage.completion_tokens == len(tokens)
            # The cache holds the prompt and the answer but its last token (never fed back).
            row.append((answer, len(prompt), prompt + tokens[:-1]))
            # Random weights may say ids past the tokenizer (the padded embedding rows), which
            # a prompt may not hold: the conversation goes on without them.
            said = [t for t in tokens if t < len(tokenizer.vocab)]
            prompts[c] = prompt + said + list(tokenizer.encode(f" Then, in part {turn + 2},",
                                                               add_special_tokens=False))
        answers.append(row)
    return answers


def _common_prefix(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_interleaved_conversations_each_reuse_their_own_cache(tiny_dirs, cost_cache, reference):
    server = _serve(tiny_dirs, cost_cache)
    try:
        answers = _interleave(server, tiny_dirs, reference)
        for turn in range(1, len(answers)):
            for c, (answer, prompt_len, held) in enumerate(answers[turn]):
                _, previous_len, previously_held = answers[turn - 1][c]
                # Everything this turn shares with what the conversation's cache held came
                # from that cache, though two other conversations were served in between.
                common = _common_prefix(previously_held, held[:prompt_len - 1])
                assert common >= previous_len
                assert answer.usage.prompt_tokens_details.cached_tokens == common
                assert answer.model_extra["mlx_spec"]["prefill_tokens_target"] == prompt_len - 1 - common
        health = server.health()
        assert health["prompt_caches"] == 3 and 0 < health["prompt_cache_bytes"] <= health["prompt_cache_budget"]
    finally:
        server.stop()
    assert "Traceback" not in server.log


def test_a_small_budget_keeps_one_conversation_and_stays_exact(tiny_dirs, cost_cache, reference):
    server = _serve(tiny_dirs, cost_cache, "--cache-memory", "0.000001")
    try:
        answers = _interleave(server, tiny_dirs, reference, turns=2)  # exactness is checked inside
        for c, (answer, _, _) in enumerate(answers[1]):
            previous_len = answers[0][c][1]
            assert answer.usage.prompt_tokens_details.cached_tokens < previous_len  # evicted meanwhile
        assert server.health()["prompt_caches"] == 1
    finally:
        server.stop()


def _families(text):
    return {f.name: f for f in text_string_to_metric_families(text)}


def _value(families, name, **labels):
    for sample in families[name].samples:
        if sample.labels == labels and not sample.name.endswith("_created"):
            return sample.value
    raise KeyError((name, labels))


def test_metrics_total_what_the_answers_reported_and_cors(tiny_dirs, cost_cache, reference):
    server = _serve(tiny_dirs, cost_cache, "--cors-origin", ORIGIN, "--cors-origin", "http://127.0.0.1:5173")
    try:
        answers = [a for row in _interleave(server, tiny_dirs, reference, turns=2) for a, _, _ in row]
        assert server.post("/completions", {"model": tiny_dirs[0], "prompt": "hi", "top_p": 7}).status_code == 400
        response = httpx.get(server.url + "/metrics", timeout=10)
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
        families = _families(response.text)
        stats = [a.model_extra["mlx_spec"] for a in answers]
        assert _value(families, "mlx_spec_http_responses", code="400") == 1
        assert _value(families, "mlx_spec_http_responses", code="200") >= len(answers)  # and /health
        assert _value(families, "mlx_spec_requests", outcome="completed") == len(answers)
        assert _value(families, "mlx_spec_requests", outcome="failed") == 0
        assert _value(families, "mlx_spec_queue_depth") == 0
        assert _value(families, "mlx_spec_generated_tokens") == sum(a.usage.completion_tokens for a in answers)
        assert _value(families, "mlx_spec_prompt_tokens") == sum(a.usage.prompt_tokens for a in answers)
        assert _value(families, "mlx_spec_drafted_tokens") == sum(s["drafted"] for s in stats) > 0
        assert _value(families, "mlx_spec_accepted_tokens") == sum(s["accepted"] for s in stats)
        for i in range(2):  # γ = 2: positions 1 and 2
            drafted = sum(s["drafted_at"][i] for s in stats if len(s["drafted_at"]) > i)
            accepted = sum(s["accepted_at"][i] for s in stats if len(s["accepted_at"]) > i)
            position = str(i + 1)
            assert _value(families, "mlx_spec_position_drafted", position=position) == drafted
            assert _value(families, "mlx_spec_position_accepted", position=position) == accepted
            assert _value(families, "mlx_spec_acceptance_by_position", position=position) == pytest.approx(accepted / drafted)
        cached = sum(a.usage.prompt_tokens_details.cached_tokens for a in answers)
        assert _value(families, "mlx_spec_prompt_cache_tokens") == cached > 0
        assert _value(families, "mlx_spec_decode_tokens_per_second") > 0

        # CORS: the named origins only, preflight included
        preflight = httpx.options(server.base + "/chat/completions", timeout=10, headers={
            "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type"})
        assert preflight.status_code == 200
        assert preflight.headers["access-control-allow-origin"] == ORIGIN
        allowed = httpx.get(server.base + "/models", headers={"Origin": ORIGIN}, timeout=10)
        assert allowed.headers["access-control-allow-origin"] == ORIGIN
        other = httpx.get(server.base + "/models", headers={"Origin": "http://evil.example"}, timeout=10)
        assert "access-control-allow-origin" not in other.headers
    finally:
        server.stop()
    assert "Traceback" not in server.log


def test_bad_cors_origin_is_a_one_line_error(tiny_dirs):
    assert_usage_error(invoke(["serve", "--model", tiny_dirs[0], "--cors-origin", "localhost:3000/"]),
                          "--cors-origin", "not an origin")
