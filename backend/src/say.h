// The backend's one way to speak: a line on stderr, prefixed "moecache-ggml: ". Never on a hot path.
#pragma once

namespace moecache::backend {

void say(const char* fmt, ...) __attribute__((format(printf, 1, 2)));

}  // namespace moecache::backend
