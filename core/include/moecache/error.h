// The one result type of moecache: a value, or an Error that carries errno and says what failed,
// where (file, field, byte offset, key) and, where it can, what to do about it.
#pragma once

#include <fmt/format.h>
#include <tl/expected.hpp>

#include <cerrno>
#include <string>
#include <utility>

namespace moecache {

struct Error {
    int errnum = 0;       // errno of the failing system call; 0 when the cause is not a system call
    std::string message;  // what failed and where

    // The message, followed by strerror(errnum) when there is one.
    [[nodiscard]] std::string what() const;
};

template <class T>
class [[nodiscard]] Result : public tl::expected<T, Error> {
public:
    using tl::expected<T, Error>::expected;
    Result(tl::expected<T, Error> e) : tl::expected<T, Error>(std::move(e)) {}  // NOLINT
};

inline tl::unexpected<Error> fail(int errnum, std::string message) {
    return tl::unexpected<Error>(Error{errnum, std::move(message)});
}

template <typename... Args>
tl::unexpected<Error> failf(fmt::format_string<Args...> f, Args&&... args) {
    return fail(0, fmt::format(f, std::forward<Args>(args)...));
}

// For a failed system call: captures errno before anything can clobber it.
template <typename... Args>
tl::unexpected<Error> fail_errno(fmt::format_string<Args...> f, Args&&... args) {
    const int e = errno;
    return fail(e, fmt::format(f, std::forward<Args>(args)...));
}

// Prefixes an error with the context of the caller ("model X: " + inner message).
inline Error with_context(Error e, std::string_view context) {
    e.message = fmt::format("{}: {}", context, e.message);
    return e;
}

}  // namespace moecache

// Propagates the error of an expression of Result type; otherwise yields its value.
// (A GNU statement expression: GCC and clang both have it.)
#define MC_CONCAT_(a, b) a##b
#define MC_CONCAT(a, b) MC_CONCAT_(a, b)
#define MC_TRY(expr) MC_TRY_IMPL_(expr, MC_CONCAT(mc_try_, __COUNTER__))
#define MC_TRY_IMPL_(expr, var)                                                   \
    ({                                                                            \
        auto var = (expr);                                                        \
        if (!var) return tl::unexpected<::moecache::Error>(std::move(var.error())); \
        std::move(*var);                                                          \
    })

#define MC_TRY_VOID(expr) MC_TRY_VOID_IMPL_(expr, MC_CONCAT(mc_try_, __COUNTER__))
#define MC_TRY_VOID_IMPL_(expr, var)                                              \
    do {                                                                          \
        auto var = (expr);                                                        \
        if (!var) return tl::unexpected<::moecache::Error>(std::move(var.error())); \
    } while (0)
