"""Where specjax keeps what it can rebuild: ``$SPECJAX_CACHE`` (default ``~/.cache/specjax``)
holds the native CPU kernels it builds (``kernels/``) and JAX's persistent compilation cache
(``jax/``), so a rerun, a resumed job or a second command on the same shapes skips XLA's compile.
Plain ``os`` only: the CLI calls :func:`use_compilation_cache` before anything imports jax."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("SPECJAX_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "specjax"))


def use_compilation_cache() -> str | None:
    """Point JAX's persistent compilation cache at ``cache_root() / "jax"`` unless the user chose
    one (``JAX_COMPILATION_CACHE_DIR``) or turned it off (``SPECJAX_COMPILATION_CACHE=0``); returns
    the directory in use. Must run before jax is imported (jax reads the variable then)."""
    if os.environ.get("SPECJAX_COMPILATION_CACHE", "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    return os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(cache_root() / "jax"))
