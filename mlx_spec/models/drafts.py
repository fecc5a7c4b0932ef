"""Draft checkpoints that are no mlx-lm architecture, told apart by their config.json:
which family a folder holds and our class for it. Each family drafts with the drafter of
the same name (`mlx_spec.drafters.DRAFTERS`), reads its target's states, and may ship no
tokenizer (it speaks the target's ids)."""

from __future__ import annotations

from typing import Optional

from mlx_spec.models import dflash, dflash2, dspark, eagle3, gemma4_assistant

# family -> (detects its config.json, model class, args class)
FAMILIES = {
    "mtp": (gemma4_assistant.is_assistant_config, gemma4_assistant.Model, gemma4_assistant.ModelArgs),
    "dflash": (dflash.is_dflash_config, dflash.Model, dflash.ModelArgs),
    "dflash2": (dflash2.is_dflash2_config, dflash2.Model, dflash2.ModelArgs),
    "eagle3": (eagle3.is_eagle3_config, eagle3.Model, eagle3.ModelArgs),
    "dspark": (dspark.is_dspark_config, dspark.Model, dspark.ModelArgs),
}


def draft_family(config: Optional[dict]) -> Optional[str]:
    """The family of a draft checkpoint's config (None: not one of ours)."""
    if config is None:
        return None
    return next((name for name, (detects, _, _) in FAMILIES.items() if detects(config)), None)


def draft_classes(config: dict):
    """For mlx-lm's loader (`get_model_classes`): our classes for draft checkpoints."""
    family = draft_family(config)
    if family is not None:
        _, model, args = FAMILIES[family]
        return model, args
    from mlx_lm.utils import _get_classes  # imports transformers (~1 s): only for other models

    return _get_classes(config)


def draft_facts(config: dict) -> Optional[dict]:
    """What `models info` shows about a draft of ours: its family, the tokens a round can
    draft in one forward (block drafts), the target layers it reads; None for other models."""
    family = draft_family(config)
    if family is None:
        return None
    args = FAMILIES[family][2].from_dict(config)
    if family == "dflash":
        return {"family": family, "block_size": args.block_size, "tap_layers": list(args.target_layer_ids)}
    if family == "dflash2":
        return {"family": family, "block_size": args.block_size, "tap_layers": list(args.target_layer_ids),
                "selector_top_k": args.selector_top_k, "conv_kernel_size": args.conv_kernel_size}
    if family == "dspark":
        return {"family": family, "packaging": args.packaging, "backbone": args.backbone,
                "block_size": args.proposal_length + 1, "tap_layers": list(args.target_layer_ids),
                "k_eq_v": args.attention_k_eq_v, "markov_rank": args.markov_rank,
                "draft_vocab": args.draft_vocab_size, "confidence_head": args.enable_confidence_head}
    if family == "eagle3":
        return {"family": family, "tap_layers": list(args.tap_layers), "draft_vocab": args.draft_vocab_size,
                "speculative_tokens": args.speculative_tokens}
    return {"family": family}
