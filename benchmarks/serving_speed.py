"""Decode speed of load_quantized(mode="fast") against vLLM's CPU backend on the same exports.

    PYTHONPATH=. .venv-serve/bin/python benchmarks/serving_speed.py            # (make serve-check builds the venv)
    PYTHONPATH=. .venv-serve/bin/python benchmarks/serving_speed.py --tokens 32 --rounds 3 --write-results

A Llama-shaped model of --layers x --hidden (default 12 x 768, 12 heads / 4 KV heads, SwiGLU 2048,
vocab 32000, untied: 124 M parameters; random weights, which decode at the speed of trained ones)
is exported as FP32 (save_pretrained), W8A8 (schedules/w8a8.yaml) and W4A16 g128
(schedules/w4a16_g128.yaml). Each is decoded greedily for --tokens tokens after an 8-token prompt
at batch 1 and batch 8, by
- qcompress: transformers' generate (KV cache, no EOS token) on load_quantized(folder, model,
  mode="fast") (FP32: the plain transformers model), float32 and bfloat16 eager, and compiled in
  vLLM's dtype (torch.compile of the forward, C++ wrapper, transformers' static cache: docs/export.md);
- vLLM CPU (in this process, VLLM_ENABLE_V1_MULTIPROCESSING=0): LLM.generate with ignore_eos,
  float32 for FP32, bfloat16 for W8A8 / W4A16 (its CPU kernels take bfloat16 only).
Rounds alternate between all of them (benchmarks/common.py: interleaved), on one machine that other
jobs may share: the ratios (qcompress tokens/s over vLLM tokens/s, median of the per-round ratios)
are the result, not the absolute times. --isa avx2 (default on) holds both to AVX2: ATEN_CPU_CAPABILITY,
ONEDNN_MAX_CPU_ISA and qcompress' own QCOMPRESS_LOWBIT_ISA, set before torch is imported, and
torch.cpu's AVX-512 / AMX checks answering False, which makes vLLM load its AVX2 kernel library and
pick its non-AMX kernels, as on an AVX2 machine. --isa native: each at its best on this CPU.
Writes section "llama-124m" of benchmarks/results/serving.md with --write-results.
"""

from __future__ import annotations

import argparse
import os
import sys


def _early_env(argv):
    """The ISA caps must be set before torch (and oneDNN) load."""
    if "--isa" in argv and argv[argv.index("--isa") + 1] == "native":
        return
    os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")
    os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX2")
    os.environ.setdefault("QCOMPRESS_LOWBIT_ISA", "avx2")


_early_env(sys.argv)
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import common  # noqa: E402

import torch  # noqa: E402

import qcompress  # noqa: E402


def _cap_vllm(argv):
    """vLLM picks its kernel library (_C, _C_AVX512, _C_AVX2) and its AMX kernels from torch.cpu's
    feature checks, which read the CPU itself: under the AVX2 cap they answer as an AVX2 machine's
    would, so vLLM loads its AVX2 library and non-AMX kernels (oneDNN, capped too, would refuse
    its AMX ones)."""
    if "--isa" in argv and argv[argv.index("--isa") + 1] == "native":
        return
    for name in (
        "_is_avx512_supported",
        "_is_avx512_bf16_supported",
        "_is_avx512_vnni_supported",
        "_is_amx_tile_supported",
        "_is_amx_fp16_supported",
    ):
        if hasattr(torch.cpu, name):
            setattr(torch.cpu, name, lambda: False)


_cap_vllm(sys.argv)


def llama(args):
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=32000,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 8 // 3 // 64 * 64,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(1, args.hidden // 64 // 3),
        head_dim=64,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def make_exports(args, work):
    import warnings

    out = {}
    fp = os.path.join(work, "fp32")
    if not os.path.exists(os.path.join(fp, "config.json")):
        llama(args).save_pretrained(fp)
    out["FP32"] = fp
    for name, recipe in (("W8A8", "w8a8"), ("W4A16", "w4a16_g128")):
        out[name] = path = os.path.join(work, recipe)
        if os.path.exists(os.path.join(path, "config.json")):  # --work: exports of an earlier run
            continue
        model = llama(args)
        cfg = qcompress.load_config(os.path.join(common.ROOT, "schedules", recipe + ".yaml"))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            qcompress.init_compression(model, cfg)
            qcompress.redundancy_clean(model, cfg)
            qcompress.export_quantized(model, path, cfg, force=True)
    return out


def qcompress_decoder(name, folder, args, dtype=torch.float32, compiled=False):
    """generate() on load_quantized(mode="fast") (FP32: the plain transformers model); compiled:
    its forward under torch.compile with transformers' static KV cache (fixed shapes, one graph per
    batch size and step kind), as docs/export.md shows."""
    import transformers

    if name == "FP32":
        model = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    else:
        model = qcompress.load_quantized(folder, llama(args).to(dtype), mode="fast")
    prompts = torch.randint(0, 32000, (8, 8), generator=torch.Generator().manual_seed(1))
    # no end-of-sequence token, as vLLM's ignore_eos: every step decodes, none checks for EOS (a
    # min_new_tokens instead would mask the EOS logit over the whole vocabulary at every step)
    model.generation_config.eos_token_id = None
    kwargs = {}
    if compiled:  # the recipe of docs/export.md: C++ wrapper, no Python between the step's kernels
        model.forward = torch.compile(model.forward, fullgraph=True, options={"cpp_wrapper": True})
        kwargs = {"cache_implementation": "static"}

    def run(batch):
        with torch.inference_mode():
            out = model.generate(prompts[:batch], max_new_tokens=args.tokens, do_sample=False, pad_token_id=0, **kwargs)
        assert out.shape[1] == prompts.shape[1] + args.tokens

    return run


def vllm_decoder(name, folder, args):
    from vllm import LLM, SamplingParams

    dtype = "float32" if name == "FP32" else "bfloat16"
    llm = LLM(
        model=folder,
        skip_tokenizer_init=True,
        dtype=dtype,
        max_model_len=256,
        max_num_seqs=8,
        seed=0,
        kv_cache_memory_bytes=256 << 20,
        enforce_eager=args.eager,
    )
    sp = SamplingParams(
        max_tokens=args.tokens, min_tokens=args.tokens, ignore_eos=True, temperature=0.0, detokenize=False
    )
    prompts = torch.randint(0, 32000, (8, 8), generator=torch.Generator().manual_seed(1)).tolist()

    def run(batch):
        llm.generate([{"prompt_token_ids": p} for p in prompts[:batch]], sp, use_tqdm=False)

    return run, llm


def vllm_failure(err: BaseException) -> str:
    """What vLLM lacks, in one line. torch.compile wraps the kernel's own error, through causes and
    contexts, some of them with no message: the deepest error that has one says what is missing."""
    chain = [err]
    while chain[-1].__cause__ is not None or chain[-1].__context__ is not None:
        chain.append(chain[-1].__cause__ or chain[-1].__context__)
    err = next((e for e in reversed(chain) if str(e).strip()), err)
    return " ".join(f"{type(err).__name__}: {err}".split())[:160]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--isa", choices=("avx2", "native"), default="avx2")
    p.add_argument("--eager", action="store_true", help="vLLM without torch.compile (enforce_eager)")
    p.add_argument("--schemes", nargs="+", default=["W4A16", "W8A8", "FP32"])
    p.add_argument("--write-results", action="store_true")
    p.add_argument("--work", default=None, help="keep the exports in this folder (and reuse them)")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    import tempfile

    lines = [
        f"Llama-shaped {a.layers} x {a.hidden} (random weights), {a.tokens} tokens after an 8-token prompt, "
        f"no EOS, ISA cap {a.isa}, {a.threads} threads, {a.rounds} interleaved rounds. qcompress: generate() on "
        'load_quantized(mode="fast") in float32 and in bfloat16 (the model loaded in bfloat16: the '
        "unquantized layers, lm_head above all, then read half the bytes, as in vLLM), eager and compiled "
        "(torch.compile of its forward, transformers' static KV cache; the FP32 export: the plain transformers "
        "model). vLLM CPU: bfloat16 for W8A8 / W4A16 (its kernels' only dtype), float32 for FP32, with its "
        "defaults (torch.compile; on AMX CPUs W4A16 layers run with int8 activations, VLLM_CPU_INT4_W4A8=1). "
        "Shared machine: the ratios are the result.",
        "",
        "| export | batch | qcompress | qcompress tok/s | vLLM CPU tok/s | qcompress / vLLM |",
        "|---|---|---|---|---|---|",
    ]
    with tempfile.TemporaryDirectory(prefix="qc-speed-") as tmp:
        work = a.work or tmp
        exports = make_exports(a, work)
        # every compiled model's forward is the same code object (transformers' wrapper): each export
        # adds its dtypes x batch sizes x (prefill, decode) graphs to one cache, whose default limit
        # of 8 the second export would hit; the earlier exports' graphs are not needed again
        torch._dynamo.config.recompile_limit = 32
        for name in a.schemes:
            torch._dynamo.reset()
            dtypes = (torch.float32,) if name == "FP32" else (torch.float32, torch.bfloat16)
            ours = {}  # label -> decoder
            for dt in dtypes:
                ours["float32" if dt == torch.float32 else "bfloat16"] = qcompress_decoder(name, exports[name], a, dt)
            # compiled: in vLLM's dtype (bfloat16 for the quantized exports, float32 for FP32)
            ours[f"{'float32' if name == 'FP32' else 'bfloat16'}, compiled"] = qcompress_decoder(
                name, exports[name], a, dtypes[-1], compiled=True
            )
            v, _llm, failed = None, None, ""
            try:
                v, _llm = vllm_decoder(name, exports[name], a)  # _llm: held so vLLM lives until the rows are timed
                v(1)
            except Exception as err:  # noqa: BLE001 -- vLLM has no kernel for it here: a result
                v, failed = None, vllm_failure(err)
            for batch in (1, 8):  # where vLLM fails, qcompress alone: what this export decodes at here
                fns = {label: (lambda b=batch, f=f: f(b)) for label, f in ours.items()}
                if v is not None:
                    fns["vllm"] = lambda b=batch: v(b)
                for f in fns.values():  # warm-up (compilation, caches)
                    f()
                t = common.interleaved(fns, repeats=a.rounds)
                tps = {k: batch * a.tokens / t[k].median for k in t}
                for label in ours:
                    if v is None:
                        row = f"| {name} | {batch} | {label} | {tps[label]:.1f} | vLLM fails: {failed} | - |"
                    else:
                        row = (
                            f"| {name} | {batch} | {label} | {tps[label]:.1f} | {tps['vllm']:.1f} | "
                            f"{common.ratio(t, 'vllm', label)} |"
                        )
                    print(row, flush=True)
                    lines.append(row)
            _llm = v = None  # free vLLM before the next export
    text = "\n".join(lines) + "\n"
    print(text)
    if a.write_results:
        common.write_section(
            "serving", f"llama-124m-{a.isa}", text, title="Decode speed: load_quantized fast vs vLLM CPU"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
