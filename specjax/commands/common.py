"""Small helpers shared by the CLI command modules (printing, sizes, errors)."""

from __future__ import annotations

import re
import sys

import typer


def console(stderr: bool = False):
    from rich.console import Console

    return Console(stderr=stderr, highlight=False, soft_wrap=True)


def fail(err: BaseException, code: int = 2):
    """Print an error message (never a traceback) and exit."""
    from rich.markup import escape

    console(stderr=True).print(f"[red]error:[/red] {escape(str(err))}", markup=True)
    raise typer.Exit(code)


def human_bytes(n: int) -> str:
    x = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if x < 1024 or unit == "TiB":
            return f"{x:.0f} {unit}" if unit == "B" else f"{x:.1f} {unit}"
        x /= 1024
    return f"{n} B"


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B|B)?\s*", text, flags=re.I)
    if not m:
        raise typer.BadParameter(f"size {text!r}: expected e.g. 500MB, 5GB, 2GiB")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").upper()])
