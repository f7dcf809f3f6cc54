"""`specjax train`: train a draft from a YAML recipe (Optax, cached target hidden states)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer

from specjax.commands.common import console, download_option, draft_dir, fail, fetch_target
from specjax.sharding import cli as shcli


def register(app: typer.Typer) -> None:
    app.command("train", help=train_help())(train_cmd)
    app.command("train-eval")(train_eval_cmd)


def train_cmd(
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="recipe YAML (configs/*.yaml)"),
    set_: List[str] = typer.Option([], "--set", "-s", help="override: key=value (dotted key or a unique field name)"),
    resume: bool = typer.Option(False, "--resume", help="continue the run in trainer.output_dir from its last checkpoint"),
    overwrite: bool = typer.Option(False, "--overwrite", help="discard an existing run in trainer.output_dir"),
    print_config: bool = typer.Option(False, "--print-config", help="print the resolved recipe and exit"),
    as_json: bool = typer.Option(False, "--json", help="print the summary as one JSON object"),
    log_to: str = typer.Option("jsonl", "--log-to", help="metric sinks, comma-separated: jsonl (always written), "
                               "tensorboard (<run>/tensorboard), wandb (when installed)"),
    mesh: str = shcli.mesh_option(),
    coordinator: Optional[str] = shcli.coordinator_option(),
    num_processes: Optional[int] = shcli.num_processes_option(),
    process_id: Optional[int] = shcli.process_id_option(),
):
    """Train a draft of any speculator_type ({algorithms}); exports `last/` (and `best/`) as
    speculators checkpoints.

    On a mesh of several devices the target loads straight into its shardings, the draft and
    optimizer state are placed by the partition rules, and each step takes data x fsdp packed
    rows (speculators' DDP order; the loss is the mean of the per-row losses)."""
    from bridge.errors import BridgeError
    from specjax.sharding import is_main_process
    from specjax.train.config import load_recipe
    from specjax.train.trainer import train

    try:
        cfg = load_recipe(config, set_)
        if print_config:
            print(cfg.to_yaml(), end="")
            return
        from specjax.train.metric_sinks import parse_log_to

        sinks = parse_log_to(log_to)
        dev_mesh = shcli.setup(mesh, coordinator, num_processes, process_id)  # before any JAX work
        # the run reads and checks the prompts (a recipe that builds its data) before the target loads
        summary = train(cfg, mesh=dev_mesh, resume=resume, overwrite=overwrite, progress=not as_json,
                        log=lambda m: console(stderr=True).print(m, style="dim"), log_to=sinks)
    except (BridgeError, ValueError) as e:
        fail(e, code=getattr(e, "exit_code", 2))
    if not is_main_process():
        return
    if as_json:
        print(json.dumps(summary, default=str))
        return
    lm = summary.get("last_metrics", {})
    best = summary.get("best") or {}
    console().print(f"{summary['steps']} steps in {summary['seconds']}s; last loss {lm.get('loss')} "
                    f"(accept estimate {lm.get('accept_est')}); best val loss {best.get('val_loss')} at step "
                    f"{best.get('step')}; draft -> {summary.get('last')}")


def train_help() -> str:
    """``train_cmd``'s docstring with the supported algorithms filled in (the one list of them)."""
    from specjax.train.algorithms import SPECULATOR_TYPES

    return train_cmd.__doc__.format(algorithms=", ".join(SPECULATOR_TYPES))


def train_eval_cmd(
    draft: str = typer.Option(..., "--draft", "-d", help="an EAGLE-3 speculators checkpoint directory or HF repo id"),
    target: str = typer.Option("default", "--target", "-t"),
    prompts: str = typer.Option("builtin:eval-code:32", "--prompts", "-p",
                                help="builtin:<set>[:<n>] or a JSONL prompt file (user turns, chat template)"),
    k: int = typer.Option(3, "--k", "-k", min=1),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", min=2),
    batch_size: int = typer.Option(16, "--batch-size", min=1),
    as_json: bool = typer.Option(False, "--json"),
    download: bool = download_option(),
):
    """Acceptance of an EAGLE-3 draft under greedy speculative decoding at k, computed exactly offline
    from the target's greedy continuations (tau = tokens per verify step, incl. the bonus token)."""
    from bridge.errors import BridgeError
    from specjax.models.drafts import load_draft
    from specjax.models.loading import load_target
    from specjax.train.evaluate import evaluate_acceptance
    from specjax.train.prompts import PretokenizedRow, resolve_prompts

    try:
        recs = resolve_prompts(prompts)  # checked before the target loads
        fetch_target(target, download=download)  # repo ids: into the local HF cache (only with --download)
        draft = draft_dir(draft, download=download)
        lt = load_target(target, progress=not as_json)
        model = load_draft(draft, lt.model)
        cfg = json.loads((Path(draft) / "config.json").read_text(encoding="utf-8"))
        ids = [r.input_ids for r in recs if isinstance(r, PretokenizedRow)] + [
            lt.tokenizer.apply_chat_template([t for t in r if t["role"] != "assistant"] or r,
                                             add_generation_prompt=True, tokenize=True)
            for r in recs if not isinstance(r, PretokenizedRow)]
        rep = evaluate_acceptance(model, lt, ids, aux_layer_ids=cfg["eagle_aux_hidden_state_layer_ids"], k=k,
                                  max_new_tokens=max_new_tokens, batch_size=batch_size, progress=not as_json)
    except (BridgeError, ValueError, KeyError) as e:
        fail(e, code=getattr(e, "exit_code", 2))
    d = rep.as_dict()
    if as_json:
        print(json.dumps(d))
    else:
        console().print(f"tau {d['tau']} at k={k} over {d['verify_steps']} verify steps ({d['generated_tokens']} "
                        f"tokens, {d['prompts']} prompts); P(accept >= i): {d['per_position']}")
