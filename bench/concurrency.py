"""Many clients at once (issue 28): aggregate tok/s, per-request tok/s and time to first
token at 1, 2, 4, 8 concurrent clients, copying and ordinary prompts, against today's serial
server, mlx-lm's batched one and mlx-lm's with a draft model (which it serves one at a time).

Servers, all up together on the embedded Gemma 3 270M in float32 under the same BLAS (each
server process imports mlx_spec first, which loads it):
  batched        mlx-spec serve --parallel P (--parallel, default 8), n-gram drafting (γ: --gamma)
  serial         mlx-spec serve --parallel 1, the same drafting (the server before this work)
  batched-plain  mlx-spec serve --parallel P --drafter none
  batched-draft  mlx-spec serve --parallel P with the draft model below (auto γ)
  mlx-lm         python -m mlx_lm.server (batched decoding, no draft) on the same weights,
                 saved as an mlx-lm folder
  mlx-lm-draft   the same with --draft-model (mlx-lm then decodes one request at a time:
                 `is_batchable = draft_model is None`), γ 3 (--num-draft-tokens)
The draft model both draft servers load: the 270M's own 8-bit copy (group 64, float32
scales: nn.quantize of the float32 weights), as an mlx-lm folder.

Each client streams one greedy /v1/completions answer of --tokens tokens (no stop: every
answer has the same length) for its own prompt; clients start together. Aggregate tok/s =
all clients' tokens / wall time from the first request to the last answer; per-request
tok/s = its tokens / its own time; TTFT = time to its first streamed text. One warm-up
round per server, then --runs repetitions, servers interleaved within each repetition;
medians reported, ratios against the serial server and mlx-lm from the same repetitions.

    python bench/concurrency.py            # writes bench/results/concurrency.json (~30 min under load)
    python bench/concurrency.py --quick    # a check: 1 and 4 copying clients, one repetition
    python bench/concurrency.py --servers batched-draft,mlx-lm-draft,batched --prompts copying \
        --clients 1,2,4 --runs 2 --one-client-runs 2 --name concurrency_draft   # the draft-model rows
    python bench/concurrency.py --stall --clients 1 --runs 2 --servers batched,serial --name concurrency_stall
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import OtherLoad, median, write_results  # noqa: E402

NOTICES = [
    "NOTICE: The north entrance of the library will be closed from Monday to Friday for "
    "repairs to the stairs. Please use the south entrance on Elm Street. Books can be "
    "returned at the desk by the south entrance or in the drop box beside the car park.",
    "NOTICE: Water will be shut off in building C on Thursday between 9 am and 1 pm while "
    "the pipes on the third floor are replaced. Kitchens and washrooms on every floor will "
    "be out of service. Bottled water is available in the lobby of building B.",
    "NOTICE: The staff meeting moves from Tuesday at 10 to Wednesday at 2 in room 4.12. "
    "Bring the quarterly figures and your team's plans for the spring. Coffee and fruit "
    "will be served, and the meeting will end by half past three at the latest.",
    "NOTICE: Parking level 2 will be repainted this weekend. Cars left there after 6 pm on "
    "Friday will be moved to level 4 at the owner's cost. The lifts and stairs stay open, "
    "and the ticket machines on level 1 accept cards and coins as usual.",
    "NOTICE: The swimming pool closes for cleaning on the first Monday of each month. Lessons "
    "booked for that day move to the Tuesday at the same time. Lockers must be emptied by "
    "Sunday evening, and anything left behind goes to the lost property box at reception.",
    "NOTICE: From next week the recycling bins are collected on Wednesday instead of Friday. "
    "Put paper and card in the blue bin, glass and cans in the green one, and leave the bins "
    "at the kerb by 7 am. Bags left beside the bins will not be taken.",
    "NOTICE: The fire alarm will be tested every Thursday at 11 am for about five minutes. "
    "There is no need to leave the building during the test. If the alarm sounds at any "
    "other time, leave by the nearest exit and gather in the square across the road.",
    "NOTICE: The canteen will serve breakfast from 7.30 to 9.30 and lunch from 12 to 2 while "
    "the kitchen is being refitted. Hot meals are limited to soup and one main dish. Cold "
    "sandwiches, salads and drinks can be bought at the counter all day.",
]
COPYING = [f"Copy the following notice exactly, word for word.\n\n{text}\n\nCopy:\n\n{text[:40]}"
           for text in NOTICES]
ORDINARY = ["The three most useful habits for a new programmer are",
            "A short history of the bicycle begins in",
            "The best way to keep basil fresh in the kitchen is",
            "When the city built its first tram line, people",
            "Learning to play the piano as an adult is",
            "The most important thing to pack for a week of hiking is",
            "Our village bakery opened in 1952, and since then",
            "To explain how a refrigerator works to a child, start with"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


DRAFT_BITS, DRAFT_GROUP = 8, 64


def mlx_lm_folder(path: Path, bits: int | None = None) -> Path:
    """The embedded default's float32 weights as an mlx-lm folder (config, safetensors,
    tokenizer), for mlx-lm's server; `bits`: quantized so (group DRAFT_GROUP, the float32
    model's float32 scales), as a draft model."""
    if (path / "model.safetensors").exists():
        return path
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    from mlx_spec.loading import load_model

    loaded = load_model(None, dtype="float32", progress=False)
    config = dict(loaded.config)
    if bits:
        nn.quantize(loaded.model, group_size=DRAFT_GROUP, bits=bits)
        config["quantization"] = {"group_size": DRAFT_GROUP, "bits": bits}
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(loaded.model.parameters())))
    getattr(loaded.tokenizer, "full", loaded.tokenizer)._tokenizer.save_pretrained(str(path))
    return path


class Running:
    """A server process, started with `command` + --port, up once /v1/models answers."""

    def __init__(self, name: str, command: list[str], env: dict):
        self.name, self.port = name, free_port()
        self.log = open(Path(tempfile.gettempdir()) / f"concurrency-{name}.log", "w")
        self.proc = subprocess.Popen([*command, "--port", str(self.port)], stdout=self.log, stderr=subprocess.STDOUT,
                                     env=env)
        self.base = f"http://127.0.0.1:{self.port}/v1"

    def wait(self, timeout: float = 600) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"{self.name} exited; see {self.log.name}")
            try:
                if httpx.get(self.base + "/models", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise SystemExit(f"{self.name} did not start")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def one_request(base: str, model: str, prompt: str, tokens: int, out: dict) -> None:
    import httpx

    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first, text, usage = None, [], None
    with httpx.stream("POST", base + "/completions", json=body, timeout=600) as response:
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or []:
                if choice.get("text"):
                    first = first or time.perf_counter()
                    text.append(choice["text"])
            usage = chunk.get("usage") or usage
    end = time.perf_counter()
    n = (usage or {}).get("completion_tokens") or tokens
    out.update(start=start, end=end, ttft=(first or end) - start, tokens=n, text="".join(text))


def concurrent(server: Running, model: str, prompts: list[str], tokens: int) -> dict:
    results = [{} for _ in prompts]
    threads = [threading.Thread(target=one_request, args=(server.base, model, p, tokens, r))
               for p, r in zip(prompts, results)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = max(r["end"] for r in results) - min(r["start"] for r in results)
    return {"aggregate_tps": sum(r["tokens"] for r in results) / wall,
            "per_request_tps": median([r["tokens"] / (r["end"] - r["start"] - r["ttft"] + 1e-9) for r in results]),
            "ttft_s": median([r["ttft"] for r in results]), "max_ttft_s": max(r["ttft"] for r in results),
            "tokens": [r["tokens"] for r in results], "texts": [r["text"] for r in results]}


def stall(server: Running, model: str, tokens: int, run: int, lead: float = 1.0) -> dict:
    """A ~4,000-token prompt, then `lead` seconds later a short one: the short one's time to
    its first token, and the long one's (its prefill alone takes most of that). `run` makes
    each long prompt new from its first token, so no prompt cache holds any of it."""
    long_prompt = f"Document {run}. " + " ".join(NOTICES[:4] * 17)  # ~4,000 tokens
    long, short = {}, {}
    first = threading.Thread(target=one_request, args=(server.base, model, long_prompt, tokens, long))
    first.start()
    time.sleep(lead)
    one_request(server.base, model, ORDINARY[0], tokens, short)
    first.join()
    return {"short_ttft_s": short["ttft"], "long_ttft_s": long["ttft"], "lead_s": lead}


SERVERS = "batched,serial,batched-plain,mlx-lm"
QUICK = dict(clients="1,4", prompts="copying", runs=1, one_client_runs=1, servers="batched,serial,mlx-lm")
KEYS = ("aggregate_tps", "per_request_tps", "ttft_s", "max_ttft_s")


def markdown(payload: dict) -> str:
    """The results as a markdown table: aggregate tok/s (per-request tok/s, median TTFT s)."""
    names = [n for n in payload["servers"] if any(n in row for row in payload["rows"])]
    lines = ["| prompts | clients | " + " | ".join(names) + " |", "|---|---:|" + "---:|" * len(names)]
    for row in payload["rows"]:
        cells = [f"{row[n]['aggregate_tps']:.1f} ({row[n]['per_request_tps']:.1f}, {row[n]['ttft_s']:.1f} s)"
                 if n in row else "—" for n in names]
        lines.append(f"| {row['prompts']} | {row['clients']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", default="1,2,4,8")
    parser.add_argument("--prompts", default="copying,ordinary")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--one-client-runs", type=int, default=5,
                        help="repetitions at 1 client (the 1-client ratio is the noisiest)")
    parser.add_argument("--parallel", type=int, default=8, help="--parallel of the batched servers")
    parser.add_argument("--gamma", default="3", help="γ of the n-gram drafting servers (auto: the policy's)")
    parser.add_argument("--servers", default=SERVERS)
    parser.add_argument("--serial-draft-clients", default="1,2,4",
                        help="client counts mlx-lm-draft runs at: it serves one request at a time at ~2 tok/s "
                             "here, so its aggregate does not grow with clients and 8 would take minutes a run")
    parser.add_argument("--name", default="concurrency")
    parser.add_argument("--quick", action="store_true", help="a check: " + ", ".join(f"{k} {v}" for k, v in QUICK.items()))
    parser.add_argument("--table", metavar="FILE.json", help="only print FILE's results as a markdown table")
    parser.add_argument("--stall", action="store_true",
                        help="also: a short request arriving during a ~4,000-token prefill (time to its first token)")
    args = parser.parse_args()
    if args.table:
        print(markdown(json.loads(Path(args.table).read_text())))
        return
    if args.quick:
        vars(args).update(QUICK)
    clients = [int(c) for c in args.clients.split(",")]
    serial_draft_clients = [int(c) for c in args.serial_draft_clients.split(",")]
    kinds = {"copying": COPYING, "ordinary": ORDINARY}
    kinds = {kind: kinds[kind] for kind in args.prompts.split(",")}
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    ours = [sys.executable, "-m", "mlx_spec.cli", "serve", "--dtype", "float32", "--max-tokens", str(args.tokens)]
    folder = mlx_lm_folder(Path(tempfile.gettempdir()) / "mlx-spec-bench-gemma270m-f32")
    draft = mlx_lm_folder(Path(tempfile.gettempdir()) / f"mlx-spec-bench-gemma270m-q{DRAFT_BITS}", DRAFT_BITS)
    batched = ["--parallel", str(args.parallel)]
    # mlx_spec first, for the same BLAS; then mlx-lm's own server main
    mlx_lm = [sys.executable, "-c", "import sys, mlx_spec; from mlx_lm.server import main; "
              "sys.argv[0] = 'mlx_lm.server'; main()", "--model", str(folder)]
    commands = {
        "batched": ours + batched + ["--drafter", "ngram", "--gamma", args.gamma],
        "serial": ours + ["--parallel", "1", "--drafter", "ngram", "--gamma", args.gamma],
        "batched-plain": ours + batched + ["--drafter", "none"],
        "batched-draft": ours + batched + ["--drafter", "model", "--draft-model", str(draft), "--gamma", "auto"],
        "mlx-lm": mlx_lm,
        "mlx-lm-draft": mlx_lm + ["--draft-model", str(draft), "--num-draft-tokens", "3"],
    }
    names = args.servers.split(",")
    servers = {name: Running(name, commands[name], env) for name in names}
    for server in servers.values():
        server.wait()
    models = {name: (str(folder) if name.startswith("mlx-lm") else "default") for name in names}
    load, began = OtherLoad(), time.monotonic()

    def payload(rows, stalls):
        return {"tokens": args.tokens, "runs": args.runs, "one_client_runs": args.one_client_runs,
                "gamma": args.gamma, "parallel": args.parallel, "servers": {n: commands[n][2:] for n in names},
                "draft_model": f"the embedded Gemma 3 270M quantized to {DRAFT_BITS} bits (group {DRAFT_GROUP}, "
                              "float32 scales; nn.quantize of the float32 target's weights)",
                "rows": rows, "prefill_stall": stalls, "seconds": time.monotonic() - began,
                "other_load_cores": load.cores(),
                "note": "measured on a shared 2-core CPU under other engineers' load; rerun on a quiet machine"}

    rows = []
    try:
        for kind, prompts in kinds.items():
            for name, server in servers.items():  # warm-up: the widest batch, a few tokens
                concurrent(server, models[name], prompts[:max(clients)], 8)
            for n in clients:
                here = [name for name in names if name != "mlx-lm-draft" or n in serial_draft_clients]
                runs = {name: [] for name in here}
                for _ in range(args.one_client_runs if n == 1 else args.runs):
                    for name in here:  # interleaved
                        server = servers[name]
                        runs[name].append(concurrent(server, models[name], prompts[:n], args.tokens))
                row = {"prompts": kind, "clients": n, "runs": len(runs[here[0]])}
                for name in here:
                    row[name] = {key: median([r[key] for r in runs[name]]) for key in KEYS}
                # exactness across servers: the same greedy text whatever the batching
                for name in ("batched", "batched-plain", "batched-draft"):
                    if name in runs and "serial" in runs:
                        row[f"{name}_equals_serial"] = all(a["texts"] == b["texts"]
                                                           for a, b in zip(runs[name], runs["serial"]))
                for base in ("serial", "mlx-lm", "mlx-lm-draft"):
                    for name in here:
                        if name != base and base in runs:
                            ratios = [a["aggregate_tps"] / b["aggregate_tps"] for a, b in zip(runs[name], runs[base])]
                            row[f"{name}_vs_{base}"] = median(ratios)
                rows.append(row)
                print(json.dumps(row), flush=True)
                write_results(args.name, payload(rows, {}))  # so far: a run cut short keeps its rows
        stalls = {}
        if args.stall:
            for name in ("batched", "serial"):
                if name in servers:
                    stall(servers[name], models[name], 8, run=0)  # warm-up
                    stalls[name] = [stall(servers[name], models[name], 8, run) for run in range(1, args.runs + 1)]
                    print(json.dumps({name: stalls[name]}), flush=True)
    finally:
        for server in servers.values():
            server.stop()
    path = write_results(args.name, payload(rows, stalls))
    print(markdown(payload(rows, stalls)))
    print(json.dumps({"results": str(path)}))


if __name__ == "__main__":
    main()
