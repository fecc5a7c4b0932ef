"""Golden values for the Gemma 4 MTP assistant, from the transformers reference.

Builds the tiny assistants of `mlx_spec.testing.tiny_gemma4` (both head variants) from
numpy's frozen `RandomState` streams, writes them as checkpoint folders, loads those folders
with transformers' own `Gemma4AssistantForCausalLM` / `Gemma4UnifiedAssistantForCausalLM`
(which must find every key: that checks the key layout), runs them on fixed inputs, and
writes tests/data/gemma4_assistant_golden.json. tests/models/test_gemma4_assistant.py.py rebuilds the
same weights and inputs and compares our MLX implementation with these numbers.

Needs torch (CPU build), which is not a test dependency:
    pip install torch==2.13.0            # CPU wheel from the local index
    python tests/data/make_gemma4_assistant_golden.py
"""

from __future__ import annotations

import json
import re
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from mlx_spec.testing.tiny_gemma4 import (  # noqa: E402
    save_tiny_assistant,
    tiny_assistant_config,
    tiny_assistant_weights,
    tiny_gemma4_config,
)

OUT = Path(__file__).with_name("gemma4_assistant_golden.json")
WEIGHT_SEED = 0
DRAFT_STEPS = 5
# (name, sliding keys, full keys, query position). "window": past the 16-token window the
# caller hands the sliding layers the last window − 1 keys; "far": RoPE at a large position.
CASES = [("short", 5, 5, 5), ("window", 15, 40, 40), ("far", 15, 300, 300)]


def case_inputs(config: dict, target: dict, sliding: int, full: int, seed: int) -> dict:
    """The assistant's inputs for one case, from RandomState(seed): the target's input
    embedding table (for multi-step drafts), the last token, the target hidden state h, and
    the target's K/V of its last sliding and full layers [1, kv_heads, S, head_dim]."""
    rng = np.random.RandomState(seed)
    text = config["text_config"]
    hidden, heads = config["backbone_hidden_size"], text["num_key_value_heads"]
    return {
        "target_embed": (0.5 * rng.standard_normal((text["vocab_size"], hidden))).astype(np.float32),
        "token": int(rng.randint(6, text["vocab_size"])),
        "h": rng.standard_normal((1, 1, hidden)).astype(np.float32),
        "sliding": tuple(rng.standard_normal((1, heads, sliding, text["head_dim"])).astype(np.float32)
                         for _ in range(2)),
        "full": tuple(rng.standard_normal((1, heads, full, text["global_head_dim"])).astype(np.float32)
                      for _ in range(2)),
    }


def main() -> None:
    import torch
    import transformers
    from transformers import GenerationConfig
    from transformers.generation.candidate_generator import SinglePositionMultiTokenCandidateGenerator
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextScaledWordEmbedding

    torch.manual_seed(0)
    target = tiny_gemma4_config()
    golden = {
        "generated_by": "tests/data/make_gemma4_assistant_golden.py",
        "versions": {"transformers": transformers.__version__, "torch": torch.__version__,
                     "numpy": np.__version__},
        "weight_seed": WEIGHT_SEED,
        "draft_steps": DRAFT_STEPS,
        "variants": {},
    }
    for centroids in (True, False):
        config = tiny_assistant_config(target, centroids=centroids)
        folder = save_tiny_assistant(Path(tempfile.mkdtemp()) / config["model_type"], config,
                                     tiny_assistant_weights(config, WEIGHT_SEED))
        model_class = getattr(transformers, config["architectures"][0])
        model, info = model_class.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager",
                                                  output_loading_info=True)
        assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
        model.eval()
        cases = []
        for index, (name, sliding, full, position) in enumerate(CASES):
            x = case_inputs(config, target, sliding, full, seed=100 + index)
            kv = {"sliding_attention": tuple(torch.from_numpy(a) for a in x["sliding"]),
                  "full_attention": tuple(torch.from_numpy(a) for a in x["full"])}
            embed = Gemma4TextScaledWordEmbedding(*x["target_embed"].shape, padding_idx=0,
                                                  embed_scale=config["backbone_hidden_size"] ** 0.5)
            embed.weight.data = torch.from_numpy(x["target_embed"])
            embed.embed_scale.fill_(config["backbone_hidden_size"] ** 0.5)
            token = torch.tensor([[x["token"]]])
            with torch.no_grad():
                # one step, as the model's forward computes it
                inputs = torch.cat([embed(token), torch.from_numpy(x["h"])], dim=-1)
                out = model(inputs_embeds=inputs, position_ids=torch.tensor([[position]]),
                            shared_kv_states=kv)
                # a whole draft, as transformers' MTP candidate generator runs it: the context
                # holds `position` tokens before `token` (its position_ids = len(ids) - 1)
                model.generation_config.num_assistant_tokens = DRAFT_STEPS
                generator = SinglePositionMultiTokenCandidateGenerator(
                    model, embed, GenerationConfig(max_length=10_000))
                ids = torch.cat([torch.zeros((1, position), dtype=torch.long), token], dim=1)
                outputs = type("Outputs", (), {"hidden_states": (torch.from_numpy(x["h"]),),
                                               "shared_kv_states": kv})()
                candidates, _ = generator.get_candidates(ids, {}, outputs, is_first_iteration=False,
                                                         n_last_matches=0)
            cases.append({
                "name": name, "sliding_keys": sliding, "full_keys": full, "position": position,
                "input_seed": 100 + index,
                "logits": [float(f"{v:.7g}") for v in out.logits[0, 0].tolist()],
                "next_h": [float(f"{v:.7g}") for v in out.last_hidden_state[0, 0].tolist()],
                "draft": candidates[0, position + 1:].tolist(),
            })
        golden["variants"][config["model_type"]] = {"centroids": centroids, "cases": cases}
    text = json.dumps(golden, indent=1)
    # one line per list of numbers, so the file stays short and diffs stay readable
    text = re.sub(r"\[\s*([-0-9.e,\s]+?)\s*\]", lambda m: "[" + re.sub(r"\s+", " ", m.group(1)) + "]", text)
    OUT.write_text(text + "\n")
    print(f"wrote {OUT.relative_to(ROOT)} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
