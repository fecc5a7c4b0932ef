"""What evaluation harnesses ask of `serve` (issue 42, item 6): `/v1/completions` with `echo`
and `logprobs` returns the prompt tokens' log-probs in OpenAI's (and vLLM's) shape, checked
against mlx-lm's own forward of the target; `max_tokens: 0` with echo scores the prompt
alone (lm-eval's log-likelihood requests send 1 and drop the generated token); `/tokenize`
and `/detokenize` in vLLM's and llama.cpp's shapes. A tiny Gemma 3 pair in a subprocess,
drafting (γ 3), so the prompt's scores are not the drafter's."""

import httpx
import mlx.core as mx
import pytest
from mlx_lm import load

from server_support import assert_openai_error, server_env, serving

pytest_plugins = ["cli_fixtures"]  # fixtures: tiny_dirs, cost_cache, private_cost_cache
pytestmark = pytest.mark.usefixtures("private_cost_cache")

PROMPT = "The quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def spec_server(tiny_dirs, cost_cache):
    target, draft = tiny_dirs
    yield from serving(["--model", target, "--draft-model", draft, "--gamma", "3"], server_env(cost_cache))


@pytest.fixture(scope="module")
def reference(tiny_dirs):
    """mlx-lm's model and tokenizer for the target, loaded independently of mlx-spec."""
    return load(tiny_dirs[0])


def mlx_lm_prompt_logprobs(model, ids: list[int]) -> mx.array:
    """Row i: log-probs of the token after position i, from one mlx-lm forward of the prompt."""
    logits = model(mx.array(ids)[None])[0].astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def test_echo_logprobs_are_the_targets_prompt_logprobs(spec_server, tiny_dirs, reference):
    model, tokenizer = reference
    ids = tokenizer.encode(PROMPT)  # the tokenizer's BOS first, as the route encodes text
    expected = mlx_lm_prompt_logprobs(model, ids)
    client = spec_server.client()
    for prompt in (PROMPT, ids):  # text, and the same ids (used as given: no BOS is added)
        answer = client.completions.create(model="any", prompt=prompt, max_tokens=0, echo=True, logprobs=2,
                                           temperature=0)
        choice = answer.choices[0]
        assert choice.text == (PROMPT if isinstance(prompt, str) else tokenizer.decode(ids))
        assert answer.usage.prompt_tokens == len(ids) and answer.usage.completion_tokens == 0
        scores = choice.logprobs.token_logprobs
        assert len(scores) == len(ids) and scores[0] is None
        for i, token in enumerate(ids[1:]):
            assert abs(scores[i + 1] - expected[i, token].item()) < 2e-4, i
            best = sorted(expected[i].tolist(), reverse=True)[:2]
            top = sorted(choice.logprobs.top_logprobs[i + 1].values(), reverse=True)
            assert all(abs(a - b) < 2e-4 for a, b in zip(top, best)), (i, top, best)
        assert choice.logprobs.tokens[1:] == [tokenizer.decode([t]) for t in ids[1:]]


def test_echo_with_an_answer_as_lm_eval_asks(spec_server, reference):
    """max_tokens 1: the prompt's scores, then the generated token's (lm-eval drops it)."""
    model, tokenizer = reference
    ids = tokenizer.encode(PROMPT)
    expected = mlx_lm_prompt_logprobs(model, ids)
    answer = spec_server.client().completions.create(model="any", prompt=ids, max_tokens=1, echo=True, logprobs=1,
                                                     temperature=0)
    choice = answer.choices[0]
    greedy = int(mx.argmax(expected[-1]).item())
    assert choice.text == tokenizer.decode(ids) + tokenizer.decode([greedy])
    scores = choice.logprobs.token_logprobs
    assert len(scores) == len(ids) + 1 and abs(scores[-1] - expected[-1, greedy].item()) < 2e-4
    assert abs(sum(scores[1:-1]) - sum(expected[i, t].item() for i, t in enumerate(ids[1:]))) < 1e-3
    plain = spec_server.client().completions.create(model="any", prompt=ids, max_tokens=3, echo=True, temperature=0)
    assert plain.choices[0].text.startswith(tokenizer.decode(ids)) and plain.choices[0].logprobs is None


def test_echo_refusals(spec_server):
    for body, fragment, param in [
            ({"prompt": "hi", "max_tokens": 0}, "0 only with echo", "max_tokens"),
            ({"prompt": "hi", "echo": True, "stream": True, "max_tokens": 2}, "not supported with stream", "echo"),
            ({"prompt": "hi", "max_tokens": -1, "echo": True}, "max_tokens", "max_tokens")]:
        error = assert_openai_error(spec_server.post("/completions", {"model": "m", **body}), 400, fragment)
        assert error["param"] == param
    chat = spec_server.post("/chat/completions", {"model": "m", "echo": True,
                                                  "messages": [{"role": "user", "content": "hi"}]})
    assert assert_openai_error(chat, 400, "echo is not supported")["param"] == "echo"


def test_tokenize_and_detokenize_in_vllms_and_llama_cpps_shapes(spec_server, reference):
    _, tokenizer = reference
    url = spec_server.url
    vllm = httpx.post(url + "/tokenize", json={"model": "m", "prompt": PROMPT}, timeout=30).json()
    assert vllm["tokens"] == tokenizer.encode(PROMPT) and vllm["count"] == len(vllm["tokens"])
    assert vllm["max_model_len"] == 4096
    llama = httpx.post(url + "/tokenize", json={"content": PROMPT, "with_pieces": True}, timeout=30).json()
    plain = tokenizer.encode(PROMPT, add_special_tokens=False)
    assert [t["id"] for t in llama["tokens"]] == plain
    assert "".join(t["piece"] for t in llama["tokens"]) == PROMPT
    chat = [{"role": "user", "content": "Hi there"}]
    templated = httpx.post(url + "/tokenize", json={"messages": chat}, timeout=30).json()
    answer = spec_server.client().chat.completions.create(model="m", messages=chat, max_tokens=1)
    assert templated["count"] == answer.usage.prompt_tokens
    back = httpx.post(url + "/detokenize", json={"tokens": plain}, timeout=30).json()
    assert back == {"prompt": PROMPT, "content": PROMPT}
    assert httpx.post(url + "/tokenize", json={"prompt": "a", "content": "b"}, timeout=30).status_code == 400
    assert httpx.post(url + "/detokenize", json={"tokens": [10**9]}, timeout=30).status_code == 400
