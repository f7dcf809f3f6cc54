"""Where a program's params live: :class:`Placement`, one device or a device mesh.

The one place the single-device and the sharded paths part: loaders and commands ask a
``Placement`` to load a target or a draft instead of writing ``if mesh: load sharded else load
plain`` themselves. (Which *code path* a traced program takes for its devices is
:mod:`specjax.placement`'s job; this class decides where the *params* go.)"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from jax.sharding import Mesh

from specjax.models.drafts.load import load_draft as load_draft_plain
from specjax.models.loading import LoadedTarget, load_target as load_target_plain
from specjax.sharding.load import load_draft as load_draft_sharded, load_target as load_target_sharded
from specjax.sharding.mesh import describe, make_mesh


@dataclass(frozen=True)
class Placement:
    """``mesh`` None: one device (the default one); a ``Mesh``: every parameter straight into its
    rule's sharding on it (``TARGET_RULES`` / ``DRAFT_RULES``)."""

    mesh: Mesh | None = None

    @classmethod
    def of(cls, mesh: Any = None) -> "Placement":
        """From what a user gives: None, a ``Mesh`` or a :func:`make_mesh` spec; a one-device mesh is
        the single-device placement (nothing to shard)."""
        if mesh is None:
            return cls()
        m = mesh if isinstance(mesh, Mesh) else make_mesh(mesh)
        return cls(m if m.size > 1 else None)

    @property
    def sharded(self) -> bool:
        return self.mesh is not None

    def describe(self) -> str:
        return describe(self.mesh) if self.sharded else "1 device (no mesh)"

    def load_target(self, target: str | os.PathLike | None = None, **kw) -> LoadedTarget:
        """``specjax.models.loading.load_target`` (one device) or ``specjax.sharding.load_target``
        (the mesh, slice by slice from the memory map); ``kw``: ``dtype``, ``cache_dir``, ``progress``."""
        if self.sharded:
            return load_target_sharded(target, self.mesh, **kw)
        return load_target_plain(target, **kw)

    def load_draft(self, path: str | os.PathLike, target: Any = None, **kw):
        """``specjax.models.drafts.load_draft`` (one device) or ``specjax.sharding.load_draft`` (the
        mesh); ``kw`` as those take (``dtype``, ``verifier_heads``, ``opened``, ``verifier_checked``)."""
        if self.sharded:
            return load_draft_sharded(path, target, self.mesh, **kw)
        return load_draft_plain(path, target, **kw)
