"""Re-run the example commands of README.md and docs/*.md and write their fresh output in.

    python scripts/readme_examples.py            # rewrite every example block of those pages
    python scripts/readme_examples.py --only chat --dry-run

A ```console block right after a `<!-- example: NAME KIND -->` comment is generated here;
every other block is prose the script leaves alone. Kinds:

    run      each `$ command` line runs in bash; its output replaces the lines up to the next `$`
    chat     the one `$ mlx-spec chat ...` runs with the block's `>>> ` lines as its input,
             and the typed lines are put back after each prompt, as a terminal shows them
    excerpt  a hand-shortened `--json` object: the command runs and each `"key": value`
             shown takes the fresh value (a key of the top level or of "stats")
    server   against a fresh `mlx-spec serve` (the embedded default, a free port shown as
             8080): a console block's `$` lines run as in `run`; a console block right
             after a ```python block is that program's output

The commands run as a user's later run would: in a scratch folder (its `docs` is the
checkout's, so a `--plot docs/...` lands in the repository), with a private cache warmed
by one `generate` first (the import of the embedded model and its cost curve, which a
first run adds), and with stdout and stderr together, as a terminal shows them. Progress
lines, which a terminal shows as a transient bar, are dropped, and so are trailing spaces. Re-run this whenever the
output of a command changes, and commit the pages with the code that changed it. Example
names are unique across the pages, so `--only NAME` picks one block.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]  # every page whose commands are checked
MARKER = re.compile(r"^<!-- example: (?P<name>[\w-]+) (?P<kind>run|chat|excerpt|server) -->$")
SHOWN_URL = "127.0.0.1:8080"  # the address the pages show; a server example's own port replaces it
FENCE = re.compile(r"^\s*```")
PROGRESS = re.compile(r"^(\[\d+/\d+\] |calibrating the cost curve|Importing |downloading )")
COLUMNS = "400"  # Rich wraps at this width when output is not a terminal: lines stay whole


# ---------------------------------------------------------------------------------------
# Reading the pages
# ---------------------------------------------------------------------------------------

@dataclass
class Block:
    """A fenced code block: its language, its lines (without the fences), where the lines
    start in the file (0-based), and the example marker above it, if any."""

    language: str
    lines: list[str]
    start: int
    example: tuple[str, str] | None = None  # (name, kind)


def code_blocks(text: str) -> list[Block]:
    lines = text.splitlines()
    blocks, i = [], 0
    while i < len(lines):
        if FENCE.match(lines[i]):
            language = lines[i].strip().strip("`").strip()
            end = next(j for j in range(i + 1, len(lines)) if FENCE.match(lines[j]))
            above = lines[i - 1].strip() if i else ""
            marker = MARKER.match(above)
            blocks.append(Block(language, lines[i + 1:end], i + 1,
                                (marker["name"], marker["kind"]) if marker else None))
            i = end + 1
        else:
            i += 1
    return blocks


def commands(block: Block) -> list[str]:
    """The shell commands a block shows: `$ ...` lines of a console block, every line of a
    bash block; backslash continuations joined, comments dropped."""
    if block.language == "console":
        raw = [i for i, line in enumerate(block.lines) if line.lstrip().startswith("$ ")]
        starts = [(i, block.lines[i].lstrip()[2:]) for i in raw]
    elif block.language in ("bash", "sh", "shell"):
        starts = [(i, line) for i, line in enumerate(block.lines)
                  if line.strip() and not line.lstrip().startswith("#")]
    else:
        return []
    out, skip = [], set()
    for i, line in starts:
        if i in skip:
            continue
        j = i
        while line.rstrip().endswith("\\") and j + 1 < len(block.lines):
            j += 1
            skip.add(j)
            line = line.rstrip()[:-1] + " " + block.lines[j].strip()
        out.append(line.strip())
    return out


def mlx_spec_args(command: str) -> list[list[str]]:
    """The argument lists of every `mlx-spec` invocation in a shell command line (after
    `&&`, inside `mlx.launch ... --`, before a pipe or a redirection)."""
    try:
        words = shlex.split(command, comments=True)
    except ValueError:  # an unbalanced quote: not a command
        return []
    found, current = [], None
    for word in words:
        if word in ("&&", "||", ";", "|") or word.startswith((">", "<", "2>")):
            current = None
            continue
        if word == "mlx-spec":
            current = []
            found.append(current)
        elif current is not None:
            current.append(word)
    return found


def inline_commands(text: str) -> list[str]:
    """`mlx-spec ...` in inline code spans of the prose, other than placeholders such as
    `mlx-spec models info NAME|PATH`."""
    spans = re.findall(r"(?<!`)`(mlx-spec [^`]+)`(?!`)", text)
    return [s for s in spans if not re.search(r"\b[A-Z]{3,}\b|\|", s)]


def every_command(text: str) -> list[list[str]]:
    """Argument lists of every mlx-spec command a page shows, in code blocks and inline."""
    found = []
    for block in code_blocks(text):
        for command in commands(block):
            found += mlx_spec_args(command)
    for command in inline_commands(text):
        found += mlx_spec_args(command)
    return found


# ---------------------------------------------------------------------------------------
# Running the examples
# ---------------------------------------------------------------------------------------

class Runner:
    """Runs commands in one scratch folder with a private, warmed cache."""

    def __init__(self, scratch: Path):
        self.scratch = scratch
        (scratch / "docs").symlink_to(ROOT / "docs")
        self.env = {**os.environ, "MLX_SPEC_CACHE": str(scratch / "cache"), "COLUMNS": COLUMNS,
                    "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        self.env.pop("MLX_SPEC_DEBUG", None)
        print("warming the cache (first-run import and cost curve) ...", file=sys.stderr)
        self.run("mlx-spec generate -n 4 Hello")

    def run(self, command: str, stdin: str = "") -> str:
        result = subprocess.run(["bash", "-c", command], cwd=self.scratch, env=self.env, input=stdin,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if result.returncode != 0:
            raise SystemExit(f"`{command}` failed (exit {result.returncode}):\n{result.stdout}")
        return "\n".join(line.rstrip() for line in result.stdout.splitlines() if not PROGRESS.match(line))


class Server:
    """A fresh `mlx-spec serve` on a free port for one example, stopped when it is done."""

    def __init__(self, runner: Runner):
        self.process = subprocess.Popen(["mlx-spec", "serve", "--port", "0"], cwd=runner.scratch, env=runner.env,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        for line in self.process.stderr:
            if match := re.search(r"at http://127\.0\.0\.1:(\d+)/v1", line):
                self.address = f"127.0.0.1:{match[1]}"
                break
        else:
            raise SystemExit(f"mlx-spec serve did not start (exit {self.process.wait()})")
        # keep reading its log, so a full pipe never blocks it
        threading.Thread(target=self.process.stderr.read, daemon=True).start()

    def __enter__(self):
        return self

    def __exit__(self, *_):
        self.process.terminate()
        self.process.wait(timeout=60)


def regenerate(block: Block, runner: Runner, before: Block | None = None) -> list[str]:
    """The block's new lines (`before`: the block above it, a server example's program)."""
    kind = block.example[1]
    if kind == "server":
        with Server(runner) as server:
            here = lambda text: text.replace(SHOWN_URL, server.address)
            shown = lambda text: text.replace(server.address, SHOWN_URL)
            if before is not None and before.language == "python" and not commands(block):
                program = "\n".join(before.lines)
                output = runner.run(f"python - <<'PROGRAM'\n{here(program)}\nPROGRAM")
                return shown(output).splitlines()
            out = []
            for command, shown_lines in zip(commands(block), _shown_commands(block)):
                out += shown_lines  # as the page wrote it, continuation lines and all
                out += shown(runner.run(here(command))).splitlines()
            return out
    if kind == "run":
        out = []
        for command in commands(block):
            out.append(f"$ {command}")
            output = runner.run(command)
            out += output.splitlines()
        return out
    if kind == "chat":
        (command,) = commands(block)
        typed = [line[4:] for line in block.lines if line.startswith(">>> ")]
        output = runner.run(command, stdin="".join(f"{line}\n" for line in typed))
        for line in typed:  # piped, input() shows its prompt but not what was typed (the
            # last prompt ends the output, its trailing space stripped)
            output = re.sub(r">>>(?: |$)", lambda _: f">>>\0{line}\n", output, count=1, flags=re.M)
        return [f"$ {command}"] + output.replace(">>>\0", ">>> ").rstrip("\n").splitlines()
    if kind == "excerpt":
        (command,) = commands(block)
        fresh = json.loads(runner.run(command).splitlines()[-1])
        return [f"$ {command}"] + [_refresh_values(line, fresh) for line in block.lines[1:]]
    raise ValueError(kind)


def _shown_commands(block: Block) -> list[list[str]]:
    """Each `$ ...` command of a console block as its lines on the page (with continuations)."""
    shown, current = [], None
    for line in block.lines:
        if line.lstrip().startswith("$ "):
            current = [line]
            shown.append(current)
        elif current is not None and current[-1].rstrip().endswith("\\"):
            current.append(line)
        else:
            current = None
    return shown


_VALUE = re.compile(r'"(?P<key>\w+)": (?P<value>-?[\d.]+(?:e[+-]?\d+)?|"(?:[^"\\]|\\.)*"|null|true|false|\[[^\[\]]*\])')


def _refresh_values(line: str, fresh: dict) -> str:
    """Each `"key": value` of an excerpt line with the fresh run's value, written as the old
    one was (the same decimals, or exponent form)."""
    def replace(match):
        key, old = match["key"], match["value"]
        if key in fresh and not isinstance(fresh[key], dict):
            value = fresh[key]
        elif key in fresh.get("stats", {}):
            value = fresh["stats"][key]
        else:
            return match[0]
        return f'"{key}": {_like(old, value)}'

    return _VALUE.sub(replace, line)


def _like(old: str, value) -> str:
    if isinstance(value, float) and not isinstance(value, bool):
        if "e" in old:
            return f"{value:.{len(old.split('e')[0].split('.')[-1])}e}".replace("e+0", "e").replace("e+", "e")
        decimals = len(old.split(".")[1]) if "." in old else 0
        return f"{value:.{decimals}f}"
    if isinstance(value, list):
        first = old.strip("[]").split(",")[0].strip() or "0.00"
        return "[" + ", ".join(_like(first, v) for v in value) + "]"
    return json.dumps(value, ensure_ascii=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", help="Regenerate only this example (repeatable).")
    parser.add_argument("--dry-run", action="store_true", help="Print the new blocks; leave the pages alone.")
    args = parser.parse_args()

    every = {page: code_blocks(page.read_text()) for page in PAGES}
    chosen = {page: [b for b in blocks if b.example and (not args.only or b.example[0] in args.only)]
              for page, blocks in every.items()}
    if not any(chosen.values()):
        raise SystemExit("no example blocks matched")
    with tempfile.TemporaryDirectory(prefix="readme-examples-") as scratch:
        runner = Runner(Path(scratch))
        for page, examples in chosen.items():
            if not examples:
                continue
            lines = page.read_text().splitlines()
            fresh = []
            for block in examples:  # in page order: a server example's state is its own, the rest share the cache
                print(f"running example {block.example[0]} ({page.relative_to(ROOT)}) ...", file=sys.stderr)
                index = every[page].index(block)
                fresh.append((block, regenerate(block, runner, every[page][index - 1] if index else None)))
                if args.dry_run:
                    print("\n".join(fresh[-1][1]))
            for block, new in reversed(fresh):  # from the end, so earlier line numbers stay valid
                lines[block.start:block.start + len(block.lines)] = new
            if not args.dry_run:
                page.write_text("\n".join(lines) + "\n")
                print(f"rewrote {len(examples)} example block(s) in {page}", file=sys.stderr)


if __name__ == "__main__":
    main()
