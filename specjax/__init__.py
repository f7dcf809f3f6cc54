"""specjax: speculative decoding in JAX (a port of vllm-project/speculators).

Public entry points are imported lazily so ``import specjax`` stays cheap:
``specjax.generate(prompts, target="default", ...)``, ``specjax.speculative_generate(prompts,
target=..., draft=...)``, ``specjax.load_target(...)`` and ``specjax.load_draft(...)``
(training: ``specjax.train.train(cfg)``).

Layers, lowest first; a module imports only from its own layer or lower ones (enforced by
``tests/test_layers.py``, which also refuses import cycles)::

    0  bridge/                     speculators format: json, safetensors, numpy (no specjax import)
    1  specjax.paths, placement,   where things live (local or a bucket), which platform a program
       processes, hub, storage     is built for, which process this is, hub ids
    2  specjax.kernels             native CPU kernels, Pallas TPU kernels
    3  specjax.models              Flax modules: layers, targets, drafts, their loaders
    4  specjax.sharding            meshes, partition rules, sharded loading
    5  specjax.decode              the jitted generate / speculative loops, bench
    6  specjax.train               data, hidden states, losses, the trainer, export
    7  specjax.plan                deviceless TPU compiles of the programs above
    8  specjax.commands, cli       the typer front end
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
