"""A real QAT run: W8A8 MLP on sklearn's digits ends within 1 point of the FP32 model."""

import pytest
import torch
import torch.nn as nn

import qcompress as qc

sklearn_datasets = pytest.importorskip("sklearn.datasets", reason="scikit-learn provides the digits data")

W8A8 = {
    "compression_training": {
        "weight_quantization": {
            "shared_parameters": {"enabled": True, "quantize_weight_in_forward": True, "schedule_offset": 0},
            "different_groups": {
                "wq1": {
                    "params": {"start_bits": 8, "target_bits": 8, "quantization_period": 0, "granularity": "channel"}
                }
            },
        },
        "activation_quantization": {
            "shared_parameters": {"enabled": True, "range_calibration": "dynamic", "schedule_offset": 0},
            "different_groups": {"aq1": {"params": {"bits": 8}}},
        },
    }
}


def digits_split():
    data = sklearn_datasets.load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.int64)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    test, train = perm[:540], perm[540:]
    return x[train], y[train], x[test], y[test]


def make_mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10))


def train(model, xtr, ytr, sched=None, epochs=30):
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(1)
    for _ in range(epochs):
        model.train()
        for idx in torch.randperm(len(ytr), generator=g).split(64):
            opt.zero_grad()
            nn.functional.cross_entropy(model(xtr[idx]), ytr[idx]).backward()
            opt.step()
            if sched is not None:
                sched.step()
    return model


@torch.no_grad()
def accuracy(model, x, y):
    model.eval()
    return (model(x).argmax(1) == y).float().mean().item()


@pytest.fixture
def one_thread():
    # tiny matmuls: thread hand-offs cost more than they save (and CI shares 2 cores)
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_w8a8_digits_within_one_point_of_fp32(one_thread):
    xtr, ytr, xte, yte = digits_split()
    fp32 = train(make_mlp(), xtr, ytr)
    acc_fp = accuracy(fp32, xte, yte)

    cfg = qc.load_config(W8A8)
    model = qc.init_compression(make_mlp(), cfg)
    assert sum(m.qc_wq is not None and m.qc_aq is not None for m in model.modules() if isinstance(m, nn.Linear)) == 3
    sched = qc.CompressionScheduler(model, cfg)
    train(model, xtr, ytr, sched)
    acc_q = accuracy(model, xte, yte)
    assert sched.current_bits() == {"0": 8, "2": 8, "4": 8}
    # the eval forward really is quantized: the weights it uses sit on an 8-bit per-row grid
    w = model[0].effective_weight().detach()
    step = w.abs().amax(1, keepdim=True) / 127
    assert torch.allclose(w / step, (w / step).round(), atol=1e-3)
    print(f"digits test accuracy: fp32 {acc_fp:.4f}  W8A8 {acc_q:.4f}")
    assert acc_fp > 0.95
    assert abs(acc_q - acc_fp) <= 0.01, (acc_fp, acc_q)
    # and after baking, the accuracy is the same
    qc.redundancy_clean(model, cfg)
    assert accuracy(model, xte, yte) == acc_q
