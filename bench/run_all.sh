#!/usr/bin/env bash
# Re-run every benchmark behind a figure in README.md or docs/, one at a time (they share the CPU), and
# write bench/results/*.json. About 3 hours on a 2-core CPU (blas.py 35 min, exactness 15, the shaped run 45, across ranks 30).
set -euo pipefail
cd "$(dirname "$0")"
py() { echo "+ python $*"; python "$@"; }
py blas.py --prompts quote long --max-tokens 96 --repeats 2 --workers 2   # ~35 min: the reference BLAS is slow
py blas_matmul.py --workers 2   # which matmuls the BLAS moves (float32 yes, 4-bit quantized no)
py loop_efficiency.py --pair gemma270m-ngram --prompt quote --gammas 1 2 3 4 5 6 --max-tokens 96 --repeats 5
py loop_profile.py --pair gemma270m-ngram --prompt quote --gammas 1 3 6 --max-tokens 96 --repeats 2
py startup.py --repeats 5
(cd .. && bash bench/exactness.sh)
py head_to_head.py --pair tiny-self --gammas 0 2 4 --max-tokens 200 --repeats 21
py auto_gamma.py --pair layered-tiny --max-tokens 300 --repeats 15
py auto_gamma.py --pair gemma270m-bf16-ngram --prompt quote --max-tokens 96 --repeats 3
py auto_gamma.py --pair gemma270m-ngram --prompt quote --gammas 0 1 2 3 --max-tokens 48 --repeats 6
py auto_gamma.py --pair gemma270m-ngram --prompt quote --gammas 0 --max-tokens 48 --repeats 6
py auto_gamma.py --pair gemma270m-q8 --prompt short --gammas 0 1 2 3 --max-tokens 48 --repeats 3
py loop_efficiency.py --pair gemma270m-q8 --prompt short --gammas 1 2 3 4 5 --max-tokens 48 --repeats 3
py acceptance_rules.py --draft q8
py acceptance_rules.py --draft q4
py head_to_head.py --pair gemma270m-q8 --gammas 2 4 --max-tokens 32 --repeats 3
# Peers: llama.cpp (llama-cpp-python, pip install -e '.[bench]') on the same GGUF and 2 threads.
# Not in the 120 minutes above: estimated 30-45 min with MLX on the wheel's reference BLAS (our
# prefill and fixed-γ runs dominate), from a 9-minute smoke run (16 tokens, 1 repetition).
py vs_llama_cpp.py --prompts quote long --max-tokens 96 --repeats 5 --threads 2 --gamma 3
py shaped.py --pairs gemma4-12b/assistant gemma3-12b/270m gemma3-27b/1b --scale 0.125 --prompt-tokens 256 --max-tokens 96 --repeats 3 --clock cpu
# Past one Mac: the same sweeps in one process and across 2 ring ranks on this machine.
py distributed.py --pair gemma270m-ngram --prompt quote --gammas 1,3 --max-tokens 24 --runs 2
py distributed.py --pair tiny --prompt long --gammas 1,3 --max-tokens 32 --runs 3
py draft_placement.py --reps 10 --gamma 3 --max-tokens 32
py shard_memory.py
py trees.py --prompts quote long --gammas 2 4 6 --max-tokens 96 --repeats 3
py trees.py --pair layered-tiny-loose --max-tokens 96 --repeats 5 --sampled
py trees.py --pair gemma270m-q8 --prompts long --gammas 2 4 --max-tokens 48 --repeats 2
# Serving many clients, structured output, quantized and saved KV caches (issues 28, 34, 29).
py concurrency.py --gamma 3
py concurrency.py --clients 1,4 --prompts copying,ordinary --gamma auto --servers batched,serial,mlx-lm --runs 3 --one-client-runs 3 --name concurrency_auto
py concurrency.py --servers batched-draft,mlx-lm-draft,batched --prompts copying --clients 1,2,4 --runs 2 --one-client-runs 2 --name concurrency_draft
py concurrency.py --tokens 64 --clients 1,4 --prompts copying,ordinary --runs 5 --one-client-runs 9 --gamma auto --servers batched,serial,mlx-lm --name concurrency_auto_64
py wide_rows.py
py batched_drafting.py
py batched_drafting.py --pair gemma270m-self
py batched_drafting.py --pair layered-tiny
py shaped_concurrency.py
py concurrency.py --stall --clients 1 --runs 2 --servers batched,serial --name concurrency_stall
py grammar_libs.py   # add --xgrammar-python /tmp/xg/bin/python (a venv with xgrammar) for its half
py structured.py
py kv_quality.py
py prompt_cache_disk.py --tokens 2048 --repeats 1
py prompt_cache_disk.py --tokens 8192 --repeats 2 --warm 3
py kv_decode_profile.py
py suffix.py --max-tokens 64
py suffix_memory.py --tokens 1000000   # add --arctic DIR (Arctic Inference's _C module, built by hand) for its rows
py agents.py   # Claude Code, Codex, opencode from npm (npm i -g ...); a client not installed is recorded so
