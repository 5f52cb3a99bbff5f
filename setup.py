"""Build qcompress and, when a C++ compiler is present, its csrc/ extension.

QCOMPRESS_CUDA=0/1 forces the CUDA extension off/on (default: on when torch has CUDA and nvcc
exists). QCOMPRESS_PURE_PYTHON=1 (or its older name QCOMPRESS_NO_EXT=1) skips the C++ extension:
a pure-Python install on the pure-torch reference, asked for by name (`make test PURE_PYTHON=1`).
"""

import os

from setuptools import find_packages, setup

REQUIRES = ["torch>=2.4", "safetensors>=0.4", "pyyaml>=6", "einops>=0.7", "tqdm>=4.60", "numpy"]
EXTRAS = {
    "test": [
        "pytest>=7",
        "pytest-timeout",
        "scikit-learn",
        "mlxtend",
        "transformers>=4.45",
        "compressed-tensors>=0.15",
        "accelerate>=1.1",
        "peft>=0.21",
    ],
    "hf": ["transformers>=4.45", "compressed-tensors>=0.15", "accelerate>=1.1"],  # Trainer needs accelerate
    "plot": ["matplotlib"],
    "lora": ["peft>=0.21"],  # mode qlora's adapter files load with peft; peft-wrapped models
}


def extensions():
    """Build descriptions of the C++/CUDA extension (see csrc/build.py), or [] when not buildable."""
    if "1" in (os.environ.get("QCOMPRESS_PURE_PYTHON"), os.environ.get("QCOMPRESS_NO_EXT")):
        return [], {}
    try:
        import csrc_build  # noqa: F401  (csrc/build.py is exposed under this name below)
    except ImportError:
        pass
    try:
        import importlib.util

        spec = importlib.util.spec_from_file_location("qc_csrc_build", os.path.join("csrc", "build.py"))
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod.extensions(), mod.cmdclass()
    except FileNotFoundError:
        return [], {}


ext_modules, cmdclass = extensions()

setup(
    name="qcompress",
    version="0.1.0",
    description="Quantization-aware compression training for PyTorch",
    # the recipes stay in schedules/ at the top of the checkout (where the docs point) and are
    # installed inside the package as qcompress/schedules, where load_config finds them by name
    packages=find_packages(include=["qcompress", "qcompress.*"]) + ["qcompress.schedules"],
    package_dir={"qcompress.schedules": "schedules"},
    # DeepSpeed 0.19's config keys, which load_config accepts (qcompress/config/deepspeed_schema.py)
    package_data={"qcompress.config": ["deepspeed_0_19_keys.json"], "qcompress.schedules": ["*.yaml", "README.md"]},
    python_requires=">=3.10",
    install_requires=REQUIRES,
    extras_require=EXTRAS,
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    entry_points={"console_scripts": ["qcompress=qcompress.cli:main"]},
)
