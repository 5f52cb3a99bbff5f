"""DeepSpeed's `tensorboard` and `csv_monitor` config sections: the engine's monitor writes
Train/Samples/train_loss, lr and loss_scale at global_samples, checked against a plain torch loop
and read back with TensorBoard's own EventAccumulator."""

import csv
import json
import os
import sys
import warnings

import pytest
import torch
import torch.nn as nn

import qcompress as qc
from qcompress.config.training import MonitorOutput
from qcompress.engine import initialize
from qcompress.engine.monitor import Monitor

MICRO, GAS, STEPS = 3, 2, 6
LO, HI, WARMUP = 0.01, 0.1, 4


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


def make_cfg(**extra):
    cfg = {
        "train_batch_size": MICRO * GAS,
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "optimizer": {"type": "SGD", "params": {"lr": HI}},
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": LO, "warmup_max_lr": HI, "warmup_num_steps": WARMUP, "warmup_type": "linear"},
        },
    }
    cfg.update(extra)
    return cfg


def batches(step):
    g = torch.Generator().manual_seed(100 + step)
    return [(torch.randn(MICRO, 8, generator=g), torch.randn(MICRO, 1, generator=g)) for _ in range(GAS)]


def train(engine, first, last):
    for step in range(first, last):
        for x, y in batches(step):
            loss = nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()


def plain_loop(steps):
    """(mean loss per step, lr after each step): torch SGD, the warmup in closed form."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LO)
    losses, lrs = [], []
    for step in range(steps):
        micro = []
        for x, y in batches(step):
            loss = nn.functional.mse_loss(model(x), y)
            (loss / GAS).backward()
            micro.append(loss.item())
        opt.step()
        opt.zero_grad()
        lr = LO + (HI - LO) * min(step + 1, WARMUP) / WARMUP
        for group in opt.param_groups:
            group["lr"] = lr
        losses.append(sum(micro) / len(micro))
        lrs.append(lr)
    return losses, lrs


def read_csv(path):
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    return rows[0], [(int(s), float(v)) for s, v in rows[1:]]


def test_csv_rows_equal_a_plain_loop(tmp_path):
    cfg = make_cfg(csv_monitor={"enabled": True, "output_path": str(tmp_path / "logs"), "job_name": "run1"})
    engine = initialize(make_model(), cfg)
    train(engine, 0, STEPS)
    losses, lrs = plain_loop(STEPS)
    run = tmp_path / "logs" / "run1"
    assert sorted(os.listdir(run)) == ["Train_Samples_lr.csv", "Train_Samples_train_loss.csv"]  # no fp16 scale
    samples = [MICRO * GAS * (k + 1) for k in range(STEPS)]
    header, rows = read_csv(run / "Train_Samples_train_loss.csv")
    assert header == ["step", "train_loss"]
    assert [s for s, _ in rows] == samples
    assert [v for _, v in rows] == pytest.approx(losses, rel=1e-12)
    header, rows = read_csv(run / "Train_Samples_lr.csv")
    assert header == ["step", "lr"] and [s for s, _ in rows] == samples
    assert [v for _, v in rows] == pytest.approx(lrs, rel=1e-12)
    assert lrs[0] != lrs[-1]  # the warmup moved the rate


def test_tensorboard_events_hold_the_same_values(tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard is not installed (pip install tensorboard)")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = make_cfg(
        tensorboard={"enabled": True, "output_path": str(tmp_path / "tb"), "job_name": "run1"},
        csv_monitor={"enabled": True, "output_path": str(tmp_path / "csv")},
    )
    engine = initialize(make_model(), cfg)
    train(engine, 0, STEPS)  # no close(): each step was flushed
    assert engine.monitor.tensorboard_dir == os.path.join(str(tmp_path / "tb"), "run1")
    acc = EventAccumulator(str(tmp_path / "tb" / "run1"))
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == {"Train/Samples/train_loss", "Train/Samples/lr"}
    losses, lrs = plain_loop(STEPS)
    samples = [MICRO * GAS * (k + 1) for k in range(STEPS)]
    for tag, want in (("Train/Samples/train_loss", losses), ("Train/Samples/lr", lrs)):
        events = acc.Scalars(tag)
        assert [e.step for e in events] == samples
        assert [e.value for e in events] == pytest.approx(want, rel=1e-6)  # float32 in event files
    # the CSV monitor's default job name, as DeepSpeed's
    assert os.listdir(tmp_path / "csv") == ["DeepSpeedJobName"]


def test_fp16_loss_scale_is_logged_after_each_step(tmp_path):
    cfg = make_cfg(
        fp16={"enabled": True, "initial_scale_power": 4, "loss_scale_window": 2},
        csv_monitor={"enabled": True, "output_path": str(tmp_path)},
    )
    engine = initialize(make_model(), cfg)
    scales = []
    for step in range(STEPS):
        train(engine, step, step + 1)
        scales.append(engine.loss_scale)
    _, rows = read_csv(tmp_path / "DeepSpeedJobName" / "Train_Samples_loss_scale.csv")
    assert rows == [(MICRO * GAS * (k + 1), s) for k, s in enumerate(scales)]
    assert scales[0] == 16.0 and max(scales) > 16.0  # no overflow at 2^4: the window doubles it


def test_resumed_run_continues_the_csv_files(tmp_path):
    def cfg(out):
        return make_cfg(csv_monitor={"enabled": True, "output_path": str(out), "job_name": "job"})

    whole = initialize(make_model(), cfg(tmp_path / "whole"))
    train(whole, 0, STEPS)
    first = initialize(make_model(), cfg(tmp_path / "resumed"))
    train(first, 0, 3)
    first.save_checkpoint(str(tmp_path / "ckpt"))
    first.monitor.close()
    second = initialize(make_model(), cfg(tmp_path / "resumed"))
    second.load_checkpoint(str(tmp_path / "ckpt"))
    train(second, 3, STEPS)
    for name in ("Train_Samples_train_loss.csv", "Train_Samples_lr.csv"):
        want = (tmp_path / "whole" / "job" / name).read_text()
        assert (tmp_path / "resumed" / "job" / name).read_text() == want  # one header, every row


def test_nothing_is_written_when_disabled(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for extra in (
        {},
        {
            "tensorboard": {"enabled": False, "output_path": "tb"},
            "csv_monitor": {"enabled": False, "output_path": "csv", "job_name": "x"},
        },
    ):
        engine = initialize(make_model(), make_cfg(**extra))
        train(engine, 0, 2)
        assert not engine.monitor.enabled and engine._step_losses == []
    assert os.listdir(tmp_path) == []


def test_only_rank_0_writes(tmp_path):
    section = MonitorOutput(enabled=True, output_path=str(tmp_path), job_name="j")
    other = Monitor(section, section, rank=1)
    other.write_events([("Train/Samples/lr", 0.1, 4)])
    assert not other.enabled and os.listdir(tmp_path) == []


def test_monitor_sections_parse_like_deepspeed():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no longer "a DeepSpeed setting qcompress does not implement"
        cfg = qc.load_config({"tensorboard": {"enabled": True}, "csv_monitor": {"output_path": "o"}})
    assert cfg.tensorboard == MonitorOutput(enabled=True, output_path="", job_name="DeepSpeedJobName")
    assert cfg.csv_monitor == MonitorOutput(enabled=False, output_path="o", job_name="DeepSpeedJobName")
    assert qc.load_config({}).tensorboard == MonitorOutput(False, "", "DeepSpeedJobName")


@pytest.mark.parametrize(
    "doc,path",
    [
        ({"tensorboard": {"enabled": True, "output_path": 3}}, "tensorboard.output_path"),
        ({"csv_monitor": {"enabled": "yes"}}, "csv_monitor.enabled"),
        ({"csv_monitor": {"job_name": ["a"]}}, "csv_monitor.job_name"),
        ({"tensorboard": {"enable": True}}, "tensorboard.enable"),
        ({"tensorboard": True}, "tensorboard"),
    ],
)
def test_bad_monitor_settings_name_their_key(doc, path):
    with pytest.raises(qc.ConfigError) as err:
        qc.load_config(doc)
    assert err.value.path == path


def test_missing_tensorboard_warns_with_the_install_command_and_csv_still_works(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails
    cfg = make_cfg(
        tensorboard={"enabled": True, "output_path": str(tmp_path / "tb")},
        csv_monitor={"enabled": True, "output_path": str(tmp_path / "csv")},
    )
    with pytest.warns(UserWarning, match="pip install tensorboard"):
        engine = initialize(make_model(), cfg)
    train(engine, 0, 2)
    assert engine.monitor.tensorboard_dir is None and not (tmp_path / "tb").exists()
    _, rows = read_csv(tmp_path / "csv" / "DeepSpeedJobName" / "Train_Samples_lr.csv")
    assert [s for s, _ in rows] == [MICRO * GAS, 2 * MICRO * GAS]


def test_write_events_rejects_a_fractional_step(tmp_path):
    m = Monitor(None, MonitorOutput(enabled=True, output_path=str(tmp_path)))
    with pytest.raises(ValueError, match="'x': step must be an integer"):
        m.write_events([("x", 1.0, 2.5)])
    m.write_events([("a b/c", torch.tensor(0.25), torch.tensor(8))])  # tensors are fine
    m.close()
    assert read_csv(tmp_path / "DeepSpeedJobName" / "a_b_c.csv") == (["step", "c"], [(8, 0.25)])


def test_export_from_a_checkpoint_writes_no_training_logs(tmp_path, monkeypatch):
    from qcompress import cli

    doc = make_cfg(
        csv_monitor={"enabled": True, "output_path": "logs"},
        tensorboard={"enabled": True, "output_path": "logs"},
        compression_training={
            "weight_quantization": {
                "shared_parameters": {"enabled": True},
                "different_groups": {"wq": {"params": {"start_bits": 8, "target_bits": 8}, "modules": ["0", "2"]}},
            }
        },
    )
    (tmp_path / "cfg.json").write_text(json.dumps(doc))
    (tmp_path / "qc_monitor_models.py").write_text(
        "import torch, torch.nn as nn\n"
        "def build():\n    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))\n"
    )
    monkeypatch.chdir(tmp_path)
    engine = initialize(qc.init_compression(make_model(), qc.load_config(doc)), doc)
    train(engine, 0, 2)
    engine.save_checkpoint("ckpt")
    engine.monitor.close()
    before = {p: os.path.getsize(os.path.join(d, p)) for d, _, fs in os.walk("logs") for p in fs}
    assert (
        cli.main(
            [
                "export",
                "--model",
                "qc_monitor_models:build",
                "--checkpoint",
                "ckpt",
                "--config",
                "cfg.json",
                "--out",
                "out",
            ]
        )
        == 0
    )
    after = {p: os.path.getsize(os.path.join(d, p)) for d, _, fs in os.walk("logs") for p in fs}
    assert before == after and os.path.exists("out/model.safetensors")
