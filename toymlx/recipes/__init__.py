"""The recipes: each a short module with a `Config` dataclass and `build(cfg) -> Task`.

`RECIPES` is the only registry; modules are imported lazily so `--help` stays fast.
"""

from __future__ import annotations

import difflib
import importlib
from types import ModuleType

RECIPES: dict[str, str] = {
    "from-scratch": "toymlx.recipes.from_scratch",
    "warm-start": "toymlx.recipes.warm_start",
    "lora": "toymlx.recipes.lora",
    "vit-tiny": "toymlx.recipes.vit_tiny",
}

SUMMARIES: dict[str, str] = {
    "from-scratch": "a small Llama from random init on any text (default: the Python docs)",
    "warm-start": "a new Llama whose token embeddings start from a donor GGUF's",
    "lora": "fine-tune a GGUF you have (--base FILE.gguf): LoRA, DoRA or every weight",
    "vit-tiny": "a ViT-Tiny image classifier on your images (default: 8x8 digits shipped)",
}
"""What each recipe trains, in one line: `toymlx-train` with no recipe lists them."""


def get_recipe(name: str) -> ModuleType:
    """The recipe module for `name`, or a ValueError listing the known ones (and the closest,
    by spelling or as the start of one: `loraa`, `LoRA`, `vit`)."""
    if name not in RECIPES:
        key = str(name).lower()
        close = [r for r in RECIPES if len(key) >= 3 and r.startswith(key)] or \
            difflib.get_close_matches(key, RECIPES, n=1)
        raise ValueError(f"--recipe: expected one of {', '.join(RECIPES)}; found {name!r}"
                         + (f"; did you mean {close[0]}?" if close else ""))
    return importlib.import_module(RECIPES[name])
