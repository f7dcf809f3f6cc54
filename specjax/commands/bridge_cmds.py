"""`specjax inspect | audit | convert`: the checkpoint bridge on the command line.

A checkpoint (and a ``--verifier``) may be a Hub repo id: resolved from the local HF cache, or
downloaded with ``--download`` / ``SPECJAX_ALLOW_DOWNLOAD=1`` (:mod:`specjax.hub`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

import bridge
from bridge.roundtrip import convert
from specjax.commands.common import console, download_option, fail, human_bytes, local_dir, output_dir, parse_size


def register(app: typer.Typer) -> None:
    app.command("inspect")(inspect_cmd)
    app.command("audit")(audit_cmd)
    app.command("convert")(convert_cmd)


def inspect_cmd(
    ckpt: str = typer.Argument(..., help="speculators checkpoint directory, bucket URL (gs://...) or Hub repo id"),
    as_json: bool = typer.Option(False, "--json", help="machine-readable output"),
    download: bool = download_option(),
):
    """Summarise a checkpoint from its config and safetensors header (no tensor data read)."""
    path = local_dir(ckpt, kind="checkpoint", download=download)
    try:
        summary = bridge.summarize(path)
    except bridge.BridgeError as e:
        fail(e, code=2)
    if as_json:
        print(json.dumps(summary, indent=2))
        return
    from rich.markup import escape
    from rich.table import Table

    s = summary
    c = console()
    where = str(ckpt) if str(path) == ckpt else f"{ckpt} ({path})"
    c.print(f"[bold]{escape(where)}[/bold]: [cyan]{s['algorithm']}[/cyan] draft (speculators {s['speculators_version']})")
    c.print(f"  verifier            {escape(str(s['verifier']))} {escape(str(s['verifier_architectures']))}")
    c.print(f"  speculative tokens  {s['speculative_tokens']}")
    c.print(f"  aux layer ids       {escape(str(s['aux_layer_ids']))}")
    c.print(f"  draft decoder       {s['decoder_family']}, {s['draft_layers']} layer(s), hidden {s['hidden_size']}, "
            f"{s['num_attention_heads']} heads / {s['num_key_value_heads']} kv, head_dim {s['head_dim']}")
    c.print(f"  vocab               verifier {s['verifier_vocab_size']}, draft {s['draft_vocab_size']}"
            + (" (pruned: t2d/d2t)" if s["vocab_pruned"] else ""))
    if s["flags"]:
        c.print("  flags               " + ", ".join(f"{k}={v}" for k, v in s["flags"].items()))
    t = Table(title=f"{len(s['tensors'])} tensors, {human_bytes(s['total_bytes'])}", show_lines=False)
    t.add_column("tensor")
    t.add_column("shape", justify="right")
    t.add_column("dtype")
    t.add_column("size", justify="right")
    for n, i in s["tensors"].items():
        t.add_row(n, "x".join(map(str, i["shape"])) or "scalar", i["dtype"], human_bytes(i["bytes"]))
    c.print(t)


def audit_cmd(
    ckpt: str = typer.Argument(..., help="speculators checkpoint directory, bucket URL (gs://...) or Hub repo id"),
    verifier: Optional[str] = typer.Option(None, "--verifier", help="target model directory (bucket URL or Hub "
                                                                    "repo id) to check against"),
    deep: bool = typer.Option(False, "--deep", help="also scan tensor data for NaN / Inf"),
    as_json: bool = typer.Option(False, "--json", help="machine-readable report"),
    download: bool = download_option(),
):
    """Check the speculators format contract offline. Exit 0 clean, 1 errors, 2 unreadable."""
    path = local_dir(ckpt, kind="checkpoint", download=download)
    if verifier is not None:
        verifier = local_dir(verifier, kind="verifier", download=download)
    rep = bridge.audit(path, verifier=verifier, deep=deep)
    if as_json:
        print(json.dumps(rep.to_json(), indent=2))
        raise typer.Exit(rep.exit_code)
    from rich.markup import escape

    c = console()
    if rep.unreadable:
        c.print(f"[red]unreadable[/red]: {escape(rep.unreadable)}")
        raise typer.Exit(2)
    from rich.markup import escape

    for f in rep.errors:
        c.print(f"[red]error[/red]   {escape(f'[{f.rule}]')} {escape(f.message)}")
    for f in rep.warnings:
        c.print(f"[yellow]warning[/yellow] {escape(f'[{f.rule}]')} {escape(f.message)}")
    verdict = "[red]FAIL[/red]" if rep.errors else "[green]OK[/green]"
    c.print(f"{verdict} {ckpt} ({rep.algorithm}): {len(rep.errors)} error(s), {len(rep.warnings)} warning(s)")
    raise typer.Exit(rep.exit_code)


def convert_cmd(
    src: str = typer.Argument(..., help="source checkpoint (speculators dir, specjax Orbax dir, or with --from a "
                                        "third-party draft; or a bucket URL or Hub repo id of one)"),
    dst: str = typer.Argument(..., help="output directory or bucket URL (must not exist unless --overwrite)"),
    to: Optional[str] = typer.Option(None, "--to", help="output format: orbax | speculators (with --from: speculators)"),
    from_: Optional[str] = typer.Option(None, "--from", help="third-party source: eagle3-safeailab | dflash-zlab | "
                                                            "mtp | auto (writes a speculators checkpoint)"),
    verifier: Optional[str] = typer.Option(None, "--verifier", help="with --from: the verifier (target) directory "
                                                                    "or Hub repo id"),
    norm_before_residual: Optional[bool] = typer.Option(
        None, "--norm-before-residual/--no-norm-before-residual",
        help="eagle3-safeailab: first-layer residual is the normed hidden (default off, as SafeAILab trains)"),
    norm_before_fc: Optional[bool] = typer.Option(None, "--norm-before-fc", help="eagle3-safeailab"),
    fc_norm: Optional[bool] = typer.Option(None, "--fc-norm", help="eagle3-safeailab (Eagle 3.1)"),
    norm_output: Optional[bool] = typer.Option(None, "--norm-output", help="eagle3-safeailab"),
    aux_layer_ids: Optional[str] = typer.Option(None, "--aux-layer-ids",
                                                help="e.g. 1,23,44: verifier layers the draft reads (eagle3/dflash)"),
    num_speculative_steps: Optional[int] = typer.Option(None, "--num-speculative-steps", help="mtp: default 3"),
    options: Optional[str] = typer.Option(None, "--options", "--algorithm-kwargs",
                                          help="with --from: more options as a JSON object (speculators' names)"),
    overwrite: bool = typer.Option(False, "--overwrite", help="replace an existing DST"),
    check: bool = typer.Option(False, "--check", help="reload the output and verify the round trip bit-exactly "
                                                     "before DST is put in place (mismatch: exit 1, nothing written)"),
    max_shard_size: Optional[str] = typer.Option(None, "--max-shard-size", help="e.g. 5GB: write sharded safetensors"),
    as_json: bool = typer.Option(False, "--json"),
    download: bool = download_option(),
):
    """Round-trip conversion between speculators checkpoints and Orbax (--to), or a third-party
    draft into a speculators checkpoint (--from, audited before it is written). Atomic writes."""
    c = console()
    shard = parse_size(max_shard_size) if max_shard_size else None
    given = _converter_options(norm_before_residual=norm_before_residual, norm_before_fc=norm_before_fc,
                               fc_norm=fc_norm, norm_output=norm_output, num_speculative_steps=num_speculative_steps,
                               aux_layer_ids=aux_layer_ids, options=options)
    if from_ is None:
        if given or verifier is not None:
            raise typer.BadParameter("--verifier and the converter options apply only with --from")
        if to is None:
            raise typer.BadParameter("give --to orbax|speculators (round trip) or --from KIND (third-party draft)")
        _convert_round_trip(c, src, dst, to, overwrite=overwrite, check=check, shard=shard, as_json=as_json,
                            download=download)
        return
    if to not in (None, "speculators"):
        raise typer.BadParameter(f"--from writes a speculators checkpoint; --to {to} does not apply")
    if check:
        raise typer.BadParameter("--check verifies --to round trips; --from conversions are audited automatically")
    _convert_external(c, src, from_, verifier, dst, given, overwrite=overwrite, shard=shard, as_json=as_json,
                      download=download)


def _converter_options(*, norm_before_residual, norm_before_fc, fc_norm, norm_output, num_speculative_steps,
                       aux_layer_ids: Optional[str], options: Optional[str]) -> dict:
    """The --from converter options the caller gave: the flags that are set, --aux-layer-ids as
    integers, and the --options JSON object on top."""
    given = {k: v for k, v in (("norm_before_residual", norm_before_residual), ("norm_before_fc", norm_before_fc),
                               ("fc_norm", fc_norm), ("norm_output", norm_output),
                               ("num_speculative_steps", num_speculative_steps)) if v is not None}
    if aux_layer_ids is not None:
        try:
            given["aux_layer_ids"] = [int(x) for x in aux_layer_ids.replace(" ", "").strip("[]").split(",") if x]
        except ValueError:
            raise typer.BadParameter(f"--aux-layer-ids {aux_layer_ids!r}: expected integers like 1,23,44")
    if options:
        try:
            extra = json.loads(options)
        except ValueError as e:
            raise typer.BadParameter(f"--options is not JSON: {e}")
        if not isinstance(extra, dict):
            raise typer.BadParameter(f"--options must be a JSON object, not {type(extra).__name__}")
        given.update(extra)
    return given


def _convert_round_trip(c, src: Path, dst: Path, to: str, *, overwrite: bool, check: bool, shard, as_json: bool,
                        download: bool) -> None:
    """--to: a speculators checkpoint to Orbax or back, optionally reloaded and compared bit-exactly."""
    src = local_dir(src, kind="checkpoint", download=download)  # after the arguments are checked
    try:
        with output_dir(dst, overwrite=overwrite) as out:
            res = convert(src, out, to, overwrite=overwrite, check=check, max_shard_bytes=shard)
        res["output"] = str(dst)
    except bridge.BridgeError as e:
        fail(e, code=getattr(e, "exit_code", 2))
    if as_json:
        print(json.dumps(res, indent=2))
        return
    c.print(f"wrote {res['format']} checkpoint {dst} ({res['tensors']} tensors) from {res['source_format']} {src}")
    if check:
        ch = res["check"]
        c.print(f"[green]check: bit-exact[/green] ({ch['tensors']} tensors, {human_bytes(ch['bytes'])}, config equal)")


def _convert_external(c, src: Path, from_: str, verifier: Optional[str], dst: Path, given: dict, *, overwrite: bool,
                      shard, as_json: bool, download: bool) -> None:
    """--from: a third-party draft into an audited speculators checkpoint, with what was detected,
    the options used, the converter's notes and the audit's warnings."""
    src = local_dir(src, kind="checkpoint", download=download)  # after the arguments are checked
    if verifier is not None:
        verifier = str(local_dir(verifier, kind="verifier", download=download))
    try:
        with output_dir(dst, overwrite=overwrite) as out:
            res = bridge.convert_external(str(src), from_, verifier, out, overwrite=overwrite, max_shard_bytes=shard,
                                          **given)
    except bridge.BridgeError as e:
        from rich.markup import escape  # audit rule names look like markup tags: [aux_ids.range]

        fail(escape(str(e)), code=getattr(e, "exit_code", 2))
    if as_json:
        print(json.dumps(res.to_json(), indent=2))
        return
    from rich.markup import escape

    if res.detected:
        c.print(f"detected [cyan]{res.source_kind}[/cyan]: {escape(res.detected)}")
    c.print(f"wrote speculators [cyan]{res.algorithm}[/cyan] checkpoint {dst} ({len(res.tensors)} tensors) from "
            f"{res.source_kind} {src}")
    c.print("  options: " + escape(", ".join(f"{k}={v}" for k, v in res.options.items())))
    for n in res.notes:
        c.print(f"  note: {escape(n)}")
    if res.report is not None:
        c.print(f"  audit: [green]OK[/green], {len(res.report.warnings)} warning(s)")
        for f in res.report.warnings:
            c.print(f"  [yellow]warning[/yellow] {escape(f'[{f.rule}] {f.message}')}")
