"""What vLLM itself makes of an export, run in a child process (vLLM keeps process-wide state):

    python -m qcompress.verify.vllm_worker load FOLDER --dtype bfloat16 --out result.json
    python -m qcompress.verify.vllm_worker generate FOLDER --dtype bfloat16 --prompts p.json --out result.json

`load` builds the model with vLLM's own classes on the CPU (CompressedTensorsConfig picks each
layer's scheme and each experts layer's MoE method) and runs the model's load_weights over every
checkpoint tensor. Where vLLM has no kernel for a scheme on this machine (quantized MoE, NVFP4, MX
formats on a CPU), its backend selection is recorded and stood in for, so the weights still go
through the real weight loaders; process_weights_after_loading (kernel-specific repacking) is not
run. Every checkpoint tensor is followed (a TorchFunctionMode tags it and what is computed from it)
until it is written into a parameter; one that never is was dropped by the loader. With --dump,
the experts layers' parameters as the loader left them are written out, for the parent to compare
with load_quantized's weights (qcompress/verify/vllm_experts.py).
`generate` serves the export with vLLM's LLM (greedy, top-5 log-probabilities). Output: JSON.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import os
import pkgutil
import sys
import tempfile

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # one process: the parent waits for it
# vLLM's CPU backend runs WNA16 (W4A16) layers with int8-quantized activations on AMX CPUs unless
# told not to: the check serves the export's own scheme, 16-bit activations
os.environ.setdefault("VLLM_CPU_INT4_W4A8", "0")


def _amx_permission() -> None:
    """vLLM's 16-bit-activation WNA16 GEMM uses AMX tiles without asking Linux for them (oneDNN's
    AMX kernels ask; with none run before it, it dies of SIGILL): ask once, as oneDNN would."""
    import torch

    init = getattr(torch._C._cpu, "_init_amx", None)
    if init is not None:
        init()


def _patch_backend_selection(missing: list) -> None:
    """Wrap every `select_*backend` (MoE methods) and `init_*_kernel` / `choose_*kernel` (Linear
    schemes) that vLLM's compressed-tensors package calls: a failure (no kernel here) is recorded
    and answered with a stand-in, so the layer is still built and its weights loaded."""
    import vllm.model_executor.layers.quantization.compressed_tensors as ct

    for info in pkgutil.walk_packages(ct.__path__, ct.__name__ + "."):
        try:
            mod = importlib.import_module(info.name)
        except ImportError:  # a ROCm-only module
            continue
        for key, fn in list(vars(mod).items()):
            if not callable(fn):
                continue
            if key.startswith("select_") and key.endswith("backend"):
                setattr(mod, key, _standin(fn, key, missing, (None, None)))
            elif key.startswith(("init_", "choose_")) and key.endswith("kernel"):
                setattr(mod, key, _standin(fn, key, missing, _NoKernel()))


class _NoKernel:
    """Stands in for a Linear kernel (or its class) vLLM has none of here: every method answers None."""

    __name__ = "NoKernelHere"  # vLLM logs the chosen kernel class by name

    def __call__(self, *args, **kwargs):
        return self

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return lambda *args, **kwargs: None


def _standin(fn, key, missing, answer):
    @functools.wraps(fn)
    def call(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as err:  # noqa: BLE001 -- vLLM's own "no kernel" errors vary by format
            missing.append(f"{key}: {type(err).__name__}: {err}")
            return answer

    return call


class _Follow:
    """A TorchFunctionMode that tags checkpoint tensors, carries the tags through every op, and
    records a tag as consumed when its data is written into (or read as a scalar for) a parameter."""

    def __init__(self, targets):
        from torch.overrides import TorchFunctionMode
        import torch

        self.targets = targets  # storage pointers of the model's parameters and buffers
        self.consumed = set()
        outer = self

        class Mode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                tags = set()
                flat = list(args) + list(kwargs.values())
                for a in flat:
                    for t in a if isinstance(a, (list, tuple)) else (a,):
                        if isinstance(t, torch.Tensor):
                            tags |= getattr(t, "_qc_tags", set())
                out = func(*args, **kwargs)
                if tags:
                    name = getattr(func, "__name__", "")
                    if name in ("item", "tolist"):
                        outer.consumed |= tags
                    hits = [t for t in flat + [out] if isinstance(t, torch.Tensor) and outer._is_target(t)]
                    if hits:
                        outer.consumed |= tags
                    for o in out if isinstance(out, (list, tuple)) else (out,):
                        if isinstance(o, torch.Tensor):
                            try:
                                o._qc_tags = getattr(o, "_qc_tags", set()) | tags
                            except (AttributeError, RuntimeError):
                                pass
                return out

        self.mode = Mode()

    def _is_target(self, t) -> bool:
        try:
            return t.untyped_storage().data_ptr() in self.targets
        except (RuntimeError, NotImplementedError):
            return False


def _checkpoint_tensors(folder):
    from safetensors import safe_open

    index = os.path.join(folder, "model.safetensors.index.json")
    files = (
        sorted(set(json.load(open(index))["weight_map"].values())) if os.path.exists(index) else ["model.safetensors"]
    )
    for f in files:
        with safe_open(os.path.join(folder, f), "pt") as fh:
            for k in fh.keys():
                yield k, fh.get_tensor(k)


def _dump_experts(model, path: str) -> None:
    """Every experts layer's w13_* / w2_* parameters as vLLM's loader left them (before
    process_weights_after_loading repacks them for a kernel), to a safetensors file."""
    from safetensors.torch import save_file

    out = {}
    for name, mod in model.named_modules():
        if type(getattr(mod, "quant_method", None)).__name__.endswith("MoEMethod"):
            for pname, p in mod.named_parameters(recurse=False):
                if pname.startswith(("w13_", "w2_")) and p.numel():
                    out[f"{name}.{pname}"] = p.detach().cpu().contiguous()
    save_file(out, path)


def load_check(folder: str, dtype: str, dump: str = None) -> dict:
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    vcfg = EngineArgs(
        model=folder, skip_tokenizer_init=True, dtype=dtype, enforce_eager=True, max_model_len=64
    ).create_engine_config()
    with set_current_vllm_config(vcfg):
        init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            backend="gloo",
            distributed_init_method=f"file://{tempfile.mktemp(prefix='qc-vllm-')}",
        )
        initialize_model_parallel(1, 1)
    missing: list = []
    _patch_backend_selection(missing)
    out = {"missing_kernels": missing, "layers": {}, "dropped": [], "unloaded": []}
    with set_current_vllm_config(vcfg):
        with set_default_torch_dtype(vcfg.model_config.dtype), torch.device("cpu"):
            model = initialize_model(vllm_config=vcfg)
        # a MoE method whose backend selection found nothing for this machine answers NONE (FP8)
        # rather than raising: it fails at the first forward, so it is a missing kernel here
        for mod in model.modules():
            method = getattr(mod, "quant_method", None)
            for key, val in vars(method).items() if method is not None and hasattr(method, "__dict__") else ():
                if key.endswith("_backend") and str(getattr(val, "value", val)).upper() == "NONE":
                    missing.append(f"{key}: vLLM's {type(method).__name__} has no backend here")
        # vLLM runs `type: hadamard` online transforms with its hadacore op, built for CUDA only
        if any(type(m).__name__ == "HadamardTransform" for m in model.modules()) and not hasattr(
            torch.ops._C, "hadacore_transform"
        ):
            missing.append("hadacore_transform: vLLM's online Hadamard op is not in this build")
        for name, mod in model.named_modules():
            scheme = getattr(mod, "scheme", None)
            method = getattr(mod, "quant_method", None)
            if scheme is not None:
                out["layers"][name] = type(scheme).__name__
            elif method is not None and type(method).__name__ not in ("UnquantizedEmbeddingMethod",):
                out["layers"][name] = type(method).__name__
        # online transforms (transform_config) load into tensors a SharedWeightParameter shares
        # between layers and keeps in its `partitions`, not among the module's parameters
        shared = [p for m in model.modules() for p in getattr(getattr(m, "weight", None), "partitions", {}).values()]
        targets = {t.untyped_storage().data_ptr() for t in list(model.parameters()) + list(model.buffers()) + shared}
        follow = _Follow(targets)
        names = []

        def tagged():
            for k, t in _checkpoint_tensors(folder):
                t._qc_tags = {k}
                names.append(k)
                yield k, t

        try:
            with follow.mode:
                loaded = model.load_weights(tagged())
        except Exception as err:  # noqa: BLE001 -- the model was built: say where its loader stopped
            out["load_error"] = {"tensor": names[-1] if names else None, "error": f"{type(err).__name__}: {err}"}
            return out
    out["dropped"] = [k for k in names if k not in follow.consumed]
    params = {n for n, _ in model.named_parameters()}
    kv_placeholders = (".k_scale", ".v_scale", ".q_scale", ".k_zero_point", ".v_zero_point", ".q_zero_point")
    # the MoE methods' w13/w2_weight_shape parameters: filled from a checkpoint's weight_shape where
    # one is written, and read by nothing after loading (the packed parameters' shapes fix them)
    unread = (".w13_weight_shape", ".w2_weight_shape")
    # NVFP4 MoE methods register per-expert input global scales for W4A16 too (use_a16), and the
    # A16 kernels never read them; llm-compressor's NVFP4A16 checkpoints carry none either
    a16 = tuple(
        f"{name}.{p}"
        for name, mod in model.named_modules()
        if getattr(getattr(mod, "quant_method", None), "use_a16", False)
        for p in ("w13_input_global_scale", "w2_input_global_scale")
    )
    out["unloaded"] = sorted(
        p
        for p in params - set(loaded or ())
        if not p.endswith(unread)
        and p not in a16
        and not (
            vcfg.model_config.hf_config.to_dict().get("quantization_config", {}).get("kv_cache_scheme") is None
            and p.endswith(kv_placeholders)
        )
    )
    if dump:
        _dump_experts(model, dump)
    return out


def generate(folder: str, dtype: str, prompts, steps: int) -> dict:
    """Greedy generation; `prompts` is a list of token-id lists (one batch) or {"runs": [batch, ...]},
    each batch one generate call (batch 1 and batch 8 in one process)."""
    runs = prompts["runs"] if isinstance(prompts, dict) else [prompts]
    from vllm import LLM, SamplingParams

    with open(os.path.join(folder, "config.json")) as fh:
        positions = int(json.load(fh).get("max_position_embeddings") or 128)
    llm = LLM(
        model=folder,
        skip_tokenizer_init=True,
        dtype=dtype,
        enforce_eager=True,
        max_model_len=min(128, positions),
        max_num_seqs=max(8, max(len(r) for r in runs)),
        seed=0,
        kv_cache_memory_bytes=64 << 20,
    )
    sp = SamplingParams(max_tokens=steps, temperature=0.0, logprobs=5, detokenize=False)
    results = []
    for batch in runs:
        outs = llm.generate([{"prompt_token_ids": list(p)} for p in batch], sp, use_tqdm=False)
        res = []
        for o in outs:
            c = o.outputs[0]
            res.append(
                {
                    "tokens": list(c.token_ids),
                    "logprobs": [{str(t): float(lp.logprob) for t, lp in step.items()} for step in c.logprobs],
                }
            )
        results.append(res)
    return {"outputs": results[0], "runs": results}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m qcompress.verify.vllm_worker")
    p.add_argument("what", choices=("load", "generate"))
    p.add_argument("folder")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--prompts")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--out", required=True)
    p.add_argument("--dump", help="load: write the experts layers' parameters to this safetensors file")
    a = p.parse_args(argv)
    _amx_permission()
    try:
        if a.what == "load":
            result = load_check(a.folder, a.dtype, a.dump)
        else:
            with open(a.prompts) as fh:
                result = generate(a.folder, a.dtype, json.load(fh), a.steps)
    except Exception as err:  # noqa: BLE001 -- vLLM's refusal is the result
        result = {"error": f"{type(err).__name__}: {err}"}
    with open(a.out, "w") as fh:
        json.dump(result, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
