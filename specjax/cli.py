"""The `specjax` console script: thin typer front end over the library.

Each module in COMMAND_MODULES defines ``register(app)`` adding its subcommands; the
CLI holds no logic a notebook would need to copy.
"""

from __future__ import annotations

import importlib

import typer

app = typer.Typer(
    name="specjax",
    help="Speculative decoding in JAX: convert, audit, serve and train speculators drafts.",
    no_args_is_help=False,
    add_completion=False,
    pretty_exceptions_enable=False,
)

COMMAND_MODULES = [
    "specjax.commands.bridge_cmds",  # inspect, audit, convert
    "specjax.commands.generate",  # generate
]

for _mod in COMMAND_MODULES:
    importlib.import_module(_mod).register(app)


def main() -> None:  # pragma: no cover - console entry
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
