"""specjax: speculative decoding in JAX (a port of vllm-project/speculators).

Public entry points are imported lazily so ``import specjax`` stays cheap:
``specjax.generate(prompts, target="default", ...)`` and ``specjax.load_target(...)``.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_LAZY = {
    "generate": "specjax.decode.generate",
    "load_target": "specjax.models.loading",
    "load_draft": "specjax.models.drafts.load",
}


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'specjax' has no attribute {name!r}")
