#include "say.h"

#include <cstdarg>
#include <cstdio>

namespace moecache::backend {

void say(const char* fmt, ...) {
    char line[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    fprintf(stderr, "moecache-ggml: %s\n", line);
}

}  // namespace moecache::backend
