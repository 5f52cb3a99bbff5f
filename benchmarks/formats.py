"""Float formats (FP8 e4m3, NVFP4, MXFP4, MXFP8) on the CPU: fake-quantization throughput against a
plain copy and against compressed-tensors' own fake_quantize, and a QAT training step against FP32.

    python benchmarks/formats.py                   # ~2 minutes on 2 cores, printed
    python benchmarks/formats.py --write-results   # also record it in benchmarks/results/formats.md

Fake quantization of one [rows, cols] weight: "kernel" is qcompress's path (scales in torch, the
per-element pass in csrc/cpu/floats.cpp), "reference" its pure-torch math (quant/floats.py),
"compressed-tensors" calculate_qparams + fake_quantize (the oracle, CPU path). Ratios are copy time
/ op time (1.0 = copy speed). The training step: a 4-layer MLP (1024 wide, batch 64), forward +
backward + SGD, the compressed model's weights and inputs fake-quantized in every forward, against
the same model uncompressed. Times are medians of interleaved repeats (benchmarks/common.py).
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import common  # noqa: E402

import torch  # noqa: E402

FORMATS = [
    ("fp8_e4m3 channel", "fp8_e4m3", "channel", None, "FP8_DYNAMIC"),
    ("fp8_e4m3 block", "fp8_e4m3", "block", None, "FP8_BLOCK"),
    ("nvfp4", "nvfp4", "group", None, "NVFP4A16"),
    ("mxfp4", "mxfp4", "group", None, "MXFP4A16"),
    ("mxfp8", "mxfp8", "group", None, "MXFP8A16"),
]


def _ct_fake(w, spec, preset):
    """compressed-tensors' calculate_qparams + fake_quantize over the groups' min/max (grouped as
    quant/floats.py groups them, which the tests prove equal to compressed-tensors' grouping)."""
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam
    from qcompress.quant import floats

    args = PRESET_SCHEMES[preset]["weights"]
    t = floats._tiles(w, spec)
    dims = floats._reduce_dims(t, spec)
    g = generate_gparam(w.amin(), w.amax()) if spec.format == "nvfp4" else None
    shape = floats.scale_grid_shape(w.shape, spec)
    s, z = calculate_qparams(t.amin(dims).reshape(shape), t.amax(dims).reshape(shape), args, global_scale=g)
    return fake_quantize(w, s, z, args, global_scale=g)


def fake_quant_table(rows, cols, dtype, reps):
    from qcompress.quant import floats

    w = torch.randn(rows, cols).to(dtype)
    have_ct = True
    try:
        import compressed_tensors  # noqa: F401
    except ImportError:
        have_ct = False
    lines = [
        f"Fake quantization of a {rows} x {cols} {str(dtype).replace('torch.', '')} weight "
        f"({w.numel() * w.element_size() / 2**20:.0f} MiB); ms, and copy time / op time.",
        "",
        "| format | copy ms | kernel ms | vs copy | reference ms | vs copy | compressed-tensors ms | vs copy |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label, fmt, gran, gs, preset in FORMATS:
        spec = floats.float_spec(fmt, gran, gs)
        fns = {
            "copy": lambda: w.clone(),
            "kernel": lambda: floats.fake_quantize_float(w, spec, backend="kernel"),
            "reference": lambda: floats.fake_quantize_float(w, spec, backend="reference"),
        }
        if have_ct:
            fns["ct"] = lambda: _ct_fake(w, spec, preset)
        t = common.interleaved(fns, repeats=reps)
        ct = f"{t['ct'].ms()} | {common.ratio(t, 'copy', 'ct')}" if have_ct else "- | -"
        lines.append(
            f"| {label} | {t['copy'].ms()} | {t['kernel'].ms()} | {common.ratio(t, 'copy', 'kernel')} | "
            f"{t['reference'].ms()} | {common.ratio(t, 'copy', 'reference')} | {ct} |"
        )
    return "\n".join(lines) + "\n"


def _mlp(width, seed=0):
    torch.manual_seed(seed)
    layers = []
    for _ in range(4):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def _cfg(fmt, bits, acts):
    import qcompress as qc

    params = {"start_bits": bits, "target_bits": bits, "format": fmt}
    if fmt == "fp8_e4m3":
        params["granularity"] = "channel"
    doc = {
        "compression_training": {
            "weight_quantization": {
                "shared_parameters": {"enabled": True, "quantize_weight_in_forward": True, "schedule_offset": 0},
                "different_groups": {"w": {"params": params}},
            }
        }
    }
    if acts:
        doc["compression_training"]["activation_quantization"] = {
            "shared_parameters": {
                "enabled": True,
                "schedule_offset": 0,
                "range_calibration": "static" if fmt == "nvfp4" else "dynamic",
            },
            "different_groups": {"a": {"params": {"bits": bits, "format": fmt}}},
        }
    return qc.load_config(doc)


def step_table(width, batch, reps):
    import qcompress as qc

    x, t = torch.randn(batch, width), torch.randn(batch, width)

    def stepper(model):
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)

        def step():
            loss = torch.nn.functional.mse_loss(model(x), t)
            opt.zero_grad()
            loss.backward()
            opt.step()

        return step

    variants = {"fp32": stepper(_mlp(width))}
    for name, fmt, bits, acts in [
        ("FP8 W8A8 (dynamic)", "fp8_e4m3", 8, True),
        ("NVFP4 W4A4", "nvfp4", 4, True),
        ("NVFP4 W4A16", "nvfp4", 4, False),
        ("MXFP4 W4A16", "mxfp4", 4, False),
        ("MXFP8 W8A8", "mxfp8", 8, True),
    ]:
        model = _mlp(width)
        cfg = _cfg(fmt, bits, acts)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            qc.init_compression(model, cfg)
        qc.CompressionScheduler(model, cfg).step()
        variants[name] = stepper(model)
    t = common.interleaved(variants, repeats=reps)
    lines = [
        f"QAT step of a 4-layer MLP ({width} wide, batch {batch}, float32), forward + backward + SGD; "
        "ms, and step time / FP32's.",
        "",
        "| variant | ms | vs FP32 |",
        "|---|---|---|",
        f"| FP32 | {t['fp32'].ms()} | 1.00x |",
    ]
    for name in variants:
        if name != "fp32":
            lines.append(f"| {name} | {t[name].ms()} | {common.ratio(t, name, 'fp32')} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=4096)
    p.add_argument("--cols", type=int, default=4096)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads (default torch's); 1 on a shared, loaded machine, where OpenMP "
        "barriers cost more than the work",
    )
    p.add_argument("--write-results", action="store_true", help="record the tables in benchmarks/results/formats.md")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    from qcompress.quant import kernels

    if not kernels.available():
        sys.exit(f"the csrc extension is not built (make build): {kernels.load_error()}")
    text = ""
    for dtype in (torch.float32, torch.bfloat16):
        text += fake_quant_table(a.rows, a.cols, dtype, a.reps) + "\n"
    text += step_table(a.width, a.batch, a.reps)
    print(text)
    if a.write_results:
        path = common.write_section("formats", "cpu", text, title="Float formats (FP8, NVFP4, MXFP4, MXFP8)")
        print(f"written: {path}")


if __name__ == "__main__":
    main()
