"""Quantization-aware training on several processes with qcompress.initialize.

    torchrun --standalone --nproc_per_node=2 model_zoo/train_ddp.py --config my_config.yaml
    python model_zoo/train_ddp.py                 # one process works too

A small CNN on scikit-learn's 8x8 digits, rewritten by init_compression (W8A8 by default) and
trained by the engine: ZeRO stage, precision, accumulation, clipping, LR schedule and optimizer
all come from the config. --config files are merged over DEFAULT below (a DeepSpeed-style
ds_config.json works); e.g. `zero_optimization: {stage: 3}` shards the model with FSDP2.
"""

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout
import qcompress as qc  # noqa: E402
from model_zoo.data import load_digits  # noqa: E402
from model_zoo.models import SmallCNN  # noqa: E402

DEFAULT = {
    "gradient_clipping": 1.0,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
    "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 200, "warmup_num_steps": 20}},
    "zero_optimization": {"stage": 0},
    "compression_training": {
        "weight_quantization": {
            "shared_parameters": {"enabled": True, "quantize_weight_in_forward": True},
            "different_groups": {"w8": {"params": {"start_bits": 8, "target_bits": 8}, "modules": ["*"]}},
        },
        "activation_quantization": {
            "shared_parameters": {"enabled": True, "schedule_offset": 0},
            "different_groups": {"a8": {"params": {"bits": 8}, "modules": ["*"]}},
        },
    },
}
# Only when the config gives no batch size: a fixed micro batch would contradict a ds_config.json's
# train_batch_size and gradient_accumulation_steps.
BATCH_DEFAULT = {"train_micro_batch_size_per_gpu": 32}

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--config", action="append", default=[], help="YAML/JSON merged over the defaults")
parser.add_argument("--epochs", type=int, default=6)
parser.add_argument("--out", default="out/train_ddp", help="checkpoint directory")
parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
args = parser.parse_args()

cfg = qc.load_config(DEFAULT, *args.config)
if cfg.train_batch_size is None and cfg.train_micro_batch_size_per_gpu is None:
    cfg = qc.load_config(DEFAULT, BATCH_DEFAULT, *args.config)
torch.manual_seed(0)  # same init everywhere (rank 0's wins anyway)
model = qc.init_compression(SmallCNN(image_size=8, channels=(8, 16), hidden=64), cfg)
engine = qc.initialize(model, cfg)  # reads RANK / WORLD_SIZE from torchrun
rank, world = engine.rank, engine.world_size
train_set, test_set = load_digits()
x_train, y_train = (t.to(engine.device) for t in train_set)
x_test, y_test = (t.to(engine.device) for t in test_set)
micro = engine.train_micro_batch_size_per_gpu
steps_per_epoch = len(y_train) // engine.train_batch_size

start_epoch = 0
if args.resume and os.path.exists(os.path.join(args.out, "latest")):
    _, client = engine.load_checkpoint(args.out)
    start_epoch = client["epoch"] + 1

for epoch in range(start_epoch, args.epochs):
    engine.train()
    order = torch.randperm(len(y_train), generator=torch.Generator().manual_seed(epoch)).to(engine.device)
    for step in range(steps_per_epoch):
        for m in range(engine.gradient_accumulation_steps):
            # this rank's slice of the global batch: [rank][micro-batch] blocks
            base = step * engine.train_batch_size + (rank * engine.gradient_accumulation_steps + m) * micro
            idx = order[base : base + micro]
            loss = F.cross_entropy(engine(x_train[idx]), y_train[idx])
            engine.backward(loss)
            engine.step()
    engine.eval()
    with torch.no_grad():
        acc = (engine(x_test).argmax(1) == y_test).float().mean().item()
    engine.save_checkpoint(args.out, client_state={"epoch": epoch})
    if rank == 0:
        print(
            f"epoch {epoch}: loss {loss.item():.4f}  test accuracy {acc:.3f}  lr {engine.get_lr()[0]:.2e}  "
            f"steps {engine.global_steps}"
        )

if rank == 0:
    mem = engine.memory_report()
    print(
        f"memory per rank (stage {engine.stage}, {world} ranks): "
        + ", ".join(f"{k} {v / 1024:.1f} KiB" for k, v in mem.items())
    )
if dist.is_initialized():
    dist.destroy_process_group()
