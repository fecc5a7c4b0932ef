"""The decoding core: the round loop (`engine`), the acceptance rule (`verify`), sampling,
draft trees, γ policies and their cost model, grammars as constraints, and the batch that
steps requests' rounds together. Token ids in, token ids out: nothing here knows text,
files or HTTP."""
