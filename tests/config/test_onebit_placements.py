"""The ZeRO settings a 1-bit optimizer cannot run under are refused when the config loads (before
any process group, model wrapper or file exists), naming the key; plain optimizers load them."""

import pytest

import qcompress as qc


def _doc(opt, stage, offload="none", tmp=None):
    off = {"device": offload}
    if offload == "nvme":
        off["nvme_path"] = str(tmp)
    return {
        "optimizer": {"type": opt, "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": stage, "offload_optimizer": off},
    }


@pytest.mark.parametrize("opt", ["OneBitAdam", "ZeroOneAdam", "OneBitLamb"])
@pytest.mark.parametrize(
    "stage,offload,key,says",
    [
        (1, "nvme", "zero_optimization.offload_optimizer.device", "'nvme' offload streams plain optimizers"),
        (2, "nvme", "zero_optimization.offload_optimizer.device", "'nvme' offload streams plain optimizers"),
        (1, "cpu", "zero_optimization.offload_optimizer.device", "'cpu' offload steps plain optimizers"),
        (2, "none", "zero_optimization.stage", "stage 2 shards them (FSDP2). Use stage 0 or 1"),
        (3, "none", "zero_optimization.stage", "stage 3 shards them (FSDP2). Use stage 0 or 1"),
    ],
)
def test_onebit_optimizer_refused_at_load_by_key(tmp_path, opt, stage, offload, key, says):
    with pytest.raises(qc.ConfigError) as err:
        qc.load_config(_doc(opt, stage, offload, tmp_path))
    assert err.value.path == key
    assert str(err.value).startswith(f"{key}: {opt} ") and says in str(err.value)
    assert list(tmp_path.iterdir()) == []  # nothing written


@pytest.mark.parametrize("stage,offload", [(0, "none"), (1, "none")])
def test_onebit_optimizer_loads_where_it_runs(stage, offload):
    assert qc.load_config(_doc("OneBitAdam", stage, offload)).zero_optimization.stage == stage


@pytest.mark.parametrize("stage,offload", [(1, "nvme"), (1, "cpu"), (3, "none")])
def test_plain_optimizer_loads_the_same_settings(tmp_path, stage, offload):
    cfg = qc.load_config(_doc("AdamW", stage, offload, tmp_path))
    assert cfg.zero_optimization.offload_optimizer.device == offload
