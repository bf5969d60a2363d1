#include "moecache/ollama.h"

#include "moecache/file_util.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>
#include <string_view>
#include <set>
#include <system_error>
#include <vector>

namespace moecache {

namespace {

constexpr const char* kModelLayer = "application/vnd.ollama.image.model";
constexpr const char* kRegistry = "registry.ollama.ai";
constexpr size_t kMaxManifests = 10'000;
constexpr uint64_t kMaxManifestBytes = 1u << 20;
constexpr uint64_t kMaxTotalBytes = 64u << 20;  // read in one walk at most

bool is_hex(const std::string& s) {
    return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); });
}

constexpr std::string_view kBlobPrefix = "sha256-";

// HOST/NAMESPACE/MODEL/TAG as ollama shows it.
std::string tag_name(const std::filesystem::path& rel) {
    std::vector<std::string> parts;
    for (const auto& p : rel) parts.push_back(p.string());
    if (parts.size() < 2) return rel.string();
    std::string name;
    for (size_t i = 0; i + 1 < parts.size(); ++i) name += (name.empty() ? "" : "/") + parts[i];
    if (parts.size() == 4 && parts[0] == kRegistry) name = parts[1] == "library" ? parts[2] : parts[1] + "/" + parts[2];
    return name + ":" + parts.back();
}

}  // namespace

std::optional<std::string> ollama_tags(const std::string& blob_path) {
    namespace fs = std::filesystem;
    const fs::path blob(blob_path);
    const std::string file = blob.filename().string();
    if (file.rfind(kBlobPrefix, 0) != 0 || !is_hex(file.substr(kBlobPrefix.size())) || blob.parent_path().filename() != "blobs")
        return std::nullopt;
    const std::string digest = "sha256:" + file.substr(kBlobPrefix.size());
    const fs::path manifests = blob.parent_path().parent_path() / "manifests";
    std::error_code ec;
    if (!fs::is_directory(manifests, ec)) return std::nullopt;

    std::set<std::string> tags;
    size_t seen = 0;
    uint64_t read = 0;
    fs::recursive_directory_iterator it(manifests, fs::directory_options::skip_permission_denied, ec);
    for (; !ec && it != fs::recursive_directory_iterator(); it.increment(ec)) {
        if (++seen > kMaxManifests) break;
        if (it.depth() > 4) {
            it.disable_recursion_pending();
            continue;
        }
        if (!it->is_regular_file(ec)) continue;
        auto text = read_whole_file(it->path().string(), kMaxManifestBytes, "ollama manifest");
        if (!text) continue;
        if ((read += text->size()) > kMaxTotalBytes) break;
        const auto j = nlohmann::json::parse(*text, nullptr, /*allow_exceptions=*/false);
        if (!j.is_object() || !j.contains("layers") || !j["layers"].is_array()) continue;
        for (const auto& layer : j["layers"]) {
            if (!layer.is_object()) continue;
            const auto type = layer.find("mediaType");
            const auto dg = layer.find("digest");
            if (type != layer.end() && dg != layer.end() && type->is_string() && dg->is_string() &&
                *type == kModelLayer && *dg == digest)
                tags.insert(tag_name(fs::relative(it->path(), manifests, ec)));
        }
    }
    if (tags.empty()) return std::nullopt;
    std::string out;
    for (const auto& t : tags) out += (out.empty() ? "" : ",") + t;
    return out;
}

bool named_by_content_hash(const std::string& file_name) {
    const std::string hex = file_name.rfind(kBlobPrefix, 0) == 0 ? file_name.substr(kBlobPrefix.size()) : file_name;
    return hex.size() >= 32 && is_hex(hex);
}

}  // namespace moecache
