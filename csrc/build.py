"""Extension build for setup.py: `extensions()` and `cmdclass()`.

The CPU extension is built when torch and a C++ compiler are present; the CUDA kernels are
added when torch has CUDA and nvcc exists (QCOMPRESS_CUDA=0/1 forces them off/on). Without a
compiler, `extensions()` returns [] and qcompress falls back to the pure-torch reference.
QCOMPRESS_CPU_ARCH=avx2|default picks the vector ISA (default: avx2 when this CPU has it).
"""

import glob
import os
import shutil
import sysconfig

ROOT = os.path.dirname(os.path.abspath(__file__))
REL = os.path.relpath(ROOT, os.getcwd()) if os.path.isabs(ROOT) else ROOT


def _have_compiler() -> bool:
    cxx = os.environ.get("CXX") or sysconfig.get_config_var("CXX") or "c++"
    return shutil.which(cxx.split()[0]) is not None


def _cpu_has_avx2() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return " avx2" in flags and " fma" in flags and " f16c" in flags


def _want_cuda() -> bool:
    forced = os.environ.get("QCOMPRESS_CUDA")
    if forced is not None:
        return forced == "1"
    import torch

    return bool(torch.version.cuda) and shutil.which("nvcc") is not None


def _sources(pattern):
    return sorted(os.path.relpath(p, os.getcwd()) for p in glob.glob(os.path.join(ROOT, pattern)))


def extensions():
    try:
        import torch  # noqa: F401
        from torch.utils.cpp_extension import CppExtension, CUDAExtension
    except ImportError:
        return []
    if not _have_compiler():
        return []
    arch = os.environ.get("QCOMPRESS_CPU_ARCH", "avx2" if _cpu_has_avx2() else "default")
    # -fopenmp: at::parallel_for is header-inline OpenMP; without it every kernel runs on one
    # thread. libgomp.so.1 resolves to the runtime torch already loaded (same soname), so
    # torch.set_num_threads governs our kernels too.
    cxx = ["-O3", "-g0", "-ffp-contract=off", "-fno-fast-math", "-fopenmp"]
    link = ["-fopenmp"]
    if arch == "avx2":
        cxx += ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"]
    include = [os.path.join(ROOT, "include"), ROOT]
    sources = _sources("ops.cpp") + _sources("autograd.cpp") + _sources("cpu/*.cpp")
    if _want_cuda():
        nvcc = ["-O3", "--fmad=false"]
        return [
            CUDAExtension(
                "qcompress._C",
                sources + _sources("cuda_ops.cpp") + _sources("cuda_floats.cpp") + _sources("cuda/*.cu"),
                include_dirs=include,
                define_macros=[("QC_WITH_CUDA", "1")],
                extra_compile_args={"cxx": cxx, "nvcc": nvcc},
                extra_link_args=link,
            )
        ]
    return [
        CppExtension(
            "qcompress._C", sources, include_dirs=include, extra_compile_args={"cxx": cxx}, extra_link_args=link
        )
    ]


def describe() -> str:
    """What extensions() builds, in a few lines: printed by the Makefile before the build (pip runs
    it quietly, and it takes minutes on a small CPU)."""
    exts = extensions()
    if not exts:
        return "qcompress: no C++ extension is built (no torch or no C++ compiler): the pure-torch reference runs"
    ext = exts[0]
    cuda = any(s.endswith(".cu") for s in ext.sources)
    arch = os.environ.get("QCOMPRESS_CPU_ARCH", "avx2" if _cpu_has_avx2() else "default")
    jobs = os.environ.get("MAX_JOBS")
    jobs = f"{jobs} at a time (MAX_JOBS)" if jobs else "in parallel (ninja; MAX_JOBS=N limits it)"
    lines = [
        f"qcompress: building the C++ extension {ext.name} ({'CPU and CUDA' if cuda else 'CPU'} kernels, "
        f"baseline vector ISA {arch}) from {len(ext.sources)} sources, {jobs}:"
    ]
    lines += [f"  {s}" for s in ext.sources]
    lines.append(
        "  the longest are the low-bit matmul tiles, compiled once per instruction set; see "
        "docs/development.md for the times measured"
    )
    return "\n".join(lines)


if __name__ == "__main__":  # `python csrc/build.py`: what the build will compile
    print(describe())


def cmdclass():
    try:
        from torch.utils.cpp_extension import BuildExtension
    except ImportError:
        return {}
    return {"build_ext": BuildExtension.with_options(no_python_abi_suffix=True)}
