"""Metric sinks (--log-to tensorboard,wandb,jsonl): the TensorBoard event file read back holds
the same fields as metrics.jsonl; wandb gets the same tags (a stand-in module records the calls);
unknown or missing sinks are errors naming what to do."""

from __future__ import annotations

import json
import struct
import sys
import types

import pytest

from specjax.train.metric_sinks import MetricSinkError, open_sinks, parse_log_to, scalars

RECS = [
    {"step": 1, "epoch": 0, "tokens": 120, "lr": {"default": 1e-4}, "tok_per_s": 55.5, "loss": 3.5, "accept_est": 1.2},
    {"step": 2, "epoch": 0, "tokens": 118, "lr": {"default": 2e-4}, "tok_per_s": 60.0, "loss": 3.1, "accept_est": 1.3},
    {"split": "val", "step": 2, "epoch": 0, "loss": 3.3, "note": "not a number"},
]


def read_events(path):
    """TFRecord framing (u64 length, u32 crc, data, u32 crc) of tensorboard Event protos."""
    from tensorboardX.proto import event_pb2

    raw, out, i = path.read_bytes(), [], 0
    while i < len(raw):
        (n,) = struct.unpack("<Q", raw[i: i + 8])
        ev = event_pb2.Event()
        ev.ParseFromString(raw[i + 12: i + 12 + n])
        out.append(ev)
        i += 12 + n + 4
    return out


def scalar_points(run):
    pts = {}
    for f in sorted((run / "tensorboard").glob("events.out.tfevents.*")):
        for ev in read_events(f):
            for v in ev.summary.value:
                pts[(v.tag, ev.step)] = v.simple_value
    return pts


def test_parse_log_to():
    assert parse_log_to("tensorboard,wandb,jsonl") == ["tensorboard", "wandb", "jsonl"]
    assert parse_log_to(" TensorBoard , jsonl,jsonl") == ["tensorboard", "jsonl"]
    assert parse_log_to(None) == parse_log_to("") == ["jsonl"]
    with pytest.raises(MetricSinkError, match=r"unknown sink\(s\) \['mlflow'\]; expected .*jsonl, tensorboard, wandb"):
        parse_log_to("tensorboard,mlflow")


def test_scalars_are_the_jsonl_fields():
    assert scalars(RECS[0]) == (1, {"train/epoch": 0.0, "train/tokens": 120.0, "train/lr/default": 1e-4,
                                    "train/tok_per_s": 55.5, "train/loss": 3.5, "train/accept_est": 1.2})
    assert scalars(RECS[2]) == (2, {"val/epoch": 0.0, "val/loss": 3.3})


def test_tensorboard_event_file_reads_back_as_metrics_jsonl(tmp_path):
    run = tmp_path / "run"
    with open_sinks(run, parse_log_to("tensorboard,jsonl")) as sinks:
        for r in RECS:
            sinks.write(r)
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert lines == RECS
    want = {}
    for r in lines:
        step, vals = scalars(r)
        want.update({(tag, step): v for tag, v in vals.items()})
    got = scalar_points(run)
    assert got.keys() == want.keys() and len(got) == 14  # 6 + 6 train fields, 2 val
    assert all(got[k] == pytest.approx(want[k], rel=1e-6) for k in want)  # float32 in the event file

    # a resumed run from step 1: TensorBoard is told to drop the old points after it
    with open_sinks(run, ["tensorboard"], resume_step=1) as sinks:
        sinks.write({**RECS[1], "loss": 2.9})
    files = sorted((run / "tensorboard").glob("events.out.tfevents.*"))
    assert len(files) == 2
    (resumed,) = [f for f in files if f.name.endswith(".from1")]
    evs = read_events(resumed)
    assert any(ev.HasField("session_log") and ev.step == 1 for ev in evs)
    assert [v.simple_value for ev in evs for v in ev.summary.value if v.tag == "train/loss"] == [pytest.approx(2.9)]


def test_wandb_gets_the_same_tags(tmp_path, monkeypatch):
    calls = []

    class Run:
        def log(self, vals, step):
            calls.append(("log", step, vals))

        def finish(self):
            calls.append(("finish",))

    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: calls.append(("init", kw)) or Run()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    with open_sinks(tmp_path / "run", ["wandb"], config={"lr": 1e-4}, wandb_project="p") as sinks:
        for r in RECS:
            sinks.write(r)
    assert calls[0] == ("init", {"project": "p", "dir": str(tmp_path / "run"), "config": {"lr": 1e-4},
                                 "name": "run", "resume": None})
    assert calls[1:4] == [("log", *scalars(r)) for r in RECS] and calls[-1] == ("finish",)

    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed
    with pytest.raises(MetricSinkError, match=r"--log-to wandb: the wandb package is not installed; "
                                              r"pip install 'specjax\[wandb\]'"):
        open_sinks(tmp_path / "run2", ["tensorboard", "wandb"])
    assert not (tmp_path / "run2").exists()  # checked before anything is created
