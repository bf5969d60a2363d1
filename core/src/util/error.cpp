#include "moecache/error.h"

#include <cstring>

namespace moecache {

std::string Error::what() const {
    if (errnum == 0) return message;
    return fmt::format("{}: {}", message, std::strerror(errnum));
}

}  // namespace moecache
