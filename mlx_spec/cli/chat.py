"""`mlx-spec chat`: a multi-turn conversation in the terminal.

Both models' caches carry across turns (ChatSession), so each turn prefills only its new
tokens. Ctrl-C while an answer streams stops it between rounds: a SIGINT handler only sets a
flag, the loop sees it after the current round and closes the generator, which leaves the
caches consistent with the partial answer. Ctrl-C or EOF at the prompt quits.

On a terminal the prompt is edited with readline (arrows, history kept in the cache folder
across sessions); a multi-line paste arrives as one message (bracketed paste), and so does
everything between two lines of triple quotes.
"""

from __future__ import annotations

import re
import signal
import sys
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from typing import Annotated, Optional

import typer

from mlx_spec.apps import calibration
from mlx_spec.apps.conversation import ChatSession
from mlx_spec.apps.distributed import world
from mlx_spec.apps.runner import Gamma, build_engine
from mlx_spec.cli.app import app
from mlx_spec.cli.common import (
    ChatTemplateOpt,
    ColorOpt,
    DrafterOpt,
    DraftKvBitsOpt,
    DraftOnOpt,
    DraftOpt,
    DraftQuantizeOpt,
    DtypeOpt,
    GammaOpt,
    GrammarOpt,
    GroupSizeOpt,
    JsonSchemaOpt,
    KvBitsOpt,
    KvGroupSizeOpt,
    KvStartOpt,
    MaxTokensOpt,
    MinPOpt,
    ModelOpt,
    ModelOptions,
    PresetOpt,
    QuantizeOpt,
    RecalibrateOpt,
    RegexOpt,
    RepPenaltyOpt,
    SamplingOptions,
    SeedOpt,
    StopOpt,
    TempOpt,
    ThinkOpt,
    TopKOpt,
    TopPOpt,
    calibrate_gamma,
    checked_text,
    refuse_thinking_with_grammar,
    setup_models,
    structured_output,
    template_kwargs,
    thought_splitter,
)
from mlx_spec.cli.render import ViewMaker, plural, render_stats, summary_line
from mlx_spec.core.cache.files import CacheFileError, cache_key, writable_folder
from mlx_spec.core.stats import Stats
from mlx_spec.errors import MlxSpecError, UsageError
from mlx_spec.models.vision import read_image_file

PROMPT = ">>> "
MORE = "... "  # inside a triple-quoted message
FENCE = '"""'
HISTORY_FILE = "chat_history"  # in the cache folder
HISTORY_LENGTH = 1000
THOUGHT_STYLE = "dim"  # a thought, before the answer
HELP = """commands:
  /gamma N|auto   set γ, the draft tokens per round (0 = plain decoding)
  /temp X         set the sampling temperature (0 = greedy)
  /stats          full statistics of the last answer
  /thought        the last answer's thought (on a terminal it folds when the answer starts)
  /image PATH     attach an image to your next message (a model with a vision tower)
  /reset          forget the conversation (clears both caches)
  /help           this help
  /quit           leave (also Ctrl-D, or Ctrl-C at the prompt)
A message of several lines: paste it, or put it between two lines of \"\"\".
Ctrl-C while an answer streams stops it and keeps what was said."""


class _Interrupt:
    """SIGINT sets a flag while an answer streams; the loop checks it between rounds."""

    def __init__(self):
        self.hit = False
        self._previous = None

    def __enter__(self):
        self.hit = False
        self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame):
        self.hit = True

    def __exit__(self, *exc):
        signal.signal(signal.SIGINT, self._previous)
        return False


@contextmanager
def _no_echo():
    """While an answer streams, keystrokes are not echoed into it; what was typed meanwhile
    is discarded (it was never shown, so the user could not have checked it)."""
    if not sys.stdin.isatty():
        yield
        return
    import termios

    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    quiet = termios.tcgetattr(fd)
    quiet[3] &= ~termios.ECHO
    termios.tcsetattr(fd, termios.TCSANOW, quiet)
    try:
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSAFLUSH, saved)  # drops the unread typed-ahead input


@contextmanager
def _line_editing():
    """Readline for the prompt when stdin is a terminal: arrows edit the line, Up/Down walk
    the history, which is kept in the cache folder across sessions. Pastes are bracketed, so
    a pasted block with newlines is one message (Python turns bracketed paste off by default)."""
    try:
        if not sys.stdin.isatty():
            raise ImportError
        import readline
    except ImportError:  # piped, or a Python built without readline: plain input()
        yield
        return
    from mlx_spec.loading.sources import cache_root

    history = cache_root() / HISTORY_FILE
    if "libedit" not in (readline.__doc__ or ""):  # macOS's libedit has no such setting
        readline.parse_and_bind("set enable-bracketed-paste on")
    readline.set_history_length(HISTORY_LENGTH)
    try:
        readline.read_history_file(history)
    except OSError:  # none yet, or unreadable: start with an empty history
        pass
    try:
        yield
    finally:
        try:
            history.parent.mkdir(parents=True, exist_ok=True)
            readline.write_history_file(history)
        except OSError:  # a read-only cache folder costs the history, not the session
            pass


class ChatRepl:
    """The loop: read a line, run a slash command or ask the model, print a footer."""

    def __init__(self, session: ChatSession, setup, engine, params, gamma: Gamma, max_tokens: int,
                 stop, color: bool, out=None, grammar=None):
        """`grammar`: a function giving each answer its own grammar matcher (see
        `structured_output`), or None."""
        from rich.console import Console

        self.session, self.setup, self.engine = session, setup, engine
        self.params, self.max_tokens, self.stop = params, max_tokens, stop or ()
        self.color, self.grammar = color, grammar
        self.console = Console(file=out or sys.stdout, highlight=False)
        self.tty = self.console.is_terminal
        self.last_view = None
        self.last_thought = ""
        self.thinking = False  # a thought is being shown
        self.turns = 0
        self.images: list = []  # attached with /image, sent with the next message
        self.set_gamma(gamma, name="--gamma")

    # -- state changes ---------------------------------------------------------------

    def set_gamma(self, gamma: Gamma, name: str = "/gamma") -> None:
        """`name`: the flag or command that set it, for error messages."""
        if self.engine.drafter is None and gamma != 0:
            raise MlxSpecError("drafting is off (--drafter none): only /gamma 0 applies")
        context = max(len(self.session.ids), 1)
        self.policy = calibrate_gamma(self.engine, gamma, context, name=name,
                                      reproducible=self.params.seed is not None)
        self.gamma = gamma if self.engine.drafter is not None else Gamma.OFF
        self.views = ViewMaker(self.engine, self.policy, self.gamma)

    def command(self, line: str) -> bool:
        """Run a slash command; False means quit."""
        name, _, arg = line[1:].strip().partition(" ")
        arg = arg.strip()
        if name in ("quit", "exit", "q"):
            return False
        if name == "help":
            self.say(HELP)
        elif name == "gamma":
            if not arg:
                self.say(f"γ is {self.gamma}; /gamma N or /gamma auto changes it")
            else:
                self.set_gamma(Gamma.parse(arg, name="/gamma"))
                self.say(f"γ set to {self.gamma}")
        elif name == "temp":
            try:
                value = float(arg)
            except ValueError:
                raise MlxSpecError(f"/temp needs a number, not {arg!r}") from None
            self.params = replace(self.params, temperature=value)
            self.say(f"temperature set to {value:g}")
        elif name == "thought":
            self.say(self.last_thought.strip() or "the last answer had no thought", style=THOUGHT_STYLE)
        elif name == "stats":
            if self.last_view is None:
                self.say("no answer yet")
            else:
                self.console.print(render_stats(self.last_view, title="last answer"))
                self.say(f"conversation: {plural(self.turns, 'turn')}, {plural(len(self.session.ids), 'token')} in context")
        elif name == "image":
            if not arg:
                raise MlxSpecError("/image needs the path of an image file")
            if self.engine.vision is None:
                raise MlxSpecError("this model reads no images (it has no vision tower)")
            self.images.append(read_image_file(arg, "/image"))
            self.say(f"{plural(len(self.images), 'image')} attached to your next message")
        elif name == "reset":
            self.session.reset()
            self.images = []
            self.turns = 0
            self.last_view = None
            self.say("conversation cleared")
        else:
            raise MlxSpecError(f"unknown command /{name}; /help lists them")
        return True

    # -- output --------------------------------------------------------------------------

    def say(self, text: str, style: str = "dim") -> None:
        self.console.print(text, style=style if self.tty else None, markup=False)

    def write(self, text: str, style: Optional[str] = None) -> None:
        if self.tty and style:
            self.console.print(text, style=style, end="", markup=False, soft_wrap=True)
        else:
            self.console.file.write(text)
        self.console.file.flush()

    # -- one turn ------------------------------------------------------------------------

    def show(self, thought: str, answer: str, from_draft: bool) -> None:
        """A piece of the answer: its thought dimmed, then the answer on a line of its own;
        on a terminal the thought folds into one line when the answer starts."""
        if thought:
            self.write(thought, THOUGHT_STYLE)
            self.last_thought += thought
            self.thinking = True
        if answer:
            if self.thinking:
                self.thinking = False
                if not self._fold_thought():
                    self.write("\n" if self.last_thought.endswith("\n") else "\n\n")
            self.write(answer, "green" if (self.color and from_draft) else None)

    def _fold_thought(self) -> bool:
        """Erase the thought just shown (the rows it took, if all are still on screen) and
        leave one dim line in its place; /thought shows it again."""
        from rich.cells import cell_len

        if not self.tty:
            return False
        width = max(self.console.width, 1)
        rows = sum(max(1, -(-cell_len(line) // width)) for line in self.last_thought.split("\n"))
        if rows >= self.console.height:
            return False
        up = f"\x1b[{rows - 1}A" if rows > 1 else ""
        self.console.file.write("\r" + up + "\x1b[J")
        words = len(self.last_thought.split())
        self.say(f"[thought · {plural(words, 'word')} · /thought shows it]", style=THOUGHT_STYLE)
        return True

    def answer(self, text: str) -> None:
        stats = Stats()
        stopped = False
        splitter, self.thinking, self.last_thought = None, False, ""
        # Across ranks every rank must stop at the same round, so Ctrl-C ends the run there.
        alone = not world().active
        with (_Interrupt() if alone else nullcontext(_Interrupt())) as interrupt, _no_echo():
            images, self.images = self.images, []
            responses = self.session.ask(text, self.params, images, gamma=self.policy,
                                         max_tokens=self.max_tokens, stop=self.stop, stats=stats,
                                         constraint=self.grammar() if self.grammar else None)
            try:
                for response in responses:
                    if splitter is None:  # the turn's prompt is known once it streams
                        splitter = thought_splitter(self.session.tokenizer, True, self.session.prompt_ids)
                    for piece, from_draft in response.segments():
                        self.show(*splitter.feed(piece), from_draft)
                    if interrupt.hit:
                        stopped = True
                        break
            finally:
                responses.close()  # ChatSession keeps the caches consistent on close
        if splitter is not None:
            self.show(*splitter.finish(), False)
        self.turns += 1
        self.write("\n")
        self.last_view = self.views(stats)
        footer = summary_line(self.last_view)
        self.say(f"[{'stopped · ' if stopped else ''}{footer}]")

    def read_line(self) -> Optional[str]:
        """The next message, None at EOF or Ctrl-C: one line, or the lines between two
        lines of triple quotes. Across ranks rank 0 reads and every rank receives the same."""
        w = world()
        line = None
        if w.is_root:
            try:
                line = input(PROMPT)
                if line.strip() == FENCE:
                    lines = []
                    while (more := input(MORE)).strip() != FENCE:
                        lines.append(more)
                    line = "\n".join(lines)
            except (EOFError, KeyboardInterrupt):
                self.write("\n")
                line = None
        return w.broadcast_text(line)

    def run(self) -> None:
        if hasattr(sys.stdin, "reconfigure"):  # bytes that are not UTF-8 arrive as surrogates,
            sys.stdin.reconfigure(errors="surrogateescape")  # which checked_text replaces
        with _line_editing():
            self._loop()

    def _loop(self) -> None:
        self.say("mlx-spec chat: /help for commands, /quit to leave", style="bold")
        # A GGUF import's fast tokenizer renders no chat template: mlx-lm's loads while the
        # first message is typed (started just before the prompt, which it would delay).
        preload = getattr(self.session.tokenizer, "load_full_in_background", None)
        if preload is not None:
            preload()
        while True:
            line = self.read_line()
            if line is None:
                return
            line = checked_text(line, "your message").strip()
            if not line:
                continue
            try:
                if line.startswith("/"):
                    if not self.command(line):
                        return
                else:
                    self.answer(line)
            except MlxSpecError as error:
                self.say(f"error: {error}", style="red")


@app.command()
def chat(
    model: ModelOpt = None,
    draft_model: DraftOpt = None,
    drafter: DrafterOpt = None,
    preset: PresetOpt = None,
    gamma: GammaOpt = None,
    recalibrate: RecalibrateOpt = False,
    dtype: DtypeOpt = None,
    quantize: QuantizeOpt = None,
    draft_quantize: DraftQuantizeOpt = None,
    draft_on: DraftOnOpt = None,
    group_size: GroupSizeOpt = None,
    kv_bits: KvBitsOpt = None,
    kv_group_size: KvGroupSizeOpt = None,
    kv_start: KvStartOpt = None,
    draft_kv_bits: DraftKvBitsOpt = None,
    chat_template: ChatTemplateOpt = None,
    temp: TempOpt = None,
    top_p: TopPOpt = None,
    top_k: TopKOpt = None,
    min_p: MinPOpt = None,
    repetition_penalty: RepPenaltyOpt = None,
    seed: SeedOpt = None,
    max_tokens: MaxTokensOpt = 512,
    stop: StopOpt = None,
    system: Annotated[Optional[str], typer.Option(
        "--system", help="A system message for the conversation.")] = None,
    think: ThinkOpt = None,
    json_schema: JsonSchemaOpt = None,
    regex: RegexOpt = None,
    grammar: GrammarOpt = None,
    color_drafts: ColorOpt = False,
    save: Annotated[Optional[str], typer.Option(
        "--save", metavar="NAME",
        help="On leaving, save the conversation and both models' caches as session NAME (in "
             "$MLX_SPEC_SESSIONS, default the cache folder's sessions/), replacing one of that "
             "name.")] = None,
    resume: Annotated[Optional[str], typer.Option(
        "--resume", metavar="NAME",
        help="Continue saved session NAME with its messages and caches, so nothing said "
             "before is prefilled again; it is saved back on leaving (or as --save NAME). "
             "Refused if it was saved with other models, tokenizer, dtype or kv-bits.")] = None,
) -> None:
    """Chat with the model in the terminal (multi-turn, caches reused across turns).

    Slash commands: /gamma N|auto, /temp X, /stats, /thought, /image PATH, /reset, /help,
    /quit. The line is edited with readline (history in the cache folder); a pasted block,
    or lines between two lines of triple quotes, is one message; Ctrl-D leaves.
    """
    saved_as = save or resume
    refuse_thinking_with_grammar(think, json_schema, regex, grammar)
    if saved_as is not None:
        if world().active:
            raise UsageError("--save and --resume do not run across ranks (mlx.launch): each "
                             "rank holds a part of the cache")
        if resume is not None and system is not None:
            raise UsageError("a resumed session keeps its own system message", flag="--system")
        resume_path = session_path(resume, "--resume") if resume is not None else None
        save_path = session_path(saved_as, "--save" if save else "--resume")
        if resume_path is not None and not resume_path.exists():
            raise MlxSpecError(f"no saved chat session {resume!r} in {resume_path.parent}")
    calibration.recalibrate(recalibrate)
    setup = setup_models(ModelOptions.from_flags(locals()), SamplingOptions.from_flags(locals()), chat="later",
                         preset_template=True)
    params = setup.params
    engine = build_engine(setup.pair, setup.drafter, **setup.engine_options)
    session = ChatSession(engine, setup.pair.tokenizer, system=system,
                          template_kwargs=template_kwargs(think, True))
    key = cache_key(engine, setup.pair.tokenizer) if saved_as is not None else None
    if resume is not None:
        try:
            session.resume(resume_path, key)
        except CacheFileError as error:
            raise MlxSpecError(f"cannot resume session {resume!r}: {error}") from None
    constrained = structured_output(setup, engine, json_schema, regex, grammar)  # every answer follows it
    stop = [*(stop or ()), *setup.template_stops]
    repl = ChatRepl(session, setup, engine, params, setup.gamma, max_tokens, stop, color_drafts,
                    grammar=constrained)
    if resume is not None:
        repl.turns = sum(m["role"] == "assistant" for m in session.messages)
        repl.say(f"resumed session {resume!r}: {plural(repl.turns, 'turn')}, "
                 f"{plural(len(session.ids), 'token')} in context")
    repl.run()
    if saved_as is not None:
        try:
            session.save(save_path, key)
        except (OSError, MlxSpecError) as error:  # a full disk (or images) costs the saved session, not the chat
            print(f"warning: could not save session {saved_as!r}: {getattr(error, 'strerror', None) or error}",
                  file=sys.stderr)
        else:
            repl.say(f"session saved as {saved_as!r}")


SESSION_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


def sessions_folder():
    """Where chat sessions are saved: $MLX_SPEC_SESSIONS, else the cache folder's sessions/."""
    import os
    from pathlib import Path

    from mlx_spec.loading.sources import cache_root

    folder = os.environ.get("MLX_SPEC_SESSIONS")
    return Path(folder).expanduser() if folder else cache_root() / "sessions"


def session_path(name: str, flag: str):
    """The file of session `name` (a plain name, no path), its folder created."""
    if not SESSION_NAME.fullmatch(name):
        raise UsageError(f"{name!r} is not a session name: letters, digits, '.', '_' and '-', "
                         "starting with a letter or digit", flag=flag)
    return writable_folder(sessions_folder(), flag) / f"{name}.safetensors"
