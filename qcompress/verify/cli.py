"""`qcompress verify EXPORT [--vllm] [--transformers] [--json]` (qcompress/cli.py dispatches here).

Exit status: 0 every consumer checked reads every quantized module as exported; 1 one refuses,
loads wrong weights, runs a module unquantized or generates other tokens (each problem names the
module and the reason); 2 bad input (not an export, a truncated shard, a config that contradicts
the tensors): one line naming the file and tensor. Nothing is written.
"""

from __future__ import annotations

import argparse
import json
import sys


def parser(p=None):
    p = p or argparse.ArgumentParser(prog="qcompress verify")
    p.description = (
        "For every quantized module of an export: the scheme each consumer uses and whether "
        "the export loads and generates there."
    )
    p.add_argument("path", help="export folder")
    p.add_argument(
        "--vllm",
        action="store_true",
        help="also resolve, load and (where this machine has the kernels) run it with vLLM's own classes",
    )
    p.add_argument("--transformers", action="store_true", help="also load it with transformers' from_pretrained")
    p.add_argument("--vllm-dtype", default=None, help="dtype vLLM serves in (default: bfloat16 for int formats)")
    p.add_argument("--no-load", action="store_true", help="skip loading with load_quantized (tensors are still read)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    return p


def main_verify(argv=None) -> int:
    from ..export.errors import CheckpointError
    from . import verify

    a = parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        report = verify(a.path, vllm=a.vllm, transformers=a.transformers, load=not a.no_load, vllm_dtype=a.vllm_dtype)
    except CheckpointError as err:
        print(f"qcompress verify: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    print(json.dumps(report.to_dict(), indent=2) if a.json else report.format())
    return report.exit_code


if __name__ == "__main__":
    sys.exit(main_verify())
