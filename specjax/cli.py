"""The `specjax` console script: thin typer front end over the library.

Each module in COMMAND_MODULES defines ``register(app)`` adding its subcommands; the
CLI holds no logic a notebook would need to copy.
"""

from __future__ import annotations

import importlib

from specjax.paths import use_compilation_cache

use_compilation_cache()  # before any command module can import jax

import typer  # noqa: E402

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
    "specjax.commands.bench",  # bench (target-only vs speculative)
    "specjax.commands.train",  # train
    "specjax.commands.data",  # data prepare / extract / vocab / prompts / inspect
    "specjax.commands.plan",  # plan (deviceless TPU compile of a recipe's programs)
]

for _mod in COMMAND_MODULES:
    importlib.import_module(_mod).register(app)

DEMO_PROMPTS = (
    "Write a Python function that returns the n-th Fibonacci number.",
    "Explain in two sentences what a hash table is.",
)


def version() -> str:
    """The installed distribution's version, else ``specjax.__version__`` (a source checkout)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("specjax")
    except PackageNotFoundError:
        import specjax

        return specjax.__version__


def _print_version(value: bool) -> None:
    if value:
        print(f"specjax {version()}")
        raise typer.Exit()


@app.callback(invoke_without_command=True)
def _default(ctx: typer.Context,
             show_version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                               help="print `specjax <version>` and exit")):
    """With no subcommand, run on the embedded default model (SmolLM2-135M-Instruct)."""
    from specjax import placement

    try:
        placement.scan_env()  # a bad SPECJAX_SCAN_LAYERS is a message now, not a traceback mid-run
    except ValueError as e:
        from specjax.commands.common import fail

        fail(e)
    if ctx.invoked_subcommand is not None:
        return
    from specjax.commands.common import console
    from specjax.decode.generate import generate

    c = console()
    c.print("[bold]specjax[/bold] on the embedded default model (SmolLM2-135M-Instruct); "
            "`specjax --help` lists the commands.")
    for prompt, comp in zip(DEMO_PROMPTS, generate(list(DEMO_PROMPTS), target=None, chat=True, max_new_tokens=64)):
        c.print(f"\n[cyan]> {prompt}[/cyan]\n{comp.text}")


def main() -> None:
    """The console entry: a module missing from this environment (a broken or partial install) is a
    message naming it and the environment, not a traceback."""
    try:
        app()
    except ModuleNotFoundError as e:
        import sys

        name = (e.name or str(e)).split(".")[0]
        if name in ("specjax", "bridge"):  # our own module: a bug, not an install problem
            raise
        print(f"error: the Python package {name!r} is missing from this environment ({sys.prefix}); specjax needs "
              f"it. Reinstall specjax there (`pip install specjax`, or `bash scripts/setup.sh run` in a checkout); "
              f"optional features name their extra ({e})", file=sys.stderr)
        raise SystemExit(1) from None


if __name__ == "__main__":  # pragma: no cover
    main()
