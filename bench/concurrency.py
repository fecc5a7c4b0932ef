"""Many clients at once (issue 28): aggregate tok/s, per-request tok/s and time to first
token at 1, 2, 4 concurrent clients, copying and ordinary prompts, against today's serial
server and mlx-lm's batched one.

Servers, all up together on the embedded Gemma 3 270M in float32 under the same BLAS (each
server process imports mlx_spec first, which loads it):
  batched        mlx-spec serve --parallel 4, n-gram drafting (γ fixed, see --gamma)
  serial         mlx-spec serve --parallel 1, the same drafting (the server before this work)
  batched-plain  mlx-spec serve --parallel 4 --drafter none
  mlx-lm         python -m mlx_lm.server (batched decoding, no draft) on the same weights,
                 saved as an mlx-lm folder

Each client streams one greedy /v1/completions answer of --tokens tokens (no stop: every
answer has the same length) for its own prompt; clients start together. Aggregate tok/s =
all clients' tokens / wall time from the first request to the last answer; per-request
tok/s = its tokens / its own time; TTFT = time to its first streamed text. One warm-up
round per server, then --runs repetitions, servers interleaved within each repetition;
medians reported, ratios against the serial server and mlx-lm from the same repetitions.

    python bench/concurrency.py            # writes bench/results/concurrency.json
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
]
COPYING = [f"Copy the following notice exactly, word for word.\n\n{text}\n\nCopy:\n\n{text[:40]}"
           for text in NOTICES]
ORDINARY = ["The three most useful habits for a new programmer are",
            "A short history of the bicycle begins in",
            "The best way to keep basil fresh in the kitchen is",
            "When the city built its first tram line, people"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def mlx_lm_folder(path: Path) -> Path:
    """The embedded default's float32 weights as an mlx-lm folder (config, safetensors,
    tokenizer), for mlx-lm's server."""
    if (path / "model.safetensors").exists():
        return path
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from mlx_spec.models import load_model

    loaded = load_model(None, dtype="float32", progress=False)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(loaded.config))
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
    long_prompt = f"Document {run}. " + " ".join(NOTICES * 17)  # ~4,000 tokens
    long, short = {}, {}
    first = threading.Thread(target=one_request, args=(server.base, model, long_prompt, tokens, long))
    first.start()
    time.sleep(lead)
    one_request(server.base, model, ORDINARY[0], tokens, short)
    first.join()
    return {"short_ttft_s": short["ttft"], "long_ttft_s": long["ttft"], "lead_s": lead}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", default="1,2,4")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--gamma", default="3", help="γ of the drafting servers (auto: the policy's)")
    parser.add_argument("--servers", default="batched,serial,batched-plain,mlx-lm")
    parser.add_argument("--name", default="concurrency")
    parser.add_argument("--stall", action="store_true",
                        help="also: a short request arriving during a ~4,000-token prefill (time to its first token)")
    args = parser.parse_args()
    clients = [int(c) for c in args.clients.split(",")]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    ours = [sys.executable, "-m", "mlx_spec.cli", "serve", "--dtype", "float32", "--max-tokens", str(args.tokens)]
    folder = mlx_lm_folder(Path(tempfile.gettempdir()) / "mlx-spec-bench-gemma270m-f32")
    commands = {
        "batched": ours + ["--parallel", "4", "--drafter", "ngram", "--gamma", args.gamma],
        "serial": ours + ["--parallel", "1", "--drafter", "ngram", "--gamma", args.gamma],
        "batched-plain": ours + ["--parallel", "4", "--drafter", "none"],
        # mlx_spec first, for the same BLAS; then mlx-lm's own server main
        "mlx-lm": [sys.executable, "-c", "import sys, mlx_spec; from mlx_lm.server import main; "
                   "sys.argv[0] = 'mlx_lm.server'; main()", "--model", str(folder)],
    }
    names = args.servers.split(",")
    servers = {name: Running(name, commands[name], env) for name in names}
    for server in servers.values():
        server.wait()
    models = {name: (str(folder) if name == "mlx-lm" else "default") for name in names}
    load = OtherLoad()
    rows = []
    try:
        for kind, prompts in (("copying", COPYING), ("ordinary", ORDINARY)):
            for n in clients:
                for name, server in servers.items():  # warm-up
                    concurrent(server, models[name], prompts[:n], args.tokens)
                runs = {name: [] for name in names}
                for _ in range(args.runs):
                    for name, server in servers.items():  # interleaved
                        runs[name].append(concurrent(server, models[name], prompts[:n], args.tokens))
                row = {"prompts": kind, "clients": n}
                for name in names:
                    row[name] = {key: median([r[key] for r in runs[name]])
                                 for key in ("aggregate_tps", "per_request_tps", "ttft_s", "max_ttft_s")}
                # exactness across servers: the same greedy text whatever the batching
                if "batched" in runs and "serial" in runs:
                    row["batched_equals_serial"] = all(a["texts"] == b["texts"]
                                                       for a, b in zip(runs["batched"], runs["serial"]))
                for base in ("serial", "mlx-lm"):
                    for name in names:
                        if name != base and base in runs:
                            ratios = [a["aggregate_tps"] / b["aggregate_tps"] for a, b in zip(runs[name], runs[base])]
                            row[f"{name}_vs_{base}"] = median(ratios)
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items()}), flush=True)
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
    payload = {"tokens": args.tokens, "runs": args.runs, "gamma": args.gamma, "rows": rows, "prefill_stall": stalls,
               "other_load_cores": load.cores(),
               "note": "measured on a shared 2-core CPU under other engineers' load; rerun on a quiet machine"}
    path = write_results(args.name, payload)
    print(f"{'prompts':9} {'clients':>7} " + " ".join(f"{n:>14}" for n in names))
    for row in rows:
        print(f"{row['prompts']:9} {row['clients']:>7} " + " ".join(f"{row[n]['aggregate_tps']:>14.1f}" for n in names))
    print(json.dumps({"results": str(path)}))


if __name__ == "__main__":
    main()
