// fmt's compiled part, built into the libraries moecache preloads into other programs (the CUDA
// hook, lazy load, the route probe) and into libmoecache-client.so, so that they load where there
// is no libfmt (ollama's runner, Ubuntu-based CUDA images): the functions fmt defines out of line
// (format-inl.h, as fmt's own format.cc compiles it) and the instantiations moecache's code uses.
// Linked with --exclude-libs,ALL, nothing of it is exported: a process with its own libfmt keeps it.
#include <fmt/format-inl.h>

// The instantiations of fmt 9's format.cc; fmt 10 changed their signatures (vformat_args).
#if FMT_VERSION < 90000 || FMT_VERSION >= 100000
#error "fmt_embedded.cpp lists fmt 9's out-of-line instantiations: add those of this fmt version (its src/format.cc)"
#endif

FMT_BEGIN_NAMESPACE
namespace detail {

template auto dragonbox::to_decimal(float x) noexcept -> dragonbox::decimal_fp<float>;
template auto dragonbox::to_decimal(double x) noexcept -> dragonbox::decimal_fp<double>;
template locale_ref::locale_ref(const std::locale& loc);
template auto locale_ref::get<std::locale>() const -> std::locale;
template auto thousands_sep_impl(locale_ref) -> thousands_sep_result<char>;
template auto decimal_point_impl(locale_ref) -> char;
template void buffer<char>::append(const char*, const char*);
template void vformat_to(buffer<char>&, string_view, basic_format_args<FMT_BUFFER_CONTEXT(char)>, locale_ref);

}  // namespace detail
FMT_END_NAMESPACE
