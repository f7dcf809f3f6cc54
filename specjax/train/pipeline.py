"""``specjax data prepare``: prompts -> (target-regenerated) chat rows with assistant-only loss
masks -> hidden states -> token frequencies and t2d/d2t, all in one data directory in
speculators' layout (see :mod:`specjax.train.dataset`).

Two paths:

* ``regenerate=True`` (self-distillation, the default recipe): every assistant turn is written
  by the target (system/user turns drive it, original assistant turns are dropped, as
  speculators' ``regenerate-responses``), batched, and the hidden states of each row are
  captured in the same forwards (:mod:`specjax.train.selfdistill`). Each (conversation, turn)
  lands in ``hidden_states/.staging/c{conv}_t{turn}.safetensors`` as soon as its batch is done,
  so a killed run resumes where it stopped.
* ``regenerate=False``: the given conversations are rendered (speculators' render-boundary
  masks, :mod:`specjax.train.render`) and the hidden states extracted afterwards
  (:func:`specjax.train.hidden_states.extract_hidden_states`, resumable per row).
* ``regenerate="unanswered"``: both in one directory. Conversations with no assistant turn are
  regenerated, the others rendered as given (a mix of prompt-only and answered sources, such as
  ``builtin:stdlib`` and ``builtin:stdlib-source``); rows of both kinds are shuffled together.

``compute_dtype="bfloat16"`` runs the target's matmuls in bf16 with float32 sums on both paths
(regeneration and extraction), where the CPU kernels apply.

The prompts are read and every record validated (:func:`specjax.train.prompts.read_prompts`:
``max_samples`` and ``shuffle_seed`` choose which) before anything is written: a bad input leaves no
directory behind. :func:`spec_prompts` / :func:`recipe_prompts` run that check on their own, so a
command can fail on a bad input before it loads the target.

Rows are shuffled with ``seed`` (numpy ``default_rng(seed).permutation``, what ``datasets``'
``shuffle`` uses) and ``hs_{i}`` is row ``i`` of the final order. ``specjax_data.json`` is
written last and marks the directory complete.

A bucket URL (``gs://b/data``) is built in its local cache directory
(:func:`specjax.storage.cache_dir`, where an interrupted build resumes) and then published with
``state.json`` and ``specjax_data.json`` uploaded last; training stages it back in
(:func:`local_data_dir`: files already there with the remote size are not fetched again).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import jax.numpy as jnp
import numpy as np

import specjax.sharding as shd
from bridge.atomic import atomic_file
from specjax import storage
from specjax.train import dataset as ds
from specjax.train.errors import DatasetError
from specjax.train.hidden_states import (
    DTYPES, HS_DIR, cache_layer_ids, default_aux_layer_ids, extract_hidden_states, hs_path, is_complete, read_hs,
    write_hs,
)
from specjax.train.prompts import Conversation, PretokenizedRow, Record, resolve_prompts, write_prompt_file
from specjax.train.render import BoundaryUnstableError, conversation_rows, render_ids
from specjax.train.vocab import (
    TOKEN_FREQ_NAME, build_vocab_mapping, save_token_freq, save_vocab_mapping, token_frequencies,
)

FORMAT = "specjax-data-v1"
STAGING = ".staging"
UNANSWERED = "unanswered"  # DataSpec.regenerate: regenerate only the conversations with no assistant turn
MARKERS = ("state.json", ds.META_NAME)  # a remote data directory's files that say "complete", uploaded last


@dataclass
class DataSpec:
    prompts: str | list[str] = "builtin:stdlib"  # a list: read in order and concatenated
    regenerate: bool | str = True  # True | False | "unanswered" (module docstring)
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seq_length: int = 2048
    minimum_valid_tokens: int | None = None
    aux_layer_ids: list[int] | None = None
    hidden_states_dtype: str = "bfloat16"
    batch_size: int = 32
    max_prompt_tokens: int = 512
    max_batch_tokens: int = 4096
    draft_vocab_size: int | None = None
    seed: int = 0
    max_samples: int | None = None  # use the first N prompt records (after the shuffle below)
    shuffle_seed: int | None = None  # shuffle the prompt records first (datasets' Dataset.shuffle order)
    # False: no hidden-state cache (a recipe with data.online: true); regenerated rows keep their
    # token ids and text in hs_{i} files with empty states
    hidden_states: bool = True
    compute_dtype: str = "float32"  # the target's matmuls while regenerating (selfdistill) and extracting
    extra: dict = field(default_factory=dict)


def spec_prompts(spec) -> list[Conversation | PretokenizedRow]:
    """The prompt records a :class:`DataSpec` (or a recipe's ``data.prepare``, same fields) builds
    from, read and validated (no model needed): raises
    :class:`~specjax.train.errors.PromptFileError` naming the file and record on a bad input."""
    return resolve_prompts(spec.prompts, seed=spec.seed, max_samples=spec.max_samples,
                           shuffle_seed=spec.shuffle_seed)


def needs_prepare(cfg) -> bool:
    """Whether ``specjax train`` builds the recipe's ``data.path`` first (it has no rows yet)."""
    return not (storage.path(cfg.data.path) / "state.json").is_file()


def recipe_prompts(cfg) -> list[Conversation | PretokenizedRow]:
    """A recipe's prompt records (its ``data.prepare``), read and validated: what ``specjax train``
    and ``data prepare --config`` check before they load the target."""
    if cfg.data.prepare is None:
        raise DatasetError("the recipe has no data.prepare section: it cannot build its data; give data.prepare or "
                           "run `specjax data prepare` with explicit options", key="data.prepare")
    return spec_prompts(cfg.data.prepare)


def recipe_data_spec(cfg, num_hidden_layers: int) -> DataSpec:
    """The :class:`DataSpec` a training recipe (``TrainConfig``) builds ``data.path`` with: its
    ``data.prepare`` settings, the draft's aux layer ids (default [2, n//2, n-3]), the cache dtype
    and the draft vocabulary size. ``specjax train`` and ``specjax data prepare --config`` both use it,
    so a directory prepared by either is the one the other expects."""
    if cfg.data.prepare is None:
        raise DatasetError("the recipe has no data.prepare section: it cannot build its data; give data.prepare or "
                           "run `specjax data prepare` with explicit options", key="data.prepare")
    aux = list(cfg.draft.target_layer_ids) if cfg.draft.target_layer_ids else default_aux_layer_ids(num_hidden_layers)
    return DataSpec(**cfg.data.prepare.model_dump(), aux_layer_ids=aux, hidden_states_dtype=cfg.data.hidden_states_dtype,
                    draft_vocab_size=cfg.draft.draft_vocab_size, hidden_states=not cfg.data.online)


def _user_turn_ends(conv: Conversation) -> list[int]:
    """Indices just past each user turn in the conversation with assistant turns removed."""
    kept = [t for t in conv if t["role"] != "assistant"]
    return kept, [k + 1 for k, t in enumerate(kept) if t["role"] == "user"]


def _staging(data_dir: Path, c: int, t: int) -> Path:
    return data_dir / HS_DIR / STAGING / f"c{c}_t{t}.safetensors"


def _generate_round(lt, todo: list[int], prompts: list[list[int]], r: int, n_rounds: int, data_dir: Path,
                    spec: DataSpec, sampling, layer_ids, progress):
    """One round's batched generation; each answer's row and hidden states go to its staging file as its batch ends."""
    from specjax.train import selfdistill  # flax, the target and the generate loop: only when answers are written

    tok = lt.tokenizer
    meta_base = {"layer_ids": ",".join(map(str, layer_ids)), "target": str(lt.source), "format": "pt"}
    eos = lt.eos_token_ids
    pad = tok.pad_token_id if tok.pad_token_id is not None else (eos[0] if eos else 0)

    taps = tuple(layer_ids) if spec.hidden_states else ()
    spec_dtype = DTYPES[spec.hidden_states_dtype]

    def on_batch(idx, res):
        for k, g in zip(idx, res):
            c = todo[k]
            text = tok.decode(g.token_ids, skip_special_tokens=True)
            row = (g.prompt_ids + g.token_ids)[: spec.seq_length]
            # without a state cache (data.online) the staged file holds the row and its text only
            hs = g.hidden_states[: len(row)] if taps else np.zeros((len(row), 0, 0), spec_dtype)
            m = dict(meta_base, prompt_len=str(len(g.prompt_ids)), text=text, stop=g.stop_reason)
            write_hs(_staging(data_dir, c, r), hs, np.asarray(row, np.int64), metadata=m)

    return selfdistill.generate_with_hidden_states(
        lt.model, prompts, max_new_tokens=spec.max_new_tokens, taps=taps, sampling=sampling,
        seed=spec.seed + r, eos_token_ids=eos, pad_id=pad, batch_size=spec.batch_size,
        out_dtype=jnp.dtype(DTYPES[spec.hidden_states_dtype]), max_prompt_len=max(len(p) for p in prompts),
        progress=progress, on_batch=on_batch, desc=f"regenerating (turn {r + 1})" if n_rounds > 1 else "regenerating",
        compute=spec.compute_dtype)


def _regenerate(lt, convs: list[Conversation], data_dir: Path, spec: DataSpec, layer_ids, log, progress):
    """Regenerate assistant turns round by round; returns ``[(conv, turn, staging_path)]`` in
    (conversation, turn) order and the regenerated conversations."""
    from specjax.decode.sampling import SamplingParams  # imports flax (via specjax.models): only when regenerating

    tok = lt.tokenizer
    base, ends = [], []
    for c in convs:
        kept, e = _user_turn_ends(c)
        base.append(kept)
        ends.append(e)
    histories: list[list[dict]] = [[] for _ in convs]  # regenerated conversation so far
    cursor = [0] * len(convs)  # how much of base[c] is in histories[c]
    out: list[tuple[int, int, Path]] = []
    sampling = SamplingParams(temperature=spec.temperature, top_k=spec.top_k, top_p=spec.top_p)
    n_rounds = max((len(e) for e in ends), default=0)
    skipped_long = 0
    for r in range(n_rounds):
        todo, prompts = [], []
        for c in range(len(convs)):
            if r >= len(ends[c]):
                continue
            histories[c] = histories[c] + base[c][cursor[c]: ends[c][r]]
            cursor[c] = ends[c][r]
            sp = _staging(data_dir, c, r)
            if is_complete(sp):
                rec = read_hs(sp)
                histories[c].append({"role": "assistant", "content": rec.metadata.get("text", "")})
                out.append((c, r, sp))
                continue
            ids = render_ids(tok, histories[c], add_generation_prompt=True)
            if len(ids) > spec.max_prompt_tokens or len(ids) >= spec.seq_length:
                skipped_long += 1
                ends[c] = ends[c][:r]  # later turns of this conversation are dropped too
                continue
            todo.append(c)
            prompts.append(ids)
        if not todo:
            continue
        res = _generate_round(lt, todo, prompts, r, n_rounds, data_dir, spec, sampling, layer_ids, progress)
        for k, g in enumerate(res):
            c = todo[k]
            histories[c].append({"role": "assistant", "content": tok.decode(g.token_ids, skip_special_tokens=True)})
            out.append((c, r, _staging(data_dir, c, r)))
    if skipped_long and log:
        log(f"skipped {skipped_long} turn(s) whose prompt exceeds {min(spec.max_prompt_tokens, spec.seq_length)} tokens")
    out.sort(key=lambda x: (x[0], x[1]))
    return out, histories


def _answered(conv: Conversation) -> bool:
    return any(t["role"] == "assistant" for t in conv)


def _check_inputs(out_dir, spec: DataSpec, lt, records: list[Record] | None):
    """The refusals before the directory is touched; returns the records, the aux and the cached layer ids."""
    if spec.regenerate not in (True, False, UNANSWERED):
        raise DatasetError(f"regenerate is {spec.regenerate!r}; expected true, false or {UNANSWERED!r}",
                           key="regenerate", path=str(out_dir))
    if spec.regenerate and shd.process_count() > 1:
        raise DatasetError(f"regenerating answers runs in one process; this run has {shd.process_count()} "
                           "processes. Run `specjax data prepare` on one host (it uses all local devices), or "
                           "prepare without regeneration (extraction is split over every process)",
                           key="regenerate", path=str(out_dir))
    d = Path(out_dir)
    meta = ds.read_meta(d)
    if meta.get("complete"):
        raise DatasetError("this data directory is already complete; use another --out (or delete it)", path=str(d))
    records = spec_prompts(spec) if records is None else records
    cfg = lt.config
    if lt.tokenizer is None:
        raise DatasetError("the target has no tokenizer; chat rendering needs one", key="target")
    n = cfg.num_hidden_layers
    aux = list(spec.aux_layer_ids) if spec.aux_layer_ids else default_aux_layer_ids(n)
    layer_ids = cache_layer_ids(aux, n)
    if spec.draft_vocab_size is not None and spec.draft_vocab_size > cfg.vocab_size:
        raise DatasetError(f"draft_vocab_size {spec.draft_vocab_size} is larger than the target vocabulary "
                           f"({cfg.vocab_size})", key="draft_vocab_size")
    return records, aux, layer_ids


def _check_resume(d: Path, spec_doc: dict, main: bool) -> None:
    """Whether a partial build here has these settings (refused if not); a fresh build writes the guard file."""
    spec_p = d / "prepare_spec.json"
    if spec_p.is_file():
        old = json.loads(spec_p.read_text(encoding="utf-8"))
        old["spec"] = {**asdict(DataSpec()), **old.get("spec", {})}  # fields added since keep their defaults
        if old != spec_doc:
            diff = sorted(k for k in set(old["spec"]) | set(spec_doc["spec"])
                          if old["spec"].get(k) != spec_doc["spec"].get(k))
            raise DatasetError(f"a partial build with other settings is here (differs in {diff or ['target']}); "
                               "resume with the same settings or use another --out", path=str(d))
    elif main:
        with atomic_file(spec_p, text=True) as f:
            f.write(json.dumps(spec_doc, indent=2, sort_keys=True))


def _row_sources(lt, convs: list[Conversation], pretok: list[PretokenizedRow], d: Path, spec: DataSpec, layer_ids,
                 log, progress) -> tuple[list[tuple[str, object]], list[Conversation]]:
    """Where each row comes from (a staged regenerated turn, a rendered or pretokenized row)."""
    sources: list[tuple[str, object]] = []
    if spec.regenerate == UNANSWERED:
        ask, given = [c for c in convs if not _answered(c)], [c for c in convs if _answered(c)]
    else:
        ask, given = (convs, []) if spec.regenerate else ([], convs)
    regenerated = convs
    if ask:
        staged, regenerated = _regenerate(lt, ask, d, spec, layer_ids, log, progress)
        sources += [("staged", p) for _, _, p in staged]
        regenerated = regenerated + given
    for k, c in enumerate(given):
        try:
            rows = conversation_rows(lt.tokenizer, c, max_length=spec.seq_length,
                                     minimum_valid_tokens=spec.minimum_valid_tokens)
        except BoundaryUnstableError as e:
            if log:
                log(f"conversation {k}: {e}; skipped")
            continue
        sources += [("row", r) for r in rows]
    for r in pretok:
        ids, mask = r.input_ids[: spec.seq_length], r.loss_mask[: spec.seq_length]
        if sum(mask) > 0:
            sources.append(("row", (ids, mask)))
    if not sources:
        raise DatasetError("no training rows: every prompt was empty, unsupervised or too long", key="prompts")
    return sources, regenerated


def _assemble_rows(d: Path, sources: list[tuple[str, object]], perm) -> ds.TokenRows:
    """The rows in the final order ``perm``; staged hidden-state files become ``hs_{i}`` once all are read."""
    rows = ds.TokenRows()
    moves = []
    for i, j in enumerate(perm):
        kind, src = sources[int(j)]
        if kind == "staged":
            final = hs_path(d, i)
            if src.is_file():
                rec = read_hs(src)
                moves.append((src, final))
            else:  # moved by an earlier, interrupted assembly
                rec = read_hs(final)
            ids = np.asarray(rec.token_ids)
            plen = int(rec.metadata.get("prompt_len", "0"))
            mask = np.zeros(len(ids), np.int64)
            mask[plen:] = 1
            rows.append(ids, mask)
        else:
            rows.append(*src)
    for src, dst in moves:
        os.replace(src, dst)
    return rows


def _write_vocab(d: Path, rows: ds.TokenRows, spec: DataSpec, vocab_size: int, main: bool) -> dict:
    """The supervised-token frequencies (written) and, with a draft vocabulary size, t2d/d2t."""
    freq = token_frequencies(rows)
    if main:
        save_token_freq(d / TOKEN_FREQ_NAME, freq)
        if spec.draft_vocab_size is not None:
            save_vocab_mapping(d, *build_vocab_mapping(freq, spec.draft_vocab_size, vocab_size))
    return freq


def prepare_data(out_dir: str | os.PathLike, spec: DataSpec, target, *, progress: bool = True,
                 log: Callable[[str], None] | None = None, records: list[Record] | None = None) -> dict:
    """Build (or resume building) a data directory. ``target``: a ``LoadedTarget``; ``records``:
    the prompt records when the caller has read them already (:func:`spec_prompts`), else they
    are read here, before the directory is created.

    Multi-process runs (``jax.distributed``): hidden-state extraction is split over every process's
    devices and process 0 alone writes files; regenerating answers is refused there (it runs on one
    host, over all of that host's devices): prepare on one host, then train multi-host."""
    if storage.is_remote(out_dir):
        return _prepare_remote(out_dir, spec, target, progress=progress, log=log, records=records)
    t0 = time.perf_counter()
    main = shd.is_main_process()
    records, aux, layer_ids = _check_inputs(out_dir, spec, target, records)
    d, lt = Path(out_dir), target
    cfg = lt.config
    if main:
        d.mkdir(parents=True, exist_ok=True)
    shd.sync("specjax-prepare-dir")
    convs = [r for r in records if not isinstance(r, PretokenizedRow)]
    pretok = [r for r in records if isinstance(r, PretokenizedRow)]
    # a spec file guards against resuming with other settings
    _check_resume(d, {"spec": asdict(spec), "target": str(lt.source), "layer_ids": layer_ids}, main)
    sources, regenerated = _row_sources(lt, convs, pretok, d, spec, layer_ids, log, progress)
    perm = np.random.default_rng(spec.seed).permutation(len(sources))
    rows = _assemble_rows(d, sources, perm)
    if main:
        ds.write_rows(d, rows)
    if regenerated is not convs:
        write_prompt_file(d / "conversations.jsonl", regenerated)
    plain = [i for i, j in enumerate(perm) if sources[int(j)][0] == "row"]
    ext = None
    if plain and spec.hidden_states:
        ext = extract_hidden_states(lt.model, rows, d, aux_layer_ids=aux, dtype=spec.hidden_states_dtype,
                                    max_batch_tokens=spec.max_batch_tokens, indices=plain, progress=progress,
                                    target_name=str(lt.source), log=log, compute=spec.compute_dtype)
    freq = _write_vocab(d, rows, spec, cfg.vocab_size, main)
    staging = d / HS_DIR / STAGING
    if main and staging.is_dir() and not any(staging.iterdir()):
        staging.rmdir()
    out = {
        "format": FORMAT, "complete": True, "target": str(lt.source), "target_kind": lt.kind,
        "num_hidden_layers": cfg.num_hidden_layers, "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size,
        "aux_layer_ids": aux, "layer_ids": layer_ids, "hidden_states_dtype": spec.hidden_states_dtype,
        "hidden_states": spec.hidden_states, "rows": len(rows), "tokens": int(rows.lengths.sum()), "supervised_tokens": rows.supervised_tokens(),
        "distinct_supervised_tokens": len(freq), "prompts": spec.prompts, "regenerate": spec.regenerate,
        "seconds": round(time.perf_counter() - t0, 2), "spec": asdict(spec),
    }
    if ext:
        out["extraction"] = {k: v for k, v in ext.items() if k != "layer_ids"}
    if main:
        ds.write_meta(d, out)
    shd.sync("specjax-prepare-done")
    return out


def _prepare_remote(url: str, spec: DataSpec, target, *, progress: bool, log, records) -> dict:
    """:func:`prepare_data` for a bucket URL: built (or resumed) in its local cache directory, then
    published (process 0) with the markers last. A finished local build whose upload did not
    finish is uploaded again, if it has these settings."""
    if ds.read_meta(url).get("complete"):
        raise DatasetError("this data directory is already complete; use another --out (or delete it)", path=url)
    local = storage.cache_dir(url)
    meta = ds.read_meta(local)
    if not meta.get("complete"):
        meta = prepare_data(local, spec, target, progress=progress, log=log, records=records)
    elif meta.get("spec") != json.loads(json.dumps(asdict(spec))) or meta.get("target") != str(target.source):
        raise DatasetError(f"{local} holds a finished build for this URL with other settings (an upload that did "
                           "not finish, or the copy of a deleted directory); delete it or prepare with the same "
                           "settings", path=url)
    elif log:
        log(f"{local} is a finished build for {url}: uploading it")
    if shd.is_main_process():
        storage.publish(local, url, markers=MARKERS, overwrite=True, progress=progress)
    shd.sync("specjax-prepare-upload")
    return meta


def local_data_dir(path, *, progress: bool = True) -> Path:
    """A data directory to read: a local one as it is, a bucket URL's staged into its cache directory."""
    return storage.stage_in(path, markers=MARKERS, progress=progress)


@contextlib.contextmanager
def updating_data_dir(path, *, progress: bool = True):
    """A data directory to add files to (hidden states, vocabulary maps): a local one as it is; a
    bucket URL's staged copy, whose new and changed files are uploaded when the block ends
    without an error (process 0; the markers last: :func:`specjax.storage.push_changed`)."""
    if not storage.is_remote(path):
        yield Path(path)
        return
    local = local_data_dir(path, progress=progress)
    before = storage.signatures(local)
    yield local
    if shd.is_main_process():
        storage.push_changed(local, path, before, markers=MARKERS, progress=progress)


def load_data_dir(path: str | os.PathLike) -> tuple[ds.TokenRows, dict]:
    """Rows + metadata of a data directory (ours or speculators'; the latter has no metadata)."""
    d = Path(path)
    rows = ds.read_rows(d)
    meta = ds.read_meta(d)
    if meta and not meta.get("complete"):
        raise DatasetError("the data directory is incomplete (a `specjax data prepare` was interrupted); run it "
                           "again to finish", path=str(d))
    return rows, meta
