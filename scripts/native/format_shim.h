/* Force-included when compiling mlx-c with a libstdc++ that lacks <format>
 * (GCC 12). mlx-c only uses std::format with plain "{}" placeholders, so a
 * substitution of each "{}" by the next argument's stream output suffices. */
#ifndef DRAFTER_HOST_FORMAT_SHIM_H
#define DRAFTER_HOST_FORMAT_SHIM_H
#ifdef __cplusplus
#if __has_include(<format>)
#include <format>
#else
#include <sstream>
#include <string>
#include <string_view>

namespace std {
inline void format_shim_append(ostringstream& out, string_view& rest) {
  out << rest;
  rest = {};
}
template <class T, class... Rest>
void format_shim_append(ostringstream& out, string_view& rest, const T& value,
                        const Rest&... others) {
  size_t at = rest.find("{}");
  if (at == string_view::npos) {
    format_shim_append(out, rest);
    return;
  }
  out << rest.substr(0, at) << value;
  rest.remove_prefix(at + 2);
  format_shim_append(out, rest, others...);
}
template <class... Args>
string format(string_view fmt, const Args&... args) {
  ostringstream out;
  format_shim_append(out, fmt, args...);
  return out.str();
}
}  // namespace std
#endif
#endif
#endif
