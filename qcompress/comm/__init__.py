"""Compressed collectives on torch.distributed (gloo on CPU, NCCL on GPU; same code).

    state = qcompress.comm.OneBitState()                 # one per buffer: worker + server errors
    avg = qcompress.comm.compressed_allreduce(t, state)  # 1-bit, error-compensated average
    qcompress.comm.stats()  -> {"bytes_sent": ..., "bytes_received": ...}; reset_stats()
    bc = qcompress.comm.BucketedCompressor(bucket_size=2**24); outs = bc.allreduce(list_of_tensors)

Algorithm: see qcompress.comm.flat (two collectives per call: one all_to_all_single, one
all_gather_into_tensor; scales ride inside the payload bytes; padding to a multiple of 8 * P).
Hierarchical mode (reduce in the node, compress across nodes, broadcast back): qcompress.comm.hierarchy.
Byte counting rule: qcompress.comm.stats. DDP: qcompress.comm.ddp_hook.

Compressor interface (register your own with register_compressor(name, cls); cls() must build one;
subclassing qcompress.comm.Compressor gives decompress_average for free):
    name: str                      the registry name (errors are tied to it)
    elem_multiple: int             every chunk length is a multiple of this (1 bit: 8)
    payload_nbytes(numel) -> int   bytes of one payload row for a chunk of numel elements
    compress(x, error, chunks) -> (payload uint8 [chunks, payload_nbytes(len(x) // chunks)],
                                   new_error float32 [len(x)])
        x, error: flat float32 of equal length (a multiple of chunks * elem_multiple). Compress
        y = x + error; row i covers elements [i*c, (i+1)*c) and must carry its own scales;
        new_error = y - (what the receiver will decode). Must be deterministic and must not write
        into x or error (callers keep the old error tensor to roll back a failed call).
    decompress(payload uint8 [k, B], numel) -> float32 [k, numel]   each row decoded on its own
    decompress_average(payload, numel) -> float32 [numel]           optional; default: rows summed in
                                                                    order 0..k-1, then divided by k
    payload_finite(payload) -> bool | None   optional: whether decompress(payload) is finite, judged
                                             from the scales alone (None / absent: decode and check)
Non-finite results raise qcompress.NonFiniteError on every rank and leave the errors unchanged.
Built in: "onebit" (signs + one RMS scale per worker buffer / server chunk; the kernels' ops when
built, qcompress.quant.onebit otherwise) and "int8" (symmetric, one absmax/127 scale per chunk).
"""

from .allreduce import OneBitState, compressed_allreduce, padded_length
from .bucket import DEFAULT_BUCKET_SIZE, BucketedCompressor
from .compressors import (
    Compressor,
    Int8Compressor,
    OneBitCompressor,
    available_compressors,
    get_compressor,
    register_compressor,
)
from .ddp_hook import OneBitDDPHookState, onebit_ddp_hook
from .hierarchy import Hierarchy, nodes_from_hostnames
from .stats import reset_stats, stats

OneBitDDPState = OneBitDDPHookState  # short alias

__all__ = [
    "OneBitState",
    "compressed_allreduce",
    "padded_length",
    "BucketedCompressor",
    "DEFAULT_BUCKET_SIZE",
    "Compressor",
    "OneBitCompressor",
    "Int8Compressor",
    "register_compressor",
    "get_compressor",
    "available_compressors",
    "OneBitDDPHookState",
    "OneBitDDPState",
    "onebit_ddp_hook",
    "Hierarchy",
    "nodes_from_hostnames",
    "stats",
    "reset_stats",
]
