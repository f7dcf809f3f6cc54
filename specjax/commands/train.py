"""`specjax train`: train a draft from a YAML recipe (Optax, cached target hidden states)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer

from specjax.commands.common import console, fail


def register(app: typer.Typer) -> None:
    app.command("train")(train_cmd)


def train_cmd(
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="recipe YAML (configs/*.yaml)"),
    set_: List[str] = typer.Option([], "--set", "-s", help="override: key=value (dotted key or a unique field name)"),
    resume: bool = typer.Option(False, "--resume", help="continue the run in trainer.output_dir from its last checkpoint"),
    overwrite: bool = typer.Option(False, "--overwrite", help="discard an existing run in trainer.output_dir"),
    print_config: bool = typer.Option(False, "--print-config", help="print the resolved recipe and exit"),
    as_json: bool = typer.Option(False, "--json", help="print the summary as one JSON object"),
):
    """Train an EAGLE-3 or DFlash draft; exports `last/` (and `best/`) as speculators checkpoints."""
    from bridge.errors import BridgeError
    from specjax.train.config import load_recipe
    from specjax.train.trainer import train

    try:
        cfg = load_recipe(config, set_)
        if print_config:
            print(cfg.to_yaml(), end="")
            return
        summary = train(cfg, resume=resume, overwrite=overwrite, progress=not as_json,
                        log=lambda m: console(stderr=True).print(m, style="dim"))
    except (BridgeError, ValueError) as e:
        fail(e, code=getattr(e, "exit_code", 2))
    if as_json:
        print(json.dumps(summary, default=str))
        return
    lm = summary.get("last_metrics", {})
    best = summary.get("best") or {}
    console().print(f"{summary['steps']} steps in {summary['seconds']}s; last loss {lm.get('loss')} "
                    f"(accept estimate {lm.get('accept_est')}); best val loss {best.get('val_loss')} at step "
                    f"{best.get('step')}; draft -> {summary.get('last')}")
