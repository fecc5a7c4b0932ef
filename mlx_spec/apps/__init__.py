"""Services over the engine that the CLI and the server share: building an engine from
options (`runner`), text streaming (`stream`), multi-turn conversations, measured cost
curves (`calibration`), the γ sweep and many-client benchmarks, thinking, and a target
sharded across machines (`distributed`)."""
