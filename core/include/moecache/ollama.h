// ollama keeps a model's weights as content-addressed blobs (MODELS/blobs/sha256-HEX) and names
// them in manifests (MODELS/manifests/HOST/NAMESPACE/MODEL/TAG, JSON, the image layer of media
// type application/vnd.ollama.image.model). This finds the name a user knows a blob by.
#pragma once

#include <optional>
#include <string>

namespace moecache {

// The tags whose manifest names `blob_path` as its model layer, the smallest first joined by ","
// ("qwen3:30b-a3b,qwen3:latest"; "NAMESPACE/MODEL:TAG" off the library namespace, "HOST/..." off
// ollama's registry); nullopt when the path is not such a blob or no manifest names it. Every
// manifest is hostile: unreadable, oversized (> 1 MiB), not a regular file or malformed ones are
// skipped, and the walk stops after 10 000 files or 64 MiB read.
std::optional<std::string> ollama_tags(const std::string& blob_path);

// A file named by its content's hash (ollama's sha256-HEX blobs, a Hugging Face cache's blobs/HEX):
// its name says nothing to a user.
bool named_by_content_hash(const std::string& file_name);

}  // namespace moecache
