"""The decoding core: the round loop (`engine`), the acceptance rule (`verify`), sampling,
draft trees, the drafter protocol (`drafter`), γ policies and their cost model, grammars as
constraints, the batch that steps requests' rounds together, and the per-sequence caches
with exact rollback (`cache/`). Token ids in, token ids out: nothing here knows text or HTTP."""
