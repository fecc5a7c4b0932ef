"""`--chat-template FILE|NAME` on generate, chat and serve (issue 30, item 3): the template
replaces the checkpoint's own, the prompt is what transformers renders with it, the greedy
answer is mlx-lm's `generate` from that prompt; the tool-call syntax follows the template;
a missing file or an unknown name is a one-line usage error listing the built-in names."""

import pytest
from cli_support import assert_usage_error, invoke, invoke_json
from mlx_lm import generate, load
from scripted_model import TOOL_TEMPLATE
from server_support import assert_openai_error, server_env, serving

from mlx_spec.loading.chat_templates import BUILT_IN

pytest_plugins = ["cli_fixtures"]  # fixtures: tiny_dirs, gemma4_dirs, models, private_cost_cache
pytestmark = pytest.mark.usefixtures("private_cost_cache")

# Not the checkpoint's template: every turn is written as [role] text, the answer after "=>".
CUSTOM = ("{{ bos_token }}{%- for m in messages -%}{{ '[' + m['role'] + '] ' + m['content'] + '\\n' }}"
          "{%- endfor -%}{%- if add_generation_prompt -%}{{ '=> ' }}{%- endif -%}")
TOKENS = 12


@pytest.fixture(scope="module")
def custom_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("templates") / "custom.jinja"
    path.write_text(CUSTOM)
    return path


def mlx_lm_answer(model_dir, template: str, messages: list[dict], tools=None) -> tuple[int, str]:
    """(prompt length, greedy answer): the prompt is transformers' rendering with `template`."""
    model, tokenizer = load(str(model_dir))
    prompt = tokenizer._tokenizer.apply_chat_template(messages, chat_template=template, tools=tools, tokenize=True,
                                                      add_generation_prompt=True, return_dict=False)
    return len(prompt), generate(model, tokenizer, prompt, max_tokens=TOKENS)


@pytest.mark.parametrize("which", ["file", "gemma4"])
def test_generate_renders_with_the_given_template(which, tiny_dirs, custom_file):
    template = CUSTOM if which == "file" else BUILT_IN["gemma4"]
    out = invoke_json(["generate", "Hello there", "--model", tiny_dirs[0], "--draft-model", tiny_dirs[1],
                       "--chat-template", custom_file if which == "file" else "gemma4", "-n", TOKENS, "--temp", "0"])
    assert out["chat"]
    assert (out["prompt_tokens"], out["text"]) == mlx_lm_answer(tiny_dirs[0], template,
                                                                [{"role": "user", "content": "Hello there"}])


@pytest.mark.parametrize("value", ["no-such-template", "missing/custom.jinja"])
@pytest.mark.parametrize("command", ["generate", "chat", "serve"])
def test_a_missing_file_or_unknown_name_is_one_line(command, value, tiny_dirs):
    args = [command, *(["Hi"] if command == "generate" else []), "--model", tiny_dirs[0], "--chat-template", value]
    assert_usage_error(invoke(args, input=""), f"--chat-template {value!r}", "gemma3, gemma4")


def test_chat_answers_with_the_given_template(tiny_dirs, custom_file):
    result = invoke(["chat", "--model", tiny_dirs[0], "--drafter", "ngram", "--chat-template", custom_file,
                     "-n", TOKENS, "--temp", "0"], input="Hello there\n")
    assert result.exit_code == 0, result.stderr
    _, answer = mlx_lm_answer(tiny_dirs[0], CUSTOM, [{"role": "user", "content": "Hello there"}])
    assert answer.strip() and answer.strip() in result.stdout


@pytest.fixture(scope="module")
def tool_server(gemma4_dirs, cost_cache, tmp_path_factory):
    """The Gemma 4 checkpoint without a template (so the loader's tool-less fallback would
    apply), served with a template that has a tool-call format."""
    path = tmp_path_factory.mktemp("tool-template") / "tools.jinja"
    path.write_text(TOOL_TEMPLATE)
    yield from serving(["--model", gemma4_dirs / "bare", "--drafter", "none", "--chat-template", path],
                       server_env(cost_cache))


def test_serve_takes_tools_through_the_given_template(tool_server, gemma4_dirs):
    client = tool_server.client()
    model = client.models.list().data[0].id
    ask = [{"role": "user", "content": "Weather?"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    answer = client.chat.completions.create(model=model, messages=ask, tools=tools, max_tokens=TOKENS,
                                            temperature=0)
    prompt_tokens, text = mlx_lm_answer(gemma4_dirs / "bare", TOOL_TEMPLATE, ask, tools)
    assert answer.usage.prompt_tokens == prompt_tokens
    assert answer.choices[0].message.content == text


def test_serve_without_the_flag_refuses_tools_on_the_fallback_template(gemma4_dirs, cost_cache):
    """The control: the same checkpoint served plainly has no tool-call format."""
    for server in serving(["--model", gemma4_dirs / "bare", "--drafter", "none"], server_env(cost_cache)):
        response = server.post("/chat/completions", {
            "model": server.client().models.list().data[0].id, "messages": [{"role": "user", "content": "Hi"}],
            "tools": [{"type": "function", "function": {"name": "get_weather"}}]})
        assert_openai_error(response, 400, "no tool-call format")


def test_the_qa_template_renders_plain_questions_and_answers():
    """The default preset's chat template (issue 45), rendered by jinja2 as transformers
    renders templates, and the stop string that ends an answer where the next question starts."""
    import jinja2

    from mlx_spec.loading.chat_templates import BUILT_IN, TEMPLATE_STOPS
    from mlx_spec.loading.presets import get_preset

    assert get_preset("default").chat_template == "qa"
    messages = [{"role": "system", "content": "Be brief. "}, {"role": "user", "content": " Hi"},
                {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Capital of France?"}]
    text = jinja2.Environment().from_string(BUILT_IN["qa"]).render(
        messages=messages, bos_token="<bos>", add_generation_prompt=True)
    assert text == "<bos>Be brief.\n\nQuestion: Hi\nAnswer: Hello!\n\nQuestion: Capital of France?\nAnswer:"
    assert TEMPLATE_STOPS["qa"] == ("\nQuestion:",)
