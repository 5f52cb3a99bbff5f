// Reused page-aligned blocks for large CPU kernel outputs.
//
// torch's CPU allocator hands large requests to malloc, which maps fresh pages for them and
// returns them to the OS on free; writing a fresh 64 MB output then costs ~16K page faults, which
// took 6x longer than the fake-quant pass itself on the 2-core CI machine. QAT re-creates the
// same output sizes on every step (fake-quantized weights, straight-through gradients, 1-bit
// errors), so freed blocks are kept, bounded, and handed back for the next request of the same
// size (the same idea as the CUDA caching allocator).
//
// QCOMPRESS_CPU_CACHE_MB sets the bound on freed bytes kept (default 512; 0 disables the cache).
#pragma once

#include <ATen/ATen.h>

namespace qc {

// at::empty(sizes, opt) for CPU outputs; blocks of >= 4 MB come from the cache when it is on.
at::Tensor empty_reused(at::IntArrayRef sizes, const at::TensorOptions& opt);

}  // namespace qc
