#include "block_cache.h"

#include <sys/mman.h>

#include <cstdlib>
#include <deque>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace qc {
namespace {

constexpr size_t kAlign = size_t{1} << 21;  // 2 MB: huge-page sized and aligned
constexpr size_t kMinBytes = 2 * kAlign;    // smaller outputs stay with malloc (it reuses them)

size_t limit_from_env() {
  const char* v = std::getenv("QCOMPRESS_CPU_CACHE_MB");
  if (v == nullptr || *v == '\0') return size_t{512} << 20;
  try {
    const long long mb = std::stoll(v);
    return mb <= 0 ? 0 : static_cast<size_t>(mb) << 20;
  } catch (...) {
    return size_t{512} << 20;  // unparsable: the default (the Python side warns about it)
  }
}

class BlockCache {
 public:
  BlockCache() : limit_(limit_from_env()) {}

  bool enabled() const { return limit_ > 0; }

  void* get(size_t len) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto it = free_.begin(); it != free_.end(); ++it) {
        if (it->first == len) {
          void* p = it->second;
          cached_ -= len;
          free_.erase(it);
          return p;
        }
      }
    }
    void* p = nullptr;
    if (posix_memalign(&p, kAlign, len) != 0) return nullptr;
#if defined(MADV_HUGEPAGE)
    madvise(p, len, MADV_HUGEPAGE);  // advisory: ignored where transparent huge pages are off
#endif
    return p;
  }

  void put(void* p, size_t len) {
    std::vector<void*> drop;
    {
      std::lock_guard<std::mutex> lock(mu_);
      free_.emplace_back(len, p);
      cached_ += len;
      while (cached_ > limit_ && !free_.empty()) {  // oldest first
        cached_ -= free_.front().first;
        drop.push_back(free_.front().second);
        free_.pop_front();
      }
    }
    for (void* q : drop) std::free(q);
  }

 private:
  const size_t limit_;
  std::mutex mu_;
  std::deque<std::pair<size_t, void*>> free_;
  size_t cached_ = 0;
};

BlockCache& cache() {
  static BlockCache* c = new BlockCache();  // never destroyed: tensors may outlive static teardown
  return *c;
}

}  // namespace

at::Tensor empty_reused(at::IntArrayRef sizes, const at::TensorOptions& opt) {
  int64_t n = 1;
  for (int64_t s : sizes) n *= s;
  const size_t bytes = static_cast<size_t>(n) * at::elementSize(at::typeMetaToScalarType(opt.dtype()));
  if (!opt.device().is_cpu() || bytes < kMinBytes || !cache().enabled()) return at::empty(sizes, opt);
  const size_t len = (bytes + kAlign - 1) / kAlign * kAlign;
  void* p = cache().get(len);
  if (p == nullptr) return at::empty(sizes, opt);
  return at::from_blob(p, sizes, [len](void* q) { cache().put(q, len); }, opt);
}

}  // namespace qc
