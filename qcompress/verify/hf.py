"""`qcompress verify --transformers`: the export through transformers' from_pretrained.

With compressed-tensors decompressing on load (`dequantize=True`), every quantized weight must
equal load_quantized's bit for bit; plain from_pretrained must generate load_quantized's greedy
tokens (compressed-tensors quantizes int8 activations with absmax / 127.5 where qcompress and vLLM
divide by 127, so a near-tie may flip). Experts with quantized inputs run unquantized there
(compressed-tensors quantizes the inputs of Linear modules only): reported as a silent dequantization.
"""

from __future__ import annotations

import warnings

from .export import Export
from .report import ConsumerResult, Report


def check_transformers(export: Export, report: Report, reference=None) -> None:
    res = report.consumers.setdefault("transformers", ConsumerResult())
    try:
        import torch
        import transformers
        from ..export.hf_compat import dequantize_config
    except ImportError as err:
        res.detail = f"transformers is not importable ({err})"
        report.problem("transformers", "(export)", f"--transformers asked, but it is not importable ({err})")
        return
    arch = (export.config.get("architectures") or [None])[0]
    cls = getattr(transformers, arch, None) if isinstance(arch, str) else None
    if cls is None:
        res.detail = f"no transformers class {arch!r}"
        report.problem("transformers", "(model)", f"transformers has no class {arch!r}")
        return
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            hf = cls.from_pretrained(
                export.folder, quantization_config=dequantize_config(), dtype=torch.float32, local_files_only=True
            ).eval()
    except Exception as err:  # noqa: BLE001 -- a refusal is the answer
        res.loads = False
        res.detail = f"refuses: {type(err).__name__}: {str(err).splitlines()[0][:200]}"
        report.problem(
            "transformers",
            "(model)",
            f"from_pretrained refuses the export ({type(err).__name__}: {str(err).splitlines()[0][:200]})",
        )
        return
    res.loads = True
    if reference is not None:
        _compare_weights(export, report, hf, reference)
    for label, row in report.rows.items():
        if row.kind == "experts" and " / A" in row.scheme and "A16" not in row.scheme:
            row.consumers["transformers"] = "weights decompressed, inputs NOT quantized"
            report.problem(
                "transformers",
                label,
                "quantized inputs of experts run unquantized in transformers "
                "(compressed-tensors quantizes Linear inputs only)",
            )
        else:
            row.consumers.setdefault("transformers", "decompressed to load_quantized's weights")
    if reference is None or not type(hf).__name__.endswith("ForCausalLM"):
        return
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plain = cls.from_pretrained(export.folder, dtype=torch.float32, local_files_only=True).eval()
        how = "plain from_pretrained"
        if _drops_transforms(export, report):
            from ..export.rotations import apply_to_transformers

            apply_to_transformers(plain, export.folder)
            how += " + apply_transform_config"
        from .offline import greedy, probe_ids
        from .vllm import compare

        ids = probe_ids(export.config, batch=2)
        want = greedy(reference, ids, 4)
        got_tokens, got_lps = greedy(plain, ids, 4)
        outs = [
            {
                "tokens": got_tokens[i].tolist(),
                "logprobs": [
                    {str(int(t)): float(got_lps[i, s, t]) for t in got_lps[i, s].topk(5).indices}
                    for s in range(got_tokens.shape[1])
                ],
            }
            for i in range(ids.shape[0])
        ]
        cmp = compare(want, outs, tol=0.1)
        res.generates = True
        res.detail = (
            f"{how}: greedy tokens equal in {cmp['equal_seqs']}/{cmp['seqs']} sequences, "
            f"top-5 log-prob max diff {cmp['max_lp_diff']:.2e}"
        )
        for line in cmp["problems"]:
            if line.startswith("sequence"):
                report.problem("transformers", "(generation)", line)
    except Exception as err:  # noqa: BLE001
        res.generates = False
        report.problem(
            "transformers",
            "(generation)",
            f"plain from_pretrained fails: {type(err).__name__}: {str(err).splitlines()[0][:200]}",
        )


def _compare_weights(export: Export, report: Report, hf, reference) -> None:
    """Each quantized weight as transformers decompressed it against load_quantized's."""
    import torch

    ref_mods = dict(reference.named_modules())
    hf_mods = dict(hf.named_modules())
    for name, rec in export.modules.items():
        if rec.get("weights") is None or name not in ref_mods:
            continue
        if name not in hf_mods:
            report.problem("transformers", name, "no such module in the model transformers builds")
            continue
        a = hf_mods[name].weight.detach().float()
        b = ref_mods[name].weight.detach().float()
        if a.shape == b.shape and _bf16_rounded(a, b):
            report.use(name, "transformers", "decompressed in bfloat16 (load_quantized's weights, rounded)")
            continue
        if a.shape != b.shape or not torch.equal(a, b):
            report.problem("transformers", name, "decompressed weight differs from load_quantized's")
    ref_params = dict(reference.named_parameters())
    hf_params = dict(hf.named_parameters())
    for pname, rec in export.experts.items():
        if rec.get("weights") is None or pname not in ref_params:
            continue
        a, b = hf_params.get(pname), ref_params[pname]
        if a is not None and a.shape == b.shape and _bf16_rounded(a, b):
            report.use(pname, "transformers", "decompressed in bfloat16 (load_quantized's experts, rounded)")
            continue
        if a is None or a.shape != b.shape or not torch.equal(a.detach().float(), b.detach().float()):
            report.problem(
                "transformers", pname, "decompressed experts differ from load_quantized's" + _unscaled_nvfp4(rec, a, b)
            )


def _bf16_rounded(a, b) -> bool:
    """compressed-tensors decompresses the FP4 formats in bfloat16: `a` is then load_quantized's
    `b` rounded to bfloat16 (and differs from it)."""
    import torch

    a, b = a.detach().float(), b.detach().float()
    return not torch.equal(a, b) and torch.equal(a, b.to(torch.bfloat16).float())


def _unscaled_nvfp4(rec: dict, a, b) -> str:
    """The reason when transformers' NVFP4 experts are load_quantized's times a large factor per
    expert: its expert decompression (CompressedTensorsDequantize) builds each expert from
    weight_packed and weight_scale only, so the per-tensor weight_global_scale is never divided out
    (transformers 5.23; llm-compressor's NVFP4 MoE checkpoints load the same way). "" otherwise."""
    w = rec.get("weights") or {}
    if (
        a is None
        or a.shape != b.shape
        or a.dim() != 3
        or not (w.get("type") == "float" and w.get("num_bits") == 4 and w.get("group_size") == 16)
    ):
        return ""
    ratio = a.detach().float().abs().amax(dim=(1, 2)) / b.detach().float().abs().amax(dim=(1, 2)).clamp_min(1e-30)
    if not bool((ratio > 8).all()):
        return ""
    return (
        f" (by {float(ratio.min()):.0f}x to {float(ratio.max()):.0f}x per expert: transformers' expert "
        "decompression passes no weight_global_scale, so NVFP4 experts are not divided by it; a "
        "transformers defect, vLLM reads them right)"
    )


def _drops_transforms(export: Export, report: Report) -> bool:
    """transformers' from_pretrained drops transform_config (online rotations) without a word: a
    problem of that consumer, named by the rotated modules. True when the export has one."""
    groups = (export.qc.get("transform_config") or {}).get("config_groups") or {}
    targets = sorted(
        {t for scheme in groups.values() for entry in scheme.get("apply", []) for t in entry.get("targets", [])}
    )
    if not targets:
        return False
    more = f" (and {len(targets) - 1} more)" if len(targets) > 1 else ""
    report.problem(
        "transformers",
        targets[0] + more,
        "from_pretrained drops quantization_config.transform_config (the online rotation): its "
        "outputs differ from the trained model's unless compressed_tensors.transform."
        "apply_transform_config runs after loading (qcompress.export.rotations.apply_to_transformers"
        "(model, folder) does it); the generation below is measured with it applied",
    )
    return True
