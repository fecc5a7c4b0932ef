"""User-facing errors.

Anything a user can cause (a bad path, an offline hub, an incompatible pair) raises a
`MlxSpecError` whose message is one line; the CLI prints it without a traceback.
"""


class MlxSpecError(Exception):
    """An error with a one-line message meant for the user."""


class ModelLoadError(MlxSpecError):
    """A model could not be found, downloaded, imported or built."""


class IncompatibleModelsError(MlxSpecError):
    """Target and draft cannot be paired (different tokenizers or vocabularies)."""
