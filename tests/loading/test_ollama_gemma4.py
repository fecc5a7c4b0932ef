"""Issue 21 as its user runs it: an Ollama store holding Gemma 4 with its MTP assistant as the
draft layer (the reference run's gemma4:12b + draft-mtp), here the tiny GGUFs llama.cpp's
converter wrote (tests/data/tiny-gemma4-12b-*), in Ollama's real layout (store_support).

References: the Hugging Face folders those GGUFs were converted from, loaded as any
checkpoint, decoded by mlx-lm's plain greedy `generate_step`."""

import json
import os

import pytest
from cli_support import assert_one_line_error, invoke, invoke_json
from conftest import greedy_reference
from store_support import write_ollama_model
from gguf_support import gguf_file, hf  # noqa: F401  (hf: the module fixture)
from store_support import PROMPT, env, plain_text  # noqa: F401  (env: the stores fixture)

import mlx_spec.loading.gguf_import as gguf_import
from mlx_spec.apps.sweep import token_md5
from mlx_spec.loading import load_model
from mlx_spec.loading.gguf_architectures import ARCHITECTURES
from mlx_spec.loading.gguf_header import gguf_problem, read_gguf_header
from mlx_spec.loading.stores import locate

NAME = "ollama:gemma4:12b"
GAMMA = 3  # the model file's draft_num_predict, as in the reference run


def write_gemma4(store, outtype="f32", name="gemma4", tag="12b"):
    """gemma4:12b as Ollama stores it: the target GGUF as the model layer, the assistant GGUF
    as the draft layer, draft_num_predict in the params."""
    return write_ollama_model(
        store, name, tag, model=gguf_file("12b", outtype), draft=gguf_file("12b-assistant", outtype),
        params={"draft_num_predict": GAMMA, "stop": ["<turn|>"]},
        config={"model_family": "gemma4", "model_families": ["gemma4"], "file_type": outtype.upper(),
                "draft": {"model_format": "gguf", "architecture": "gemma4-assistant"}})


@pytest.fixture(scope="module")
def reference(hf):  # noqa: F811
    """The 12B-like target from its Hugging Face folder (float32)."""
    return load_model(str(hf["12b"]), dtype="float32", progress=False).model


def test_generate_drafts_with_the_assistant_at_the_model_files_gamma(env, hf, reference):  # noqa: F811
    write_gemma4(env["ollama"])
    result = invoke(["generate", PROMPT, "-m", NAME, "-n", "24", "--raw", "--json"])
    assert result.exit_code == 0, (result.stdout, result.stderr, result.exception)
    out = json.loads(result.stdout)
    assert out["models"]["draft"] == NAME + "#draft"
    assert out["drafter"] == "mtp" and out["gamma"] == GAMMA  # the assistant, as Ollama's draft-mtp
    assert out["stats"]["drafted"] > 0 and len(out["stats"]["acceptance_by_position"]) == GAMMA
    assert out["text"] == plain_text(reference, hf["12b"], 24)
    # the import's progress names the model, not its blob (sha256-…)
    assert f"Importing {NAME}:" in result.stderr and f"Importing {NAME}#draft:" in result.stderr
    assert "sha256-" not in result.stderr


def test_bench_runs_the_reference_sweep_with_identical_output(env, hf, reference):  # noqa: F811
    write_gemma4(env["ollama"])
    out = invoke_json(["bench", "-m", NAME, "--prompt", PROMPT, "-n", "8", "--runs", "1"])
    assert [s["setting"] for s in out["settings"]] == ["off", "γ=1", "γ=2", "γ=3", "γ=5", "auto"]
    assert out["drafter"] == "mtp" and out["model_file_gamma"] == GAMMA
    assert all(s["identical"] is not False for s in out["settings"])
    tokenizer = load_model(str(hf["12b"]), progress=False, for_chat=True).tokenizer
    plain = greedy_reference(reference, tokenizer.encode(PROMPT), 8)
    assert not set(plain) & tokenizer.eos_token_ids  # all 8 tokens count
    assert {s["md5"] for s in out["settings"]} == {token_md5(plain)}


def test_models_list_local_shows_the_draft_and_gamma(env):
    write_gemma4(env["ollama"])
    listed = invoke_json(["models", "list", "--local"])
    (entry,) = [m for m in listed if m["store"] != "embedded"]
    assert entry["source"] == NAME and entry["problem"] is None
    assert entry["format"] == "GGUF gemma4 ALL_F32"
    assert entry["draft"] == f"GGUF gemma4-assistant, γ {GAMMA}"
    assert entry["draft_size"] == gguf_file("12b-assistant").stat().st_size
    assert entry["size"] == gguf_file("12b").stat().st_size + entry["draft_size"]
    table = invoke(["models", "list", "--local"])
    (row,) = [r.split("\t") for r in table.stdout.strip().splitlines()[1:] if not r.startswith("default\t")]
    assert row[0] == NAME and f"gemma4-assistant, γ {GAMMA}" in row[-1]


def test_the_stores_pre_check_accepts_gemma4_and_its_assistant(tmp_path):
    for name in ("12b", "12b-assistant"):
        header = read_gguf_header(gguf_file(name))
        assert header.architecture in ARCHITECTURES and gguf_problem(header) is None
    assert read_gguf_header(gguf_file("12b-assistant")).architecture == "gemma4-assistant"


def test_auto_storage_of_a_12b_sized_blob_is_quantized(env):
    """The reference run's model layer is a 7 GB Q4_K_M (≥ 1 GiB: quantized), its draft 465 MB
    (float16): the decision on the store's own blob, grown sparse to that size."""
    write_gemma4(env["ollama"], "q8_0")
    blob = locate(NAME).path
    assert gguf_import.resolve_storage(blob) == "float16"  # 1.5 MB
    os.truncate(blob, gguf_import.QUANTIZE_FROM_BYTES)  # sparse: no GiB written
    assert gguf_import.resolve_storage(blob) == "quantized"
    assert gguf_problem(read_gguf_header(blob)) is None  # still passes the pre-check
    os.truncate(blob, gguf_import.QUANTIZE_FROM_BYTES - 1)
    assert gguf_import.resolve_storage(blob) == "float16"


def test_the_large_model_layer_imports_quantized_its_draft_float16(env, monkeypatch):
    """The same decision through `generate -m ollama:…`, with the threshold moved between
    the tiny Q8_0 target and its smaller assistant."""
    write_gemma4(env["ollama"], "q8_0")
    target, draft = locate(NAME), locate(NAME + "#draft")
    monkeypatch.setattr(gguf_import, "QUANTIZE_FROM_BYTES", target.path.stat().st_size)
    assert draft.path.stat().st_size < gguf_import.QUANTIZE_FROM_BYTES
    out = invoke_json(["generate", PROMPT, "-m", NAME, "-n", "16", "--raw"])
    assert out["drafter"] == "mtp" and out["gamma"] == GAMMA
    storages = {json.loads(p.read_text())["storage"]: p.parent
                for p in (env["cache"] / "gguf").glob("*/mlx_spec_source.json")}
    assert set(storages) == {"quantized", "float16"} and storages["quantized"].name.endswith("-mlxq")
    assert storages["quantized"].name.startswith(target.sha256[:20])
    assert storages["float16"].name.startswith(draft.sha256[:20])
    quantized = load_model(str(storages["quantized"]), dtype="float32", progress=False)
    assert quantized.config["quantization"]["bits"] == 8  # Q8_0: 8-bit groups of 32
    assert out["text"] == plain_text(quantized.model, storages["quantized"], 16)


def test_models_import_takes_an_ollama_model_and_its_draft(env):
    write_gemma4(env["ollama"], "q8_0")
    result = invoke(["models", "import", NAME, "--storage", "quantized"])
    assert result.exit_code == 0, (result.stdout, result.stderr, result.exception)
    folders = result.stdout.split()
    assert len(folders) == 2 and all(f.endswith("-mlxq") for f in folders)
    assert "sha256-" not in result.stderr
    # later loads use that import (auto storage picks what was made)
    out = invoke_json(["generate", PROMPT, "-m", NAME, "-n", "8", "--raw"])
    assert out["drafter"] == "mtp"
    assert len(list((env["cache"] / "gguf").glob("*/config.json"))) == 2


def test_the_assistant_alone_is_refused_as_a_target_in_one_line(env, hf):  # noqa: F811
    write_gemma4(env["ollama"])
    assert invoke(["models", "import", gguf_file("12b-assistant")]).exit_code == 0  # no progress below
    for source in (NAME + "#draft", str(gguf_file("12b-assistant")), str(hf["12b-assistant"])):
        result = invoke(["generate", "hi", "-m", source, "-n", "4"])
        assert_one_line_error(result, source, "MTP assistant", "-d")
