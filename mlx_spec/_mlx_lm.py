"""mlx-lm's model classes without its package `__init__`.

`import mlx_lm.models.gemma3_text` first runs `mlx_lm/__init__.py`, which imports mlx-lm's
convert, generate and utils modules and through them transformers and huggingface_hub:
~1 s of a warm `mlx-spec generate`, though the model, cache and kernel modules import
none of it. `defer_package_init()` registers the `mlx_lm` package without running its
`__init__`; the real `__init__` runs, as it would have, the first time anything else is
imported from mlx-lm (`mlx_lm.utils`, `mlx_lm.tokenizer_utils`, ...) or a package attribute
(`mlx_lm.load`, `from mlx_lm import generate`) is used. Nothing changes when mlx-lm was
imported already.
"""

from __future__ import annotations

import importlib.util
import sys

# Subpackages that need nothing from mlx-lm's __init__ (their own imports stay inside them).
_WITHOUT_INIT = ("mlx_lm.models", "mlx_lm.kernels", "mlx_lm._version")


class _RunInitFirst:
    """A meta-path finder that runs the deferred `__init__` before any other mlx-lm module
    is imported, then lets the normal finders find it."""

    def __init__(self, package, spec):
        self.package, self.spec, self.done = package, spec, False

    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith("mlx_lm.") and not fullname.startswith(_WITHOUT_INIT):
            self.run()
        return None

    def run(self):
        if self.done:
            return
        self.done = True
        sys.meta_path.remove(self)
        self.spec.loader.exec_module(self.package)


def defer_package_init() -> None:
    """Register `mlx_lm` with its `__init__` deferred (see the module docstring)."""
    if "mlx_lm" in sys.modules:
        return
    spec = importlib.util.find_spec("mlx_lm")
    if spec is None or spec.loader is None:
        return  # not installed: the import that needs it reports that
    package = importlib.util.module_from_spec(spec)
    finder = _RunInitFirst(package, spec)

    def __getattr__(name):  # PEP 562: only names the package does not have yet
        if finder.done:
            raise AttributeError(f"module 'mlx_lm' has no attribute {name!r}")
        finder.run()
        return getattr(package, name)

    package.__getattr__ = __getattr__
    sys.modules["mlx_lm"] = package
    sys.meta_path.insert(0, finder)
