"""Range-learning learning-rate probe (issue 15): one `qcompress train` run whose learned-range
Parameters (weight_scale / weight_zero_point / input_scale / input_zero_point) sit in their own
AdamW param group, lr x FACTOR and weight decay 0, everything else as the job's default AdamW
(lr --lr, weight decay 0.01). The job itself puts them in one group with the weights; this probe
measures what a separate group would change, without editing the job:

    python benchmarks/range_lr_probe.py 0.1 -- schedules/w4_group32.yaml schedules/qad_range_learning.yaml \
        --model runs/gpt2-austen ... (the usual qcompress train arguments)
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import qcompress                      # noqa: E402
import qcompress.train.job as job     # noqa: E402
from qcompress.nn.ranges import INPUT_PARAMS, WEIGHT_PARAMS   # noqa: E402

if len(sys.argv) < 3 or sys.argv[2] != "--":
    raise SystemExit("usage: range_lr_probe.py FACTOR -- <qcompress train arguments>")
factor = float(sys.argv[1])
args = sys.argv[3:]
RANGE_IDS = set()
_init = qcompress.init_compression


def init_and_record(model, *a, **k):
    """init_compression, then remember which Parameters are learned ranges."""
    out = _init(model, *a, **k)
    for n, p in model.named_parameters():
        if n.rsplit(".", 1)[-1] in WEIGHT_PARAMS + INPUT_PARAMS:
            RANGE_IDS.add(id(p))
    return out


def client_optimizer(doc, lr):
    def make(params):
        params = list(params)
        rng = [p for p in params if id(p) in RANGE_IDS]
        rest = [p for p in params if id(p) not in RANGE_IDS]
        print(f"optimizer: {len(rng)} range tensors at lr {lr * factor:g} wd 0, {len(rest)} others at {lr:g}",
              flush=True)
        groups = [{"params": rest}] + ([{"params": rng, "lr": lr * factor, "weight_decay": 0.0}] if rng else [])
        return torch.optim.AdamW(groups, lr=lr, weight_decay=0.01)
    return make


qcompress.init_compression = init_and_record
job.client_optimizer = client_optimizer
from qcompress.cli import main   # noqa: E402
sys.exit(main(["train", *args]))
