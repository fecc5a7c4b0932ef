"""Target/draft pairing: the tokenizer compatibility check and the recorded logits widths."""

import json

import pytest

from mlx_spec.errors import IncompatibleModelsError
from mlx_spec.loading import check_compatible, load_model, load_pair
from mlx_spec.loading.tokenizer_loading import load_tokenizer
from mlx_spec.testing.tiny import TINY_VOCAB, perturbed_copy, save_tiny_model, tiny_gemma3


@pytest.fixture(scope="module")
def tiny_pair_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    target = tiny_gemma3(seed=0)
    return (save_tiny_model(root / "target", target),
            save_tiny_model(root / "draft", perturbed_copy(target, noise=0.05)))


def edit_tokenizer(folder, edit):
    """Apply `edit` to the BPE vocab (token -> id) of the folder's tokenizer.json."""
    path = folder / "tokenizer.json"
    data = json.loads(path.read_text())
    edit(data["model"]["vocab"])
    path.write_text(json.dumps(data))


def test_tiny_with_tiny_is_compatible(tiny_pair_dirs):
    target, draft = tiny_pair_dirs
    pair = load_pair(str(target), str(draft))
    assert pair.draft is not None and pair.draft is not pair.target
    assert pair.tokenizer is pair.target.tokenizer
    assert pair.vocab_size_target == pair.vocab_size_draft == TINY_VOCAB == pair.shared_vocab_size


def test_same_source_loads_once(tiny_pair_dirs):
    target, _ = tiny_pair_dirs
    pair = load_pair(str(target), str(target))
    assert pair.draft is pair.target  # safe: models hold no decoding state
    quantized = load_pair(str(target), str(target), draft_options={"quantize": 8})
    assert quantized.draft is not quantized.target  # different options: two models


def test_no_draft(tiny_pair_dirs):
    pair = load_pair(str(tiny_pair_dirs[0]))
    assert pair.draft is None and pair.vocab_size_draft is None
    assert pair.shared_vocab_size == TINY_VOCAB


def test_padded_vocab_widths_are_accepted_and_recorded(tmp_path, tiny_pair_dirs):
    # Like Gemma 3 270M (262144 logits) drafting for 4B+ (262208): same tokenizer, wider head.
    draft = save_tiny_model(tmp_path / "narrow", vocab_size=264)
    pair = load_pair(str(tiny_pair_dirs[0]), str(draft))
    assert (pair.vocab_size_target, pair.vocab_size_draft, pair.shared_vocab_size) == (272, 264, 264)


def test_different_token_text_is_rejected_naming_the_token(tmp_path, tiny_pair_dirs):
    draft = save_tiny_model(tmp_path / "swapped")

    def swap(vocab):  # two byte tokens trade ids: same size, same specials, other text
        a, b = [token for token, i in vocab.items() if i in (17, 18)]
        vocab[a], vocab[b] = vocab[b], vocab[a]

    edit_tokenizer(draft, swap)
    target_loaded, draft_loaded = load_model(str(tiny_pair_dirs[0])), load_model(str(draft))
    expected_dft = draft_loaded.tokenizer.convert_ids_to_tokens(17)
    expected_tgt = target_loaded.tokenizer.convert_ids_to_tokens(17)
    with pytest.raises(IncompatibleModelsError) as error:
        check_compatible(target_loaded, draft_loaded)
    assert str(error.value) == (
        "the draft and target models do not share a tokenizer, so they cannot pair: "
        f"draft token 17 is {expected_dft!r} but target token 17 is {expected_tgt!r}")
    with pytest.raises(IncompatibleModelsError, match="draft token 17 is"):
        load_pair(str(tiny_pair_dirs[0]), str(draft))


def test_different_special_tokens_are_rejected(tmp_path, tiny_pair_dirs):
    draft = save_tiny_model(tmp_path / "other-bos")
    config_path = draft / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "bos_token": "<unk>"}))
    with pytest.raises(IncompatibleModelsError,
                       match=r"draft BOS token is 3 \('<unk>'\) but target BOS token is 2 \('<bos>'\)"):
        load_pair(str(tiny_pair_dirs[0]), str(draft))


# ---------------------------------------------------------------------------------------
# The real Gemma 3 270M
# ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_gemma270m_with_itself_is_compatible(gemma270m):
    # A second tokenizer read from the same folder: the check compares all 262144 tokens.
    twin = type(gemma270m)(**{**vars(gemma270m),
                              "tokenizer": load_tokenizer(gemma270m.path, gemma270m.config)})
    assert twin.tokenizer._tokenizer is not gemma270m.tokenizer._tokenizer
    check_compatible(gemma270m, twin)
    pair = load_pair(None, "default", dtype="float32", progress=False)
    assert pair.draft is pair.target and pair.vocab_size_target == 262144


@pytest.mark.slow
def test_gemma270m_and_tiny_differ_at_token_4(gemma270m, tiny_pair_dirs):
    tiny = load_model(str(tiny_pair_dirs[0]))
    with pytest.raises(IncompatibleModelsError) as error:
        check_compatible(gemma270m, tiny)
    assert str(error.value) == ("the draft and target models do not share a tokenizer, so they cannot "
                                "pair: draft token 4 is '<start_of_turn>' but target token 4 is '<mask>'")
