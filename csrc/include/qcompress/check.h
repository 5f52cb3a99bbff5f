// QC_CHECK(cond, parts...): TORCH_CHECK with a message built without std::ostream number
// formatting. Some torch builds carry their own copy of libstdc++ (torch 2.11.0+cu130 on the
// H100 image we test on): an extension that formats an integer into an ostream there looks up
// the num_put facet with the other copy's facet id and crashes (SIGSEGV in
// basic_ostream::_M_insert<long>, seen under cuda-gdb), so every TORCH_CHECK that printed a
// number turned a clear error into a segfault. Numbers, shapes and dtypes become std::string
// here (to_string / snprintf); TORCH_CHECK then only streams one string.
#pragma once

#include <cstdio>
#include <string>
#include <type_traits>
#include <vector>

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>

namespace qc {
namespace msg {

inline std::string part(const char* s) { return s; }
inline std::string part(const std::string& s) { return s; }
inline std::string part(char c) { return std::string(1, c); }
inline std::string part(bool b) { return b ? "1" : "0"; }
template <typename T, std::enable_if_t<std::is_integral_v<T> && !std::is_same_v<T, bool> &&
                                       !std::is_same_v<T, char>, int> = 0>
inline std::string part(T v) { return std::to_string(v); }
inline std::string part(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);   // as an ostream's default precision 6
  return buf;
}
inline std::string part(c10::IntArrayRef a) {
  std::string s = "[";
  for (size_t i = 0; i < a.size(); ++i) s += (i ? ", " : "") + std::to_string(a[i]);
  return s + "]";
}
inline std::string part(const std::vector<int64_t>& a) { return part(c10::IntArrayRef(a)); }
inline std::string part(c10::ScalarType t) { return c10::toString(t); }
inline std::string part(const c10::Device& d) { return d.str(); }

template <typename... A>
std::string cat(const A&... a) {
  std::string s;
  ((s += part(a)), ...);
  return s;
}

}  // namespace msg
}  // namespace qc

#define QC_CHECK(cond, ...) TORCH_CHECK(cond, ::qc::msg::cat(__VA_ARGS__))
