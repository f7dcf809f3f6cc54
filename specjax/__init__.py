"""specjax: speculative decoding in JAX (a port of vllm-project/speculators).

Public entry points are imported lazily so ``import specjax`` stays cheap:
``specjax.generate(prompts, target="default", ...)``, ``specjax.speculative_generate(prompts,
target=..., draft=...)``, ``specjax.load_target(...)`` and ``specjax.load_draft(...)``
(training: ``specjax.train.train(cfg)``).
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_LAZY = {
    "generate": "specjax.decode.generate",
    "load_target": "specjax.models.loading",
    "load_draft": "specjax.models.drafts.load",
    "speculative_generate": "specjax.decode.speculative",
}


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'specjax' has no attribute {name!r}")
