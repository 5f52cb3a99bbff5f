"""Range-learning learning-rate probe (issue 15): one `qcompress train` run with the learned-range
Parameters (weight_scale / weight_zero_point / input_scale / input_zero_point) at lr x FACTOR in
their own AdamW group (weight decay 0), everything else as the job's default AdamW (lr --lr,
weight decay 0.01). The job's default factor is qcompress.train.job.RANGE_LR_FACTOR (0.1, chosen
with this probe); FACTOR overrides it for one run:

    python benchmarks/range_lr_probe.py 0.1 -- schedules/w4a16_g32.yaml schedules/with_qad_range_learning.yaml \
        --model runs/gpt2-austen ... (the usual qcompress train arguments)
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import qcompress.train.job as job     # noqa: E402
from qcompress.cli import main        # noqa: E402

if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[2] != "--":
        raise SystemExit("usage: range_lr_probe.py FACTOR -- <qcompress train arguments>")
    job.RANGE_LR_FACTOR = float(sys.argv[1])
    print(f"learned ranges at {job.RANGE_LR_FACTOR:g} x lr, weight decay 0", flush=True)
    sys.exit(main(["train", *sys.argv[3:]]))
