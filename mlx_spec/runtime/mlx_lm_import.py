"""mlx-lm's model classes without its package `__init__`.

`import mlx_lm.models.gemma3_text` first runs `mlx_lm/__init__.py`, which imports mlx-lm's
convert, generate and utils modules and through them transformers and huggingface_hub:
~1 s of a warm `mlx-spec generate`, though the model, cache and kernel modules import
none of it. `defer_package_init()` registers the `mlx_lm` package without running its
`__init__`; the real `__init__` runs, as it would have, the first time anything else is
imported from mlx-lm (`mlx_lm.utils`, `mlx_lm.generate`, ...) or a package attribute
(`mlx_lm.load`, `from mlx_lm import generate`) is used. Nothing changes when mlx-lm was
imported already. tests/runtime/test_startup.py.py checks that the package then looks as usual.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import types

# Subpackages that need nothing from mlx-lm's __init__ (their own imports stay inside them).
_WITHOUT_INIT = ("mlx_lm.models", "mlx_lm.kernels", "mlx_lm._version")


class _Package(types.ModuleType):
    """The `mlx_lm` package while its `__init__` may still be deferred."""

    def __getattr__(self, name):  # PEP 562: only for names the package does not have yet
        finder = self.__dict__.get("_mlx_spec_finder")
        if finder is None or finder.done:
            raise AttributeError(f"module 'mlx_lm' has no attribute {name!r}")
        finder.run()
        return getattr(self, name)

    def __setattr__(self, name, value):
        # The import system binds each submodule on its package once loaded. A submodule
        # whose import ran the deferred __init__ (`import mlx_lm.generate`) is bound after
        # __init__ bound its own name (the function `generate`); that binding stays, as it
        # does when __init__ runs first.
        current = self.__dict__.get(name)
        if isinstance(value, types.ModuleType) and current is not None and not isinstance(current, types.ModuleType):
            return
        super().__setattr__(name, value)


class _Loaded(importlib.abc.Loader):
    """Hands the import system a module that the deferred __init__ has just imported."""

    def __init__(self, module):
        self.module = module

    def create_module(self, spec):
        return self.module

    def exec_module(self, module):
        module.__spec__ = self.spec  # module_from_spec replaced it with ours

    def spec_of(self, module):
        self.spec = module.__spec__
        return importlib.util.spec_from_loader(module.__name__, self, origin=self.spec.origin)


class _RunInitFirst:
    """A meta-path finder that runs the deferred `__init__` before any other mlx-lm module
    is imported, then lets the normal finders find it (or returns what __init__ imported)."""

    def __init__(self, package, spec):
        self.package, self.spec, self.done = package, spec, False

    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith("mlx_lm.") or fullname.startswith(_WITHOUT_INIT):
            return None
        self.run()
        module = sys.modules.get(fullname)
        return None if module is None else _Loaded(module).spec_of(module)

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
    package.__class__ = _Package
    finder = _RunInitFirst(package, spec)
    package._mlx_spec_finder = finder
    sys.modules["mlx_lm"] = package
    sys.meta_path.insert(0, finder)
