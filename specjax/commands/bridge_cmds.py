"""`specjax inspect | audit | convert`: the checkpoint bridge on the command line."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

from specjax.commands.common import console, fail, human_bytes, parse_size


def register(app: typer.Typer) -> None:
    app.command("inspect")(inspect_cmd)
    app.command("audit")(audit_cmd)
    app.command("convert")(convert_cmd)


def inspect_cmd(
    ckpt: Path = typer.Argument(..., help="speculators checkpoint directory"),
    as_json: bool = typer.Option(False, "--json", help="machine-readable output"),
):
    """Summarise a checkpoint from its config and safetensors header (no tensor data read)."""
    import bridge

    try:
        cfg = bridge.read_config(ckpt)
        store = bridge.open_tensors(ckpt)
    except bridge.BridgeError as e:
        fail(e, code=2)
    lc = cfg.layer
    infos = store.infos()
    summary = {
        "path": str(ckpt),
        "algorithm": cfg.speculators_model_type,
        "speculators_version": cfg.speculators_version,
        "verifier": cfg.speculators_config.verifier.name_or_path,
        "verifier_architectures": cfg.speculators_config.verifier.architectures,
        "speculative_tokens": cfg.speculative_tokens,
        "aux_layer_ids": cfg.aux_layer_ids,
        "draft_layers": lc.num_hidden_layers,
        "decoder_family": lc.model_type,
        "hidden_size": lc.hidden_size,
        "verifier_vocab_size": lc.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "files": [f.path for f in store.files],
        "tensors": {n: {"shape": list(i.shape), "dtype": i.dtype} for n, i in sorted(infos.items())},
        "total_bytes": store.total_bytes,
    }
    for k in ("block_size", "sample_from_anchor", "mask_token_id", "norm_before_residual", "norm_before_fc",
              "fc_norm", "norm_output", "markov_rank"):
        if k in type(cfg).model_fields:
            summary[k] = getattr(cfg, k)
    if as_json:
        print(json.dumps(summary, indent=2))
        return
    from rich.table import Table

    c = console()
    c.print(f"[bold]{ckpt}[/bold]: [cyan]{summary['algorithm']}[/cyan] draft "
            f"(speculators {summary['speculators_version']})")
    c.print(f"  verifier            {summary['verifier']} {summary['verifier_architectures']}")
    c.print(f"  speculative tokens  {summary['speculative_tokens']}")
    c.print(f"  aux layer ids       {summary['aux_layer_ids']}")
    c.print(f"  draft decoder       {lc.model_type}, {lc.num_hidden_layers} layer(s), hidden {lc.hidden_size}, "
            f"{lc.num_attention_heads} heads / {lc.kv_heads} kv, head_dim {lc.head_size}")
    c.print(f"  vocab               verifier {lc.vocab_size}, draft {cfg.draft_vocab_size}"
            + (" (pruned: t2d/d2t)" if cfg.vocab_pruned else ""))
    flags = {k: summary[k] for k in summary if k in ("block_size", "sample_from_anchor", "mask_token_id",
             "norm_before_residual", "norm_before_fc", "fc_norm", "norm_output", "markov_rank")}
    if flags:
        c.print("  flags               " + ", ".join(f"{k}={v}" for k, v in flags.items()))
    t = Table(title=f"{len(infos)} tensors, {human_bytes(summary['total_bytes'])}", show_lines=False)
    t.add_column("tensor")
    t.add_column("shape", justify="right")
    t.add_column("dtype")
    t.add_column("size", justify="right")
    for n, i in sorted(infos.items()):
        t.add_row(n, "x".join(map(str, i.shape)) or "scalar", i.dtype, human_bytes(i.nbytes))
    c.print(t)


def audit_cmd(
    ckpt: Path = typer.Argument(..., help="speculators checkpoint directory"),
    verifier: Optional[Path] = typer.Option(None, "--verifier", help="target model directory to check against"),
    deep: bool = typer.Option(False, "--deep", help="also scan tensor data for NaN / Inf"),
    as_json: bool = typer.Option(False, "--json", help="machine-readable report"),
):
    """Check the speculators format contract offline. Exit 0 clean, 1 errors, 2 unreadable."""
    import bridge

    rep = bridge.audit(ckpt, verifier=verifier, deep=deep)
    if as_json:
        print(json.dumps(rep.to_json(), indent=2))
        raise typer.Exit(rep.exit_code)
    c = console()
    if rep.unreadable:
        c.print(f"[red]unreadable[/red]: {rep.unreadable}")
        raise typer.Exit(2)
    for f in rep.errors:
        c.print(f"[red]error[/red]   [{f.rule}] {f.message}")
    for f in rep.warnings:
        c.print(f"[yellow]warning[/yellow] [{f.rule}] {f.message}")
    verdict = "[red]FAIL[/red]" if rep.errors else "[green]OK[/green]"
    c.print(f"{verdict} {ckpt} ({rep.algorithm}): {len(rep.errors)} error(s), {len(rep.warnings)} warning(s)")
    raise typer.Exit(rep.exit_code)


def convert_cmd(
    src: Path = typer.Argument(..., help="source checkpoint (speculators dir or specjax Orbax dir)"),
    dst: Path = typer.Argument(..., help="output directory (must not exist unless --overwrite)"),
    to: str = typer.Option(..., "--to", help="output format: orbax | speculators"),
    overwrite: bool = typer.Option(False, "--overwrite", help="replace an existing DST"),
    check: bool = typer.Option(False, "--check", help="reload the output and verify the round trip bit-exactly"),
    max_shard_size: Optional[str] = typer.Option(None, "--max-shard-size", help="e.g. 5GB: write sharded safetensors"),
    as_json: bool = typer.Option(False, "--json"),
):
    """Round-trip conversion between speculators checkpoints and Orbax (atomic writes)."""
    import bridge
    from bridge.roundtrip import convert

    try:
        res = convert(src, dst, to, overwrite=overwrite, check=check,
                      max_shard_bytes=parse_size(max_shard_size) if max_shard_size else None)
    except bridge.BridgeError as e:
        fail(e, code=getattr(e, "exit_code", 2))
    if as_json:
        print(json.dumps(res, indent=2))
        return
    c = console()
    c.print(f"wrote {res['format']} checkpoint {dst} ({res['tensors']} tensors) from {res['source_format']} {src}")
    if check:
        ch = res["check"]
        c.print(f"[green]check: bit-exact[/green] ({ch['tensors']} tensors, {human_bytes(ch['bytes'])}, config equal)")
