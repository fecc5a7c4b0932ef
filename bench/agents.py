"""What the real agent clients do against `mlx-spec serve` (issue 42): Claude Code (`claude -p`),
Codex CLI (`codex exec`) and opencode (`opencode run`), each installed from npm, each run once
with nothing set but what `mlx-spec launch` sets (its base URL, a key, the model), on a tiny
random-weight Gemma 4 carrying Google's own chat template (tests/data/templates/gemma4.jinja,
see its README). The model answers garbage; what is recorded is the protocol: every HTTP
request each client made (method, path, status, from the server's access log), the tokens
the server processed and generated for it (/metrics before and after), its exit status, its
wall time and the end of its output.

    python bench/agents.py [--clients claude,codex,opencode] [--out bench/results/agents.json]

A client not on PATH (or under $MLX_SPEC_NPM_BIN) is recorded as not installed. The agents'
prompts are ~40-95 kB, one token per byte for the tiny byte-level tokenizer, so the model is
given a 131,072-token context and every layer sliding (a 16-token window): prefill stays
linear on a CPU. About 5-15 minutes on our 2-core CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mlx_spec.cli.launch import client_setup  # noqa: E402
from mlx_spec.testing.tiny_gemma4 import TEMPLATE_SPECIAL_TOKENS, save_tiny_gemma4  # noqa: E402

TEMPLATE = ROOT / "tests" / "data" / "templates" / "gemma4.jinja"
PROMPT = "say hi"
COMMANDS = {"claude": ["-p", PROMPT], "codex": ["exec", "--skip-git-repo-check", PROMPT], "opencode": ["run", PROMPT]}
ACCESS = re.compile(r'"(GET|POST|HEAD|DELETE|PUT) (\S+) HTTP/[\d.]+" (\d{3})')
COUNTERS = ("prompt_tokens", "prefill_tokens", "generated_tokens", "drafted_tokens", "accepted_tokens")
MODEL_NAME = "tiny-gemma4"


def binary(client: str) -> str | None:
    extra = os.environ.get("MLX_SPEC_NPM_BIN")
    found = shutil.which(client, path=f"{extra}{os.pathsep}{os.environ['PATH']}" if extra else None)
    return found


def counters(base: str) -> dict:
    text = httpx.get(base + "/metrics", timeout=30).text
    out = {}
    for name in COUNTERS:
        match = re.search(rf"^mlx_spec_{name}_total (\S+)", text, re.M)
        out[name] = int(float(match.group(1))) if match else 0
    return out


def start_server(model: Path, log: Path) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    handle = log.open("w")
    proc = subprocess.Popen([sys.executable, "-m", "mlx_spec.cli", "serve", "--model", str(model),
                             "--served-model-name", MODEL_NAME, "--temp", "1", "--seed", "0", "--port", "0",
                             "--log-level", "info"], stdout=handle, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        found = re.search(r"at (http://\S+)/v1", log.read_text())
        if found:
            base = found.group(1)
            try:
                if httpx.get(base + "/health", timeout=5).status_code == 200:
                    return proc, base
            except httpx.HTTPError:
                pass
        if proc.poll() is not None:
            raise SystemExit(f"serve exited: {log.read_text()[-2000:]}")
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("serve did not become healthy in 300 s")


def run_client(client: str, base: str, log: Path, scratch: Path, timeout: float) -> dict:
    exe = binary(client)
    if exe is None:
        return {"client": client, "installed": False}
    version = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60).stdout.strip()
    home = scratch / f"home-{client}"  # no user settings, no login: only what launch sets
    home.mkdir()
    extra_env, extra_args = client_setup(client, base, "dummy", MODEL_NAME, scratch)
    env = {"PATH": os.environ["PATH"], "HOME": str(home), **extra_env}
    if client == "codex":  # it needs its home folder to exist (its default, ~/.codex, with this HOME)
        (home / ".codex").mkdir()
    command = [exe, *COMMANDS[client][:-1], *extra_args, COMMANDS[client][-1]] if client == "codex" else \
        [exe, *COMMANDS[client], *extra_args]
    before, logged = counters(base), len(log.read_text())
    started = time.perf_counter()
    try:
        run = subprocess.run(command, env=env, cwd=scratch, capture_output=True, text=True, timeout=timeout)
        code, out, err = run.returncode, run.stdout, run.stderr
    except subprocess.TimeoutExpired as expired:
        code, out, err = "timeout", expired.stdout or "", expired.stderr or ""
        out, err = (x.decode(errors="replace") if isinstance(x, bytes) else x for x in (out, err))
    seconds = time.perf_counter() - started
    time.sleep(1)  # the access log line of the last response
    after = counters(base)
    requests = [{"method": m, "path": p, "status": int(s)} for m, p, s in ACCESS.findall(log.read_text()[logged:])
                if p != "/metrics"]
    return {"client": client, "installed": True, "version": version,
            "command": [Path(command[0]).name, *command[1:]], "exit": code, "seconds": round(seconds, 1),
            "requests": requests, "statuses": sorted({r["status"] for r in requests}),
            "tokens": {k: after[k] - before[k] for k in COUNTERS},
            "stdout_tail": out[-600:], "stderr_tail": err[-600:]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", default="claude,codex,opencode")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "agents.json"))
    parser.add_argument("--timeout", type=float, default=900, help="seconds for each client")
    args = parser.parse_args()
    if not TEMPLATE.exists():
        raise SystemExit(f"{TEMPLATE} is not here (tests/data/templates/README.md says where it comes from)")
    scratch = Path(tempfile.mkdtemp(prefix="agents-"))
    model = save_tiny_gemma4(scratch / "gemma4", chat_template=TEMPLATE.read_text(),
                             special_tokens=TEMPLATE_SPECIAL_TOKENS, max_position_embeddings=131072,
                             sliding_window_pattern=7)
    log = scratch / "serve.log"
    server, base = start_server(model, log)
    results = []
    try:
        for client in args.clients.split(","):
            result = run_client(client, base, log, scratch, args.timeout)
            results.append(result)
            shown = {k: result.get(k) for k in ("client", "version", "exit", "seconds", "statuses", "tokens")}
            print(json.dumps(shown), flush=True)
    finally:
        server.terminate()
        server.wait(30)
    tracebacks = log.read_text().count("Traceback")
    document = {"model": "tiny random Gemma 4, Google's template (gemma4.jinja), 131,072-token context",
                "server": "mlx-spec serve --temp 1 --seed 0 (n-gram drafter, γ auto)", "prompt": PROMPT,
                "server_tracebacks": tracebacks, "clients": results}
    Path(args.out).write_text(json.dumps(document, indent=2) + "\n")
    print(json.dumps({"out": args.out, "server_tracebacks": tracebacks}))


if __name__ == "__main__":
    main()
