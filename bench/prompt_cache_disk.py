"""A restarted `serve` answering a long prompt it has seen before (issue 29: ≤ 0.2× a cold
prefill's time to first token with `--prompt-cache-dir`).

    python bench/prompt_cache_disk.py --tokens 8192 --repeats 2 --warm 3

Each repetition, in fresh server processes on the embedded default (as users start them):
a server on an empty folder answers the prompt (cold: the whole prefill) and stops, which
writes its cached conversation to the folder; then `--warm` servers, one after another, each
started on that folder, answer the same prompt again (from disk). Time to first token is the wall time of a non-streamed
request for one token (model loading is before it, not in it); the answer's usage says
how many prompt tokens came from the cache. Medians, the ratio, and the cache file's size.
The prompt: mlx_spec/prompts/long.txt repeated to about `--tokens` tokens.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import environment, median, uptime, write_results  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
BANNER = re.compile(r"at (http://\S+)/v1")


class Server:
    """`mlx-spec serve --port 0 --prompt-cache-dir DIR` in a subprocess."""

    def __init__(self, folder: Path, *flags: str):
        import httpx

        self.proc = subprocess.Popen([sys.executable, "-m", "mlx_spec.cli", "serve", "--port", "0",
                                      "--prompt-cache-dir", str(folder), *flags],
                                     stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
        self.log: list[str] = []
        self.url = None
        for line in self.proc.stderr:
            self.log.append(line)
            match = BANNER.search(line)
            if match:
                self.url = match.group(1)
                break
        if self.url is None:
            raise RuntimeError("the server did not start:\n" + "".join(self.log))
        threading.Thread(target=lambda: self.log.extend(self.proc.stderr), daemon=True).start()
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)

    def first_token(self, prompt: str) -> tuple[float, dict]:
        """(seconds, usage) of a one-token greedy completion of `prompt`."""
        import httpx

        start = time.perf_counter()
        response = httpx.post(self.url + "/v1/completions", timeout=3600, json={
            "model": "default", "prompt": prompt, "max_tokens": 1, "temperature": 0})
        seconds = time.perf_counter() - start
        response.raise_for_status()
        return seconds, response.json()["usage"]

    def stop(self) -> float:
        """Stop it (SIGTERM: it writes its caches first); the seconds that took."""
        start = time.perf_counter()
        self.proc.terminate()
        self.proc.wait(300)
        return time.perf_counter() - start


def long_prompt(tokens: int) -> str:
    """About `tokens` tokens of prose (Gemma's tokenizer: ~5 characters a token; the
    answers' usage reports the exact count)."""
    text = (ROOT / "mlx_spec" / "prompts" / "long.txt").read_text()
    copies, size = [], 0
    while size < 5 * tokens:
        copies.append(f"Part {len(copies) + 1}.\n{text}")
        size += len(copies[-1]) + 1
    return "\n".join(copies)[: 5 * tokens]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8192, help="prompt length (tokens)")
    parser.add_argument("--repeats", type=int, default=2, help="cold prefills (each in a fresh folder)")
    parser.add_argument("--warm", type=int, default=1, help="restarted servers per cold one")
    args = parser.parse_args()
    prompt = long_prompt(args.tokens)
    runs, load_before = [], uptime()
    for repeat in range(args.repeats):
        with tempfile.TemporaryDirectory(prefix="mlx-spec-disk-") as folder:
            folder = Path(folder)
            first = Server(folder)
            cold, cold_usage = first.first_token(prompt)
            write_s = first.stop()
            files = sorted(folder.glob("*.safetensors"))
            disk = []
            for _ in range(args.warm):
                second = Server(folder)
                warm, warm_usage = second.first_token(prompt)
                second.stop()
                assert "Traceback" not in "".join(first.log + second.log), "".join(first.log + second.log)
                disk.append(warm)
            runs.append({"cold_ttft_s": cold, "disk_ttft_s": disk, "ratio": median(disk) / cold,
                         "prompt_tokens": cold_usage["prompt_tokens"],
                         "cold_cached_tokens": cold_usage["prompt_tokens_details"]["cached_tokens"],
                         "disk_cached_tokens": warm_usage["prompt_tokens_details"]["cached_tokens"],
                         "stop_with_write_s": write_s, "load_after_run": uptime(),
                         "file_bytes": sum(f.stat().st_size for f in files)})
            print(f"run {repeat + 1}: cold {cold:.2f} s, from disk {', '.join(f'{d:.2f}' for d in disk)} s "
                  f"({median(disk) / cold:.3f}×), {runs[-1]['disk_cached_tokens']} of "
                  f"{runs[-1]['prompt_tokens']} prompt tokens from the cache, "
                  f"file {runs[-1]['file_bytes'] / 2**20:.0f} MiB", flush=True)
    summary = {"cold_ttft_s": median([r["cold_ttft_s"] for r in runs]),
               "disk_ttft_s": median([d for r in runs for d in r["disk_ttft_s"]])}
    summary["ratio"] = summary["disk_ttft_s"] / summary["cold_ttft_s"]
    print(f"median: cold {summary['cold_ttft_s']:.2f} s, from disk {summary['disk_ttft_s']:.2f} s, "
          f"{summary['ratio']:.3f}× (target ≤ 0.2×)")
    path = write_results(f"prompt_cache_disk_{args.tokens}", {
        "what": "time to first token of a restarted serve (embedded default) on a repeated prompt, "
                "from --prompt-cache-dir vs a cold prefill",
        "tokens": args.tokens, "repeats": args.repeats, "warm": args.warm, "summary": summary, "runs": runs,
        "environment": environment(), "load_before": load_before, "load_after": uptime()})
    print(path)


if __name__ == "__main__":
    main()
