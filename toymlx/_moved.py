"""toymlx 0.2's flat module paths (`toymlx.generate`, `toymlx.runs`, ...), importable for one
more release with a DeprecationWarning naming the new place.

`MOVED` is the one table: old dotted name -> the module(s) that now hold its names. A module
moved whole is the same module object under both names (so a monkeypatch through either
reaches the code); a module split in several is a stand-in whose attributes are looked up in
the new modules, in order. `install()` puts the finder on `sys.meta_path` (toymlx's
`__init__`)."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings
from typing import Any

MOVED: dict[str, tuple[str, ...]] = {
    "toymlx.api": ("toymlx.runner.api",),
    "toymlx.atomic": ("toymlx.backend.atomic",),
    "toymlx.blas_rebind": ("toymlx.backend.blas_rebind",),
    "toymlx.checkpoint": ("toymlx.bundle.checkpoint",),
    "toymlx.classify": ("toymlx.generation.classify",),
    "toymlx.cpu_streams": ("toymlx.training.cpu_streams",),
    "toymlx.device": ("toymlx.backend.device",),
    "toymlx.events": ("toymlx.bundle.events",),
    "toymlx.fastmath": ("toymlx.backend.fastmath",),
    "toymlx.fuse": ("toymlx.gguf.fuse",),
    "toymlx.gemv_forward": ("toymlx.backend.gemv_forward",),
    "toymlx.generate": ("toymlx.generation.generate",),
    "toymlx.gptq": ("toymlx.gguf.gptq",),
    "toymlx.launch": ("toymlx.runner.launch",),
    "toymlx.lifeline": ("toymlx.backend.lifeline",),
    "toymlx.llamacpp_decode": ("toymlx.generation.llamacpp_decode",),
    "toymlx.lock": ("toymlx.backend.lock",),
    "toymlx.lora": ("toymlx.models.lora", "toymlx.training.adapter", "toymlx.training.fused",
                    "toymlx.interop.merge"),
    "toymlx.losses": ("toymlx.models.losses",),
    "toymlx.memory": ("toymlx.training.memory",),
    "toymlx.model_store": ("toymlx.bundle.model_store",),
    "toymlx.modelfile": ("toymlx.interop.modelfile",),
    "toymlx.outputs": ("toymlx.bundle.outputs",),
    "toymlx.report": ("toymlx.runner.report",),
    "toymlx.run": ("toymlx.runner.run",),
    "toymlx.runs": ("toymlx.runner.bundle", "toymlx.bundle.options", "toymlx.bundle.inputs",
                    "toymlx.bundle.folder", "toymlx.bundle.resume"),
    "toymlx.sampling": ("toymlx.generation.sampling",),
    "toymlx.schedule": ("toymlx.training.schedule",),
    "toymlx.step": ("toymlx.training.step",),
    "toymlx.sweep": ("toymlx.sweeps", "toymlx.sweeps.spec", "toymlx.sweeps.supervisor"),
    "toymlx.timm_export": ("toymlx.interop.timm_export",),
    "toymlx.tokenizer": ("toymlx.data.tokenizer", "toymlx.data.vocab", "toymlx.data.merges",
                         "toymlx.data.special_tokens", "toymlx.data.chat_template"),
    "toymlx.trainer": ("toymlx.training.trainer", "toymlx.training.task",
                       "toymlx.training.evaluate"),
    "toymlx.warm": ("toymlx.recipes.warm",),
}


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the old names of `MOVED` and loads them as their new modules."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None
                  ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return types.ModuleType(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        old, new = module.__name__, MOVED[module.__name__]
        warnings.warn(f"{old} moved to {' and '.join(new)}; import it from there ({old} goes "
                      "in the next release)", DeprecationWarning, stacklevel=2)
        if len(new) == 1:  # the import system hands out what sys.modules holds after this
            sys.modules[old] = importlib.import_module(new[0])
            return
        held = [importlib.import_module(n) for n in new]

        def __getattr__(name: str) -> Any:
            for m in held:
                if hasattr(m, name):
                    return getattr(m, name)
            raise AttributeError(f"module {old!r} has no attribute {name!r} (it moved to "
                                 f"{' and '.join(new)})")

        module.__getattr__ = __getattr__  # type: ignore[method-assign]


def install() -> None:
    """Put the finder of the old module paths on `sys.meta_path` (once)."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())  # it answers only the names no file has now
