"""Execute a notebook top to bottom with nbclient on this interpreter and collect its RESULT lines.

Notebook cells print machine-readable lines ``RESULT key=value [key=value ...]``; :func:`run_notebook`
returns them as a dict (later lines win) together with the executed notebook and per-cell times.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "notebooks"
KERNEL = "specjax-nbtest"
RESULT_LINE = re.compile(r"^RESULT (.+)$", re.M)


@dataclass
class Executed:
    path: Path
    seconds: float
    results: dict[str, str]
    cell_seconds: list[float] = field(default_factory=list)
    text: str = ""
    notebook: object = None  # the executed nbformat notebook (outputs included)

    def images(self) -> list[bytes]:
        """PNG images the notebook displayed (last version of each updated display)."""
        import base64

        out = []
        for cell in self.notebook.cells if self.notebook is not None else []:
            for o in cell.get("outputs", []):
                png = o.get("data", {}).get("image/png")
                if png:
                    out.append(base64.b64decode(png))
        return out

    def num(self, key: str) -> float:
        assert key in self.results, f"{self.path.name} printed no RESULT {key}=...; got {sorted(self.results)}"
        return float(self.results[key])

    def flag(self, key: str) -> bool:
        assert key in self.results, f"{self.path.name} printed no RESULT {key}=...; got {sorted(self.results)}"
        return self.results[key] == "True"

    def series(self, key: str) -> list[float]:
        assert key in self.results, f"{self.path.name} printed no RESULT {key}=...; got {sorted(self.results)}"
        return [float(x) for x in self.results[key].split(",") if x]


def _kernel_dir(root: Path) -> Path:
    """A kernelspec that runs *this* Python (the venv), whatever `python` is on PATH, with the
    suite's speed settings (tests/speedups.py), as ``ipykernel_launcher`` otherwise."""
    d = root / "kernels" / KERNEL
    d.mkdir(parents=True, exist_ok=True)
    launch = (f"import sys; sys.path[:1] = [] if sys.path[0] == '' else sys.path[:1]; sys.path.append({str(ROOT)!r}); "
              "from tests import speedups; speedups.apply(); from ipykernel import kernelapp; kernelapp.launch_new_instance()")
    (d / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-c", launch, "-f", "{connection_file}"],
        "display_name": "specjax (test)", "language": "python"}))
    return root


def stream_text(nb) -> str:
    out = []
    for cell in nb.cells:
        for o in cell.get("outputs", []):
            if o.get("output_type") == "stream":
                out.append(o.get("text", ""))
    return "".join(out)


def parse_results(text: str) -> dict[str, str]:
    res: dict[str, str] = {}
    for line in RESULT_LINE.findall(text):
        for tok in line.split():
            if "=" in tok:
                k, v = tok.split("=", 1)
                res[k] = v
    return res


def run_notebook(name: str, workdir: Path, *, timeout: int = 600, env: dict[str, str] | None = None) -> Executed:
    import nbformat
    from nbclient import NotebookClient

    path = NOTEBOOKS / name
    nb = nbformat.read(path, as_version=4)
    workdir.mkdir(parents=True, exist_ok=True)
    saved = dict(os.environ)
    # The kernel inherits this environment: SMALL mode, a scratch work dir, CPU JAX, no hub.
    os.environ.update({
        "JUPYTER_PATH": str(_kernel_dir(workdir / "_jupyter")),
        "SPECJAX_NOTEBOOK_SIZE": "SMALL",
        "SPECJAX_NOTEBOOK_WORK": str(workdir / "work"),
        "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu"),
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "MPLBACKEND": "module://matplotlib_inline.backend_inline",
        **(env or {}),
    })
    times: list[float] = []
    try:
        client = NotebookClient(nb, kernel_name=KERNEL, timeout=timeout, allow_errors=False,
                                resources={"metadata": {"path": str(workdir)}})
        t0 = time.perf_counter()
        with client.setup_kernel():
            for i, cell in enumerate(nb.cells):
                c0 = time.perf_counter()
                client.execute_cell(cell, i)
                times.append(time.perf_counter() - c0)
        seconds = time.perf_counter() - t0
    finally:
        os.environ.clear()
        os.environ.update(saved)
    text = stream_text(nb)
    return Executed(path, seconds, parse_results(text), times, text, nb)


def report(ex: Executed) -> None:
    slow = sorted(enumerate(ex.cell_seconds), key=lambda t: -t[1])[:3]
    print(f"\n{ex.path.name}: {ex.seconds:.1f}s; slowest cells " + ", ".join(f"#{i} {s:.1f}s" for i, s in slow))
