#include "moecache/cuda/hot_profile.h"

#include "moecache/file_util.h"
#include "moecache/text.h"
#include "moecache/unique_fd.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <cinttypes>
#include <cstring>

namespace moecache::cuda {
namespace {

constexpr uint64_t kIdentityBytes = 1 << 20;
constexpr std::string_view kMagic = "moecache-hot-profile 1";

// One line of the text, without its newline; false at the end.
bool next_line(std::string_view& rest, std::string_view* line) {
    if (rest.empty()) return false;
    const auto nl = rest.find('\n');
    *line = rest.substr(0, nl);
    rest = nl == std::string_view::npos ? std::string_view{} : rest.substr(nl + 1);
    return true;
}

bool parse_u64(std::string_view s, uint64_t* v) {
    if (s.empty()) return false;
    const auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), *v);
    return ec == std::errc{} && p == s.data() + s.size();
}

}  // namespace

Result<std::string> hot_profile_name(const std::string& model_path) {
    UniqueFd fd(::open(model_path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK));
    if (!fd) return fail_errno("{}: cannot open", model_path);
    struct stat st {};
    if (fstat(fd.get(), &st) != 0) return fail_errno("{}: cannot stat", model_path);
    if (!S_ISREG(st.st_mode)) return failf("{}: not a regular file", model_path);
    const auto size = static_cast<uint64_t>(st.st_size);
    std::string head(static_cast<size_t>(std::min(size, kIdentityBytes)), '\0');
    if (!head.empty())
        if (auto r = pread_exact(fd.get(), head.data(), head.size(), 0, model_path); !r) return tl::unexpected(r.error());
    head += std::to_string(size);
    char name[64];
    snprintf(name, sizeof name, "%016" PRIx64 ".hot", name_hash(head));
    return std::string(name);
}

std::string hot_profile_dir(const char* setting, const char* xdg_cache_home, const char* home) {
    if (setting != nullptr && *setting != '\0') {
        if (!strcmp(setting, "off") || !strcmp(setting, "0") || !strcmp(setting, "no") || !strcmp(setting, "false")) return "";
        return setting;
    }
    if (xdg_cache_home != nullptr && xdg_cache_home[0] == '/') return std::string(xdg_cache_home) + "/moecache/hook";
    if (home != nullptr && home[0] == '/' && home[1] != '\0') return std::string(home) + "/.cache/moecache/hook";
    return "";
}

std::string format_hot_profile(const HotProfile& p) {
    std::string out;
    out.reserve(64 + p.counts.size() * 4);
    out += fmt::format("{} layers {} experts {} routings {}\n", kMagic, p.n_layers, p.n_experts, p.routings);
    for (uint32_t l = 0; l < p.n_layers; ++l) {
        for (uint32_t e = 0; e < p.n_experts; ++e) {
            if (e > 0) out += ' ';
            out += std::to_string(p.counts[size_t{l} * p.n_experts + e]);
        }
        out += '\n';
    }
    return out;
}

Result<HotProfile> parse_hot_profile(const std::string& text, uint32_t n_layers, uint32_t n_experts) {
    if (text.size() > kMaxProfileBytes) return failf("{} bytes, more than a profile has ({})", text.size(), kMaxProfileBytes);
    std::string_view rest = text, line;
    if (!next_line(rest, &line) || line.substr(0, kMagic.size()) != kMagic)
        return failf("line 1: not a moecache hot profile (expected \"{}\")", kMagic);
    // "layers L experts E routings R"
    std::string_view fields = line.substr(kMagic.size());
    uint64_t vals[3] = {};
    const char* names[3] = {" layers ", " experts ", " routings "};
    for (int i = 0; i < 3; ++i) {
        if (fields.substr(0, strlen(names[i])) != names[i]) return failf("line 1: expected \"{}\"", names[i] + 1);
        fields.remove_prefix(strlen(names[i]));
        const auto sp = fields.find(' ');
        if (!parse_u64(fields.substr(0, sp), &vals[i])) return failf("line 1: {}is not a number", names[i] + 1);
        fields = sp == std::string_view::npos ? std::string_view{} : fields.substr(sp);
    }
    if (!fields.empty()) return failf("line 1: unexpected \"{}\"", printable_utf8(fields.substr(0, 32)));
    if (vals[0] != n_layers || vals[1] != n_experts)
        return failf("line 1: a profile of {} layers x {} experts, the model has {} x {}", vals[0], vals[1], n_layers, n_experts);
    if (n_layers == 0 || n_experts == 0 || n_layers > kMaxProfileLayers || n_experts > kMaxProfileExperts)
        return failf("line 1: {} layers x {} experts is not a model's shape", n_layers, n_experts);
    HotProfile p;
    p.n_layers = n_layers;
    p.n_experts = n_experts;
    p.routings = vals[2];
    p.counts.reserve(size_t{n_layers} * n_experts);
    for (uint32_t l = 0; l < n_layers; ++l) {
        if (!next_line(rest, &line)) return failf("line {}: missing (layer {} of {})", l + 2, l, n_layers);
        for (uint32_t e = 0; e < n_experts; ++e) {
            const auto sp = line.find(' ');
            uint64_t v = 0;
            if (!parse_u64(line.substr(0, sp), &v) || v > UINT32_MAX)
                return failf("line {}: expert {}: expected a count", l + 2, e);
            p.counts.push_back(static_cast<uint32_t>(v));
            if ((sp == std::string_view::npos) != (e + 1 == n_experts))
                return failf("line {}: expected {} counts", l + 2, n_experts);
            line = sp == std::string_view::npos ? std::string_view{} : line.substr(sp + 1);
        }
    }
    if (!rest.empty()) return failf("line {}: more lines than the {} layers", n_layers + 2, n_layers);
    return p;
}

Result<HotProfile> load_hot_profile(const std::string& path, uint32_t n_layers, uint32_t n_experts) {
    auto text = read_whole_file(path, kMaxProfileBytes, "hot profile");
    if (!text) return tl::unexpected(text.error());
    auto p = parse_hot_profile(*text, n_layers, n_experts);
    if (!p) return tl::unexpected(with_context(p.error(), path));
    return p;
}

Result<void> save_hot_profile(const std::string& path, const HotProfile& p) {
    const auto slash = path.rfind('/');
    if (slash != std::string::npos && slash > 0) {
        const std::string dir = path.substr(0, slash);
        // Each missing folder of the path, private to the user (what it says is what they run).
        for (size_t at = dir.find('/', 1);; at = dir.find('/', at + 1)) {
            const std::string part = dir.substr(0, at);
            if (::mkdir(part.c_str(), 0700) != 0 && errno != EEXIST) return fail_errno("{}: cannot create the folder", part);
            if (at == std::string::npos) break;
        }
    }
    // A temporary name of this process's own: two runtimes of one model may end at once.
    const std::string tmp = fmt::format("{}.{}.tmp", path, getpid());
    UniqueFd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0600));
    if (!fd) return fail_errno("{}: cannot create", tmp);
    const std::string text = format_hot_profile(p);
    for (size_t off = 0; off < text.size();) {
        const ssize_t n = ::write(fd.get(), text.data() + off, text.size() - off);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) {
            auto e = fail_errno("{}: write", tmp);
            ::unlink(tmp.c_str());
            return e;
        }
        off += static_cast<size_t>(n);
    }
    fd.reset();
    if (::rename(tmp.c_str(), path.c_str()) != 0) {
        auto e = fail_errno("{}: rename to {}", tmp, path);
        ::unlink(tmp.c_str());
        return e;
    }
    return {};
}

std::vector<uint32_t> profile_heat(const HotProfile& p, uint32_t top) {
    const uint32_t most = p.counts.empty() ? 0 : *std::max_element(p.counts.begin(), p.counts.end());
    std::vector<uint32_t> heat(p.counts.size(), 0);
    if (most == 0) return heat;
    for (size_t i = 0; i < p.counts.size(); ++i)
        if (p.counts[i] > 0)
            heat[i] = std::max<uint32_t>(1, static_cast<uint32_t>(uint64_t{p.counts[i]} * top / most));
    return heat;
}

}  // namespace moecache::cuda
