// The hook's one way to speak: a line on stderr, prefixed "moecache-cuda: ". Never on a hot path.
#pragma once

namespace moecache::cuda::hook {

void say(const char* fmt, ...) __attribute__((format(printf, 1, 2)));

}  // namespace moecache::cuda::hook
