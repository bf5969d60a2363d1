// Generated models for tests, made with the real generator (moecache-mkmodel's library).
#pragma once

#include "moecache/mkmodel/gguf_writer.h"
#include "moecache/mkmodel/synth_model.h"

#include <string>
#include <vector>

namespace moecache::test {

// Writes the model of `spec` to `path` (split into `splits` parts) and returns the files written.
// With alignment 4096 every tensor starts on a page, so the experts of a q8_0 model of small_spec()
// (slices of 17 pages) own whole pages.
std::vector<std::string> write_model(const mkmodel::ModelSpec& spec, const std::string& path,
                                     uint32_t splits = 1, uint32_t alignment = 32);

// A small spec that llama.cpp runs quickly: 4 layers x 16 experts, 2 used.
mkmodel::ModelSpec small_spec();

}  // namespace moecache::test
