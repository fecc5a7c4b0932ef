"""User-facing errors.

Anything a user can cause (a bad path, an offline hub, an incompatible pair) raises a
`MlxSpecError` whose message is one line; the CLI prints it without a traceback and exits 1.
A refused value (`UsageError`) exits 2, as a usage error does.
"""


class MlxSpecError(Exception):
    """An error with a one-line message meant for the user."""


class ModelLoadError(MlxSpecError):
    """A model could not be found, downloaded, imported or built."""


class IncompatibleModelsError(MlxSpecError):
    """Target and draft cannot be paired (different tokenizers or vocabularies)."""


class UsageError(MlxSpecError, ValueError):
    """A value the caller chose is refused: a flag, an argument, a request field. The CLI
    prints it as a usage error (exit 2, like a flag Click refuses); the server answers 400;
    library callers can catch it as the ValueError it is.

    Attributes:
        flag: the command-line flag the value came from, when the message does not name it;
            the CLI then says "invalid value for FLAG: message".
    """

    def __init__(self, message: str, *, flag: str | None = None):
        super().__init__(message)
        self.flag = flag
