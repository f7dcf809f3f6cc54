"""The byte progress bar of the bridge's long reads and writes (one home: checkpoint and device use it)."""

from __future__ import annotations

LARGE = 256 << 20  # with progress=None, a bar only for transfers of at least this many bytes


def byte_bar(total: int, desc: str, progress: bool | None):
    """A tqdm bar over ``total`` bytes (rate and ETA), or None: ``progress`` False, or None and the
    transfer is small."""
    if progress is False or (progress is None and total < LARGE):
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc)
