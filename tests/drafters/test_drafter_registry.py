"""A drafter family is one class plus one registry entry: nothing in the engine, runner or
CLI names it. Here a drafter written in this file (a model-free one that proposes the last
committed token again, γ times) is registered the way `mlx_spec/drafters/__init__.py`
registers its own, then chosen with `--drafter` as a user would; its output must be plain
greedy decoding's (mlx-lm's `generate_step`), at a γ where some drafts are accepted."""

import mlx.core as mx
import pytest
from cli_support import assert_usage_error, invoke, invoke_json
from conftest import greedy_reference

from mlx_spec.apps.runner import build_engine
from mlx_spec.core.stats import Stats
from mlx_spec.drafters import (DRAFTERS, DFlash2Drafter, DFlashDrafter, Draft, Drafter, DSparkDrafter, Eagle3Drafter,
                               ModelDrafter, MtpDrafter, NgramDrafter, SuffixDrafter)
from mlx_spec.loading import load_pair

pytest_plugins = ["cli_fixtures"]  # fixtures: tiny_dirs, private_cost_cache

PROMPT = "a a a a a a a a a a a a"


class RepeatDrafter(Drafter):
    """Proposes the last committed token γ times (q one-hot): right wherever the target
    repeats itself, so a test can see drafts accepted."""

    name = "repeat"
    instances = 0

    @classmethod
    def for_pair(cls, pair, world):
        cls.instances += 1
        return cls()

    def propose(self, gamma, history, key=None):
        return Draft(mx.array([history[-1]] * gamma, dtype=mx.uint32))


@pytest.fixture
def registered(monkeypatch):
    monkeypatch.setitem(DRAFTERS, RepeatDrafter.name, RepeatDrafter)
    RepeatDrafter.instances = 0
    return RepeatDrafter


def test_the_built_in_drafters_are_registered_under_their_names():
    assert DRAFTERS == {"model": ModelDrafter, "mtp": MtpDrafter, "ngram": NgramDrafter, "suffix": SuffixDrafter,
                        "dflash": DFlashDrafter, "dflash2": DFlash2Drafter, "eagle3": Eagle3Drafter,
                        "dspark": DSparkDrafter}
    assert all(issubclass(cls, Drafter) and cls.name == name for name, cls in DRAFTERS.items())


def test_a_registered_drafter_is_built_and_drafts_exactly(registered, tiny_dirs):
    pair = load_pair(tiny_dirs[0], None, dtype="float32", progress=False)
    engine = build_engine(pair, "repeat")
    assert isinstance(engine.drafter, RepeatDrafter) and RepeatDrafter.instances == 1
    prompt = list(pair.tokenizer.encode(PROMPT))
    stats = Stats()
    tokens = [t for r in engine.rounds(prompt, gamma=3, max_tokens=40, stats=stats) for t in r.tokens]
    assert tokens == greedy_reference(pair.target.model, prompt, 40)[: len(tokens)]
    assert stats.drafted > 0


def test_the_cli_takes_a_registered_drafter_by_name(registered, tiny_dirs, private_cost_cache):
    args = ["generate", PROMPT, "--model", tiny_dirs[0], "-n", "24", "--gamma", "2", "--raw"]
    drafted = invoke_json(args + ["--drafter", "repeat"])
    plain = invoke_json(args + ["--drafter", "none"])
    assert drafted["text"] == plain["text"]
    assert drafted["stats"]["drafted"] > 0 and RepeatDrafter.instances == 1


def test_an_unregistered_name_is_one_line_naming_the_registered_ones(tiny_dirs):
    result = invoke(["generate", PROMPT, "--model", tiny_dirs[0], "--drafter", "repeat", "--raw"])
    assert_usage_error(result, "unknown drafter 'repeat'",
                       "model, mtp, ngram, suffix, dflash, dflash2, eagle3, dspark, none")

