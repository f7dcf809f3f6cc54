"""pytorch_model.bin read without torch: every dtype, views with offsets/strides, shared storages;
anything but a plain tensor state dict is refused (no code runs)."""

from __future__ import annotations

import io
import pickle
import zipfile

import pytest
import torch

from bridge.external.torch_bin import TorchBinError, TorchBinStore


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def test_state_dict_round_trip(tmp_path):
    base = torch.randn(10, 6)
    sd = {
        "f32": torch.randn(3, 4), "f16": torch.randn(5).half(), "bf16": torch.randn(2, 3).bfloat16(),
        "f64": torch.randn(2).double(), "i64": torch.arange(7), "i32": torch.arange(3, dtype=torch.int32),
        "bool": torch.tensor([True, False, True]), "u8": torch.arange(4, dtype=torch.uint8),
        "transposed": torch.randn(4, 3).t(), "slice": base[2:5, 1:4], "shares_base": base,
        "param": torch.nn.Parameter(torch.randn(2, 2)), "scalar": torch.tensor(3.5), "empty": torch.zeros(0, 4),
    }
    torch.save(sd, tmp_path / "pytorch_model.bin")
    st = TorchBinStore(tmp_path / "pytorch_model.bin")
    assert sorted(st.names) == sorted(sd)
    for n, t in sd.items():
        a = st.array(n)
        t = t.detach()
        assert a.shape == tuple(t.shape), n
        assert a.tobytes() == _bytes(t), n
        assert st.info(n).dtype == {"f32": "F32", "f16": "F16", "bf16": "BF16", "f64": "F64", "i64": "I64",
                                    "i32": "I32", "bool": "BOOL", "u8": "U8"}.get(n, "F32")


class _Evil:
    def __reduce__(self):
        import os

        return (os.system, ("echo pwned",))


def test_refuses_code(tmp_path):
    torch.save({"w": torch.zeros(2), "x": _Evil()}, tmp_path / "evil.bin")
    with pytest.raises(TorchBinError, match="posix.system|os.system|nt.system"):
        TorchBinStore(tmp_path / "evil.bin")


def test_refuses_legacy_and_non_tensor(tmp_path):
    p = tmp_path / "legacy.bin"
    torch.save({"w": torch.zeros(2)}, p, _use_new_zipfile_serialization=False)
    with pytest.raises(TorchBinError, match="legacy"):
        TorchBinStore(p)
    torch.save({"w": torch.zeros(2), "step": 3}, tmp_path / "mixed.bin")
    with pytest.raises(TorchBinError, match="state dict of tensors"):
        TorchBinStore(tmp_path / "mixed.bin")
    bad = tmp_path / "truncated.bin"
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("archive/data.pkl", pickle.dumps({"a": 1})[:-3])
    bad.write_bytes(buf.getvalue())
    with pytest.raises(TorchBinError, match="cannot read the pickle"):
        TorchBinStore(bad)


def test_safeailab_bin_source_converts_without_torch_import(tmp_path, verifiers):
    """The reader never imports torch (bridge stays torch-free)."""
    import subprocess
    import sys

    from tests.bridge.external import sources

    src = sources.safeailab_eagle3(tmp_path / "s", verifiers["llama"], fmt="bin")
    code = ("import sys, builtins\n"
            "real = builtins.__import__\n"
            "def imp(n, *a, **k):\n"
            "    if n.split('.')[0] in ('torch', 'jax', 'transformers', 'speculators'):\n"
            "        raise ImportError('blocked ' + n)\n"
            "    return real(n, *a, **k)\n"
            "builtins.__import__ = imp\n"
            "import bridge\n"
            f"r = bridge.convert_external({str(src)!r}, 'auto', {str(verifiers['llama'])!r}, {str(tmp_path / 'o')!r})\n"
            "print(r.source_kind, len(r.tensors), r.report.exit_code)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=str(tmp_path),
                         env={"PYTHONPATH": str(__import__("pathlib").Path(bridge_root()))})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["eagle3-safeailab", "15", "0"]


def bridge_root():
    import bridge

    return __import__("pathlib").Path(bridge.__file__).parent.parent
