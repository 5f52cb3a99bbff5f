"""Which quantized gpt-oss expert layouts vLLM's own gpt-oss loader takes: a minimal reproduction.

    PYTHONPATH=. .venv-serve/bin/python benchmarks/vllm_gpt_oss_experts.py      # (make serve-check builds the venv)

Builds, without qcompress' export writer (torch, safetensors and a config.json by hand), a tiny
gpt-oss checkpoint per case whose experts are a compressed-tensors scheme written under the
per-expert names vLLM's gpt-oss loader streams (`model.layers.{l}.mlp.experts.{e}.w13_weight`, ...,
each tensor [in, out] or [out, in] as that loader's weight_loader expects for the MoE method), and
asks vLLM to build the model (its CompressedTensorsConfig picks the MoE method; missing CPU kernels
are stood in for, as `qcompress verify --vllm` does) and run its load_weights. Prints per case the
MoE method and what the loader did: every tensor taken, or where it stopped and with what error.
The biases are gpt-oss' own fused `experts.gate_up_proj_bias` / `down_proj_bias`.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402

E, H, I = 4, 128, 128


def _config(scheme: dict) -> dict:
    import transformers

    cfg = transformers.GptOssConfig(
        vocab_size=128,
        hidden_size=H,
        intermediate_size=I,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_local_experts=E,
        num_experts_per_tok=2,
        sliding_window=64,
        layer_types=["sliding_attention"],
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    out = cfg.to_dict()
    out["architectures"] = ["GptOssForCausalLM"]
    out["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
        "format": scheme["format"],
        "config_groups": {
            "experts": {
                **scheme,
                "targets": [r"re:^model\.layers\.\d+\.mlp\.experts\.\d+\.(?:gate_proj|up_proj|down_proj)$"],
            }
        },
        "ignore": [],
        "kv_cache_scheme": None,
    }
    return out


def _int8(w):  # per output row, [out, in] -> codes, scale [out, 1]
    s = w.abs().amax(1, keepdim=True) / 127
    return torch.round(w / s).clamp(-127, 127).to(torch.int8), s


def _fp8(w):
    s = w.abs().amax(1, keepdim=True) / 448
    return (w / s).to(torch.float8_e4m3fn), s


def _int4_packed(w, group=32, zero=False):  # [out, in] -> int32 packed (8 per word), scales [out, in/group]
    g = w.reshape(w.shape[0], -1, group)
    s = g.abs().amax(-1) / 7
    q = torch.round(g / s.unsqueeze(-1)).clamp(-8, 7).reshape(w.shape).to(torch.int32) + 8
    words = torch.zeros(w.shape[0], w.shape[1] // 8, dtype=torch.int32)
    for i in range(8):
        words |= (q[:, i::8] & 0xF) << (4 * i)
    out = {"weight_packed": words, "weight_scale": s}
    if zero:
        out["weight_zero_point"] = torch.zeros(w.shape[0] // 8, s.shape[1], dtype=torch.int32)
    return out


INT8 = {
    "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False},
    "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True},
    "format": "int-quantized",
}
FP8 = {
    "weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel", "dynamic": False},
    "input_activations": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token", "dynamic": True},
    "format": "float-quantized",
}
WNA16 = {
    "weights": {
        "num_bits": 4,
        "type": "int",
        "symmetric": True,
        "strategy": "group",
        "group_size": 32,
        "dynamic": False,
    },
    "input_activations": None,
    "format": "pack-quantized",
}
WNA16_ASYM = {**WNA16, "weights": {**WNA16["weights"], "symmetric": False}}


def _experts(case: str, sd: dict) -> None:
    """Replace the fused float experts of layer 0 by per-expert entries under vLLM's streamed names."""
    gate_up = sd.pop("model.layers.0.mlp.experts.gate_up_proj")  # [E, H, 2I] (in, out)
    down = sd.pop("model.layers.0.mlp.experts.down_proj")  # [E, I, H]
    for e in range(E):
        for name, w in (("w13", gate_up[e].t()), ("w2", down[e].t())):  # [out, in]
            key = f"model.layers.0.mlp.experts.{e}.{name}_"
            if case in ("int8", "fp8"):  # the loader transposes these: written [in, out]
                q, s = (_int8 if case == "int8" else _fp8)(w)
                sd[key + "weight"], sd[key + "weight_scale"] = q.t().contiguous(), s.t().contiguous()
            else:  # WNA16: taken as they are, [out, in]
                for k, t in _int4_packed(w, zero=case == "wna16_asym").items():
                    sd[key + k] = t.contiguous()


CASES = {"int8": INT8, "fp8": FP8, "wna16": WNA16, "wna16_asym": WNA16_ASYM}


def main() -> int:
    import transformers
    from safetensors.torch import save_file
    from qcompress.verify.vllm import run_worker

    rows = []
    for case, scheme in CASES.items():
        torch.manual_seed(0)
        cfg = _config(scheme)
        plain = {k: v for k, v in cfg.items() if k not in ("quantization_config", "architectures")}
        model = transformers.GptOssForCausalLM(transformers.AutoConfig.for_model(**plain))
        sd = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
        _experts(case, sd)
        with tempfile.TemporaryDirectory(prefix="qc-gptoss-") as folder:
            save_file(sd, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
            with open(os.path.join(folder, "config.json"), "w") as fh:
                json.dump(cfg, fh)
            res = run_worker(["load", folder, "--dtype", "float32"])
        method = next((c for n, c in res.get("layers", {}).items() if "experts" in n), "-")
        if "error" in res:
            what = f"not built: {res['error'][:160]}"
        elif "load_error" in res:
            what = f"load_weights stops at {res['load_error']['tensor']}: {res['load_error']['error'][:160]}"
        else:
            what = (
                "every tensor taken"
                if not res["dropped"] and not res["unloaded"]
                else f"dropped {res['dropped'][:2]}, unfilled {res['unloaded'][:2]}"
            )
        rows.append(f"| {case} | {method} | {what} |")
        print(rows[-1], flush=True)
    print("\n| experts | vLLM MoE method | vLLM's gpt-oss load_weights |\n|---|---|---|\n" + "\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
