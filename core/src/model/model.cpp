#include "moecache/model.h"
#include "moecache/text.h"

#include "moecache/unique_fd.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cstring>
#include <filesystem>
#include <unordered_map>

namespace moecache {
namespace {

// "blk.12.ffn_up_exps.weight" -> {12, "ffn_up_exps", "weight"}
struct BlockTensorName {
    uint32_t block;
    std::string_view base;
    std::string_view suffix;
};

std::optional<BlockTensorName> parse_block_name(std::string_view name) {
    constexpr std::string_view kPrefix = "blk.";
    if (name.substr(0, kPrefix.size()) != kPrefix) return std::nullopt;
    name.remove_prefix(kPrefix.size());
    uint32_t block = 0;
    const auto [p, ec] = std::from_chars(name.data(), name.data() + name.size(), block);
    if (ec != std::errc{} || p == name.data() || p == name.data() + name.size() || *p != '.')
        return std::nullopt;
    name.remove_prefix(static_cast<size_t>(p - name.data()) + 1);
    const auto dot = name.find('.');
    return BlockTensorName{block, name.substr(0, dot),
                           dot == std::string_view::npos ? std::string_view{} : name.substr(dot + 1)};
}

bool ends_with(std::string_view s, std::string_view suffix) {
    return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

bool contains(std::string_view s, std::string_view part) { return s.find(part) != std::string_view::npos; }

}  // namespace

std::optional<SplitName> parse_split_name(const std::string& path) {
    // NAME-00001-of-00005.gguf
    constexpr std::string_view kExt = ".gguf";
    std::string_view s = path;
    if (!ends_with(s, kExt)) return std::nullopt;
    s.remove_suffix(kExt.size());
    if (s.size() < 16) return std::nullopt;
    const std::string_view tail = s.substr(s.size() - 15);  // -00001-of-00005
    if (tail[0] != '-' || tail.substr(6, 4) != "-of-") return std::nullopt;
    auto digits = [](std::string_view d, uint32_t& out) {
        if (!std::all_of(d.begin(), d.end(), [](char ch) { return std::isdigit(static_cast<unsigned char>(ch)); }))
            return false;
        return std::from_chars(d.data(), d.data() + d.size(), out).ec == std::errc{};
    };
    uint32_t no = 0, count = 0;
    if (!digits(tail.substr(1, 5), no) || !digits(tail.substr(10, 5), count)) return std::nullopt;
    if (no == 0 || count == 0 || no > count) return std::nullopt;
    return SplitName{std::string(s.substr(0, s.size() - 15)), no - 1, count};
}

std::string split_path(const std::string& prefix, uint32_t index, uint32_t count) {
    return fmt::format("{}-{:05d}-of-{:05d}.gguf", prefix, index + 1, count);
}

namespace {

namespace fs = std::filesystem;

struct SplitKey {
    uint64_t count = 0;
    std::optional<uint64_t> tensors;  // split.tensors.count
};

// The split metadata of a GGUF file, if it is one (a quick look: the file's first bytes, then the
// header). Only regular files; a FIFO or a device is never opened for reading.
std::optional<std::pair<uint64_t, GgufFile>> split_part_at(const fs::path& p, const SplitKey& want) {
    UniqueFd fd(::open(p.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK));
    struct stat st {};
    char magic[4];
    if (!fd || ::fstat(fd.get(), &st) != 0 || !S_ISREG(st.st_mode) || ::pread(fd.get(), magic, 4, 0) != 4 ||
        std::memcmp(magic, "GGUF", 4) != 0)
        return std::nullopt;
    auto f = read_gguf(fd.get(), p.string());
    if (!f) return std::nullopt;
    const auto no = f->get_uint_opt("split.no"), cnt = f->get_uint_opt("split.count"), tc = f->get_uint_opt("split.tensors.count");
    if (!no || !cnt || !tc || !*no || !*cnt || **cnt != want.count || (want.tensors && *tc && **tc != *want.tensors)) return std::nullopt;
    return std::make_pair(**no, std::move(*f));
}

struct InodeKey {
    dev_t dev;
    ino_t ino;
    bool operator==(const InodeKey&) const = default;
};
std::optional<InodeKey> inode_of(const fs::path& p) {
    struct stat st {};
    if (::stat(p.c_str(), &st) != 0) return std::nullopt;
    return InodeKey{st.st_dev, st.st_ino};
}

// A Hugging Face cache keeps a file as blobs/<hash> behind snapshots/<revision>/NAME symlinks: the
// name of a blob, where one of the snapshots gives it one.
std::optional<std::string> named_in_hf_snapshot(const fs::path& real) {
    const fs::path blobs = real.parent_path();
    if (blobs.filename() != "blobs") return std::nullopt;
    const fs::path snapshots = blobs.parent_path() / "snapshots";
    std::error_code ec;
    const auto me = inode_of(real);
    if (!me) return std::nullopt;
    size_t seen = 0;
    for (auto it = fs::recursive_directory_iterator(snapshots, fs::directory_options::skip_permission_denied, ec);
         !ec && it != fs::recursive_directory_iterator() && seen < 100000; it.increment(ec), ++seen) {
        if (it.depth() > 3) it.disable_recursion_pending();
        if (!it->is_symlink(ec) && !it->is_regular_file(ec)) continue;
        if (!parse_split_name(it->path().string())) continue;
        if (inode_of(it->path()) == me) return it->path().string();
    }
    return std::nullopt;
}

}  // namespace

Result<std::vector<std::string>> find_split_parts(const std::string& path, const GgufFile& part) {
    const auto count = MC_TRY(part.get_uint_opt("split.count"));
    const auto no = MC_TRY(part.get_uint_opt("split.no"));
    const auto tensors = MC_TRY(part.get_uint_opt("split.tensors.count"));
    if (!count || *count <= 1) return std::vector<std::string>{path};
    if (*count > 4096) return failf("{}: split.count is {}: more parts than any model has", path, *count);
    std::error_code ec;
    const fs::path real = fs::canonical(path, ec);
    if (ec) return fail(ec.value(), fmt::format("{}: cannot resolve the path: {}", path, ec.message()));
    // By name first: the path itself, or the name a Hugging Face snapshot gives the blob.
    for (const auto& named : {std::optional<std::string>(path), named_in_hf_snapshot(real)}) {
        if (!named) continue;
        const auto name = parse_split_name(*named);
        if (!name || name->count != *count) continue;
        std::vector<std::string> out;
        for (uint32_t i = 0; i < name->count; ++i) out.push_back(split_path(name->prefix, i, name->count));
        return out;  // a part missing by its name is named as missing when it is opened
    }
    // By content: the files beside it (where it is named, and where it really is) whose metadata
    // says they are the other parts of a set of the same size and tensor count.
    const SplitKey want{*count, tensors};
    std::vector<std::optional<std::string>> found(*count);
    std::vector<std::optional<InodeKey>> found_inode(*count);
    if (no && *no < *count) {
        found[*no] = path;
        found_inode[*no] = inode_of(path);
    }
    std::vector<fs::path> dirs{fs::path(path).parent_path(), real.parent_path()};
    if (dirs[0].empty()) dirs[0] = ".";
    if (fs::equivalent(dirs[0], dirs[1], ec)) dirs.pop_back();
    for (const auto& dir : dirs) {
        size_t seen = 0;
        for (auto it = fs::directory_iterator(dir, fs::directory_options::skip_permission_denied, ec);
             !ec && it != fs::directory_iterator() && seen < 100000; it.increment(ec), ++seen) {
            auto hit = split_part_at(it->path(), want);
            if (!hit || hit->first >= *count) continue;
            const auto ino = inode_of(it->path());
            auto& slot = found[hit->first];
            if (slot && found_inode[hit->first] == ino) continue;  // the same file by another name
            if (slot)
                return failf("{}: part {} of {} is ambiguous: both {} and {} say they are it; name the parts "
                             "NAME-0000i-of-0000N.gguf or keep one set per folder", path, hit->first + 1, *count, *slot,
                             it->path().string());
            slot = it->path().string();
            found_inode[hit->first] = ino;
        }
    }
    std::vector<std::string> out;
    for (uint64_t i = 0; i < *count; ++i) {
        if (!found[i])
            return fail(ENOENT, fmt::format("{}: the metadata says this is part {} of {}, but part {} is in none of {}: "
                                            "its name does not follow NAME-0000i-of-0000N.gguf and no file beside it "
                                            "says it is that part",
                                            path, no ? *no + 1 : 0, *count, i + 1,
                                            dirs.size() == 1 ? dirs[0].string() : dirs[0].string() + " and " + dirs[1].string()));
        out.push_back(*found[i]);
    }
    return out;
}

// The parts of a split set, in order: each says it is part i of this many, of one tensor count,
// and no tensor is in two parts.
Result<void> check_split_set(const std::vector<GgufFile>& parts, const std::string& path) {
    const auto count = static_cast<uint32_t>(parts.size());
    uint64_t total_tensors = 0;
    std::optional<uint64_t> declared_tensors;
    std::unordered_map<std::string, uint32_t> seen;
    for (uint32_t i = 0; i < count; ++i) {
        const GgufFile* part = &parts[i];
        const std::string& part_path = part->path;
        const auto no = MC_TRY(part->get_uint_opt("split.no"));
        const auto cnt = MC_TRY(part->get_uint_opt("split.count"));
        const auto tcount = MC_TRY(part->get_uint_opt("split.tensors.count"));
        if (!no || !cnt || *no != i || *cnt != count)
            return failf("{}: does not belong to this split set: expected split.no {} of split.count "
                         "{}, found {} of {}", part_path, i, count,
                         no ? fmt::to_string(*no) : "none", cnt ? fmt::to_string(*cnt) : "none");
        if (tcount) {
            if (declared_tensors && *declared_tensors != *tcount)
                return failf("{}: does not belong to this split set: split.tensors.count is {} here "
                             "but {} in part 1", part_path, *tcount, *declared_tensors);
            declared_tensors = tcount;
        }
        for (const auto& t : part->tensors) {
            auto [it, inserted] = seen.emplace(t.name, i);
            if (!inserted)
                return failf("{}: tensor '{}' is also in part {}: the parts are from different "
                             "models or splits", part_path, t.name, it->second + 1);
        }
        total_tensors += part->tensors.size();
    }
    if (declared_tensors && *declared_tensors != total_tensors)
        return failf("split model {}: split.tensors.count says {} tensors but the {} parts hold {}",
                     path, *declared_tensors, count, total_tensors);
    return {};
}

Result<std::vector<GgufFile>> open_gguf_model(const std::string& path) {
    auto first = MC_TRY(read_gguf(path));
    const auto count_kv = MC_TRY(first.get_uint_opt("split.count"));
    const auto name = parse_split_name(path);
    // Checked before the one-file case too: a part of a set that says it is whole is still a part.
    if (name && count_kv && name->count != *count_kv)
        return failf("{}: the name says {} parts but split.count says {}", path, name->count,
                     *count_kv);
    if (!count_kv || *count_kv <= 1) {
        std::vector<GgufFile> one;
        one.push_back(std::move(first));
        return one;
    }
    // Any part opens the set: by the parts' names where they follow NAME-0000i-of-0000N.gguf, else
    // by their metadata (a Hugging Face cache's blobs, an ollama store's sha256-... files).
    const auto paths = MC_TRY(find_split_parts(path, first));
    const auto count = static_cast<uint32_t>(paths.size());

    std::vector<GgufFile> parts;
    parts.reserve(count);
    for (uint32_t i = 0; i < count; ++i) {
        const std::string& part_path = paths[i];
        Result<GgufFile> part = part_path == path ? Result<GgufFile>(std::move(first)) : read_gguf(part_path);
        if (!part) {
            if (part.error().errnum == ENOENT)
                return fail(ENOENT, fmt::format("split model {}: part {} of {} is missing: {}",
                                                 path, i + 1, count, part_path));
            return tl::unexpected(with_context(part.error(), fmt::format("split model {}", path)));
        }
        parts.push_back(std::move(*part));
    }
    MC_TRY_VOID(check_split_set(parts, path));
    return parts;
}

Result<std::vector<GgufFile>> open_gguf_model(const std::vector<int>& fds, const std::vector<std::string>& names) {
    if (fds.empty() || names.size() != fds.size()) return failf("a model needs one name for each of its {} descriptors", fds.size());
    std::vector<GgufFile> parts;
    parts.reserve(fds.size());
    for (size_t i = 0; i < fds.size(); ++i) parts.push_back(MC_TRY(read_gguf(fds[i], names[i])));
    const auto count = MC_TRY(parts.front().get_uint_opt("split.count"));
    if ((!count || *count <= 1) && parts.size() == 1) return parts;
    if (!count || *count != parts.size())
        return failf("{}: split.count says {} parts but {} were handed over", names.front(), count ? *count : 1, parts.size());
    MC_TRY_VOID(check_split_set(parts, names.front()));
    return parts;
}

const MoeLayer* ExpertMap::layer(uint32_t block) const {
    auto it = std::lower_bound(layers.begin(), layers.end(), block,
                               [](const MoeLayer& l, uint32_t b) { return l.index < b; });
    return it != layers.end() && it->index == block ? &*it : nullptr;
}

std::vector<ByteRange> ExpertMap::ranges(uint32_t block, uint32_t expert) const {
    std::vector<ByteRange> out;
    const auto* l = layer(block);
    if (!l || expert >= n_experts) return out;
    for (const auto& t : l->tensors)
        out.push_back({t.file, t.offset + uint64_t{expert} * t.bytes_per_expert, t.bytes_per_expert});
    return out;
}

std::vector<ByteRange> ExpertMap::dense_ranges() const {
    std::vector<ByteRange> out;
    for (uint32_t fi = 0; fi < files.size(); ++fi) {
        std::vector<std::pair<uint64_t, uint64_t>> experts;  // [begin, end) of expert tensors
        for (const auto& l : layers)
            for (const auto& t : l.tensors)
                if (t.file == fi) experts.emplace_back(t.offset, t.offset + t.bytes_per_expert * n_experts);
        std::sort(experts.begin(), experts.end());
        uint64_t at = 0;
        for (const auto& [b, e] : experts) {
            if (b > at) out.push_back({fi, at, b - at});
            at = std::max(at, e);
        }
        if (files[fi].size > at) out.push_back({fi, at, files[fi].size - at});
    }
    return out;
}

std::string ExpertMap::profile_key() const {
    auto sanitize = [](std::string_view s) {
        std::string out;
        for (char c : s)
            out += std::isalnum(static_cast<unsigned char>(c)) ? static_cast<char>(std::tolower(static_cast<unsigned char>(c)))
                                                              : '-';
        return out.empty() ? std::string("unnamed") : out;
    };
    return fmt::format("{}-{}x{}-{}", sanitize(architecture), n_blocks, n_experts, sanitize(name));
}

std::optional<ExpertRef> ExpertMap::lookup(uint32_t file, uint64_t offset) const {
    const auto p = position(file, offset);
    if (!p) return std::nullopt;
    return ExpertRef{p->layer, p->expert};
}

std::optional<ExpertPosition> ExpertMap::position(uint32_t file, uint64_t offset) const {
    auto it = std::upper_bound(spans_.begin(), spans_.end(), std::pair{file, offset},
                               [](const std::pair<uint32_t, uint64_t>& k, const Span& s) {
                                   return k.first < s.file || (k.first == s.file && k.second < s.begin);
                               });
    if (it == spans_.begin()) return std::nullopt;
    --it;
    if (it->file != file || offset >= it->end || it->bytes_per_expert == 0) return std::nullopt;
    const uint64_t in = offset - it->begin;
    return ExpertPosition{it->layer, static_cast<uint32_t>(in / it->bytes_per_expert), in % it->bytes_per_expert,
                          it->bytes_per_expert, it->end};
}

Result<ExpertMap> ExpertMap::build(const std::vector<GgufFile>& parts) {
    if (parts.empty()) return failf("a model needs at least one file");
    const GgufFile& head = parts.front();
    ExpertMap m;
    m.architecture = shown_name(MC_TRY(head.get_string("general.architecture")));
    if (const auto* n = head.find("general.name"); n && n->as_string()) m.name = shown_name(*n->as_string());
    const std::string& arch = m.architecture;
    auto arch_key = [&](std::string_view k) { return fmt::format("{}.{}", arch, k); };
    constexpr uint32_t kMaxBlocks = 1u << 20;  // also the most of any count below
    auto narrow = [&](std::string_view k, std::optional<uint64_t> v) -> Result<uint32_t> {
        if (v && *v > kMaxBlocks)
            return failf("{}: metadata key '{}' is {}, which no model has", head.path, arch_key(k), *v);
        return static_cast<uint32_t>(v.value_or(0));
    };
    m.n_blocks = MC_TRY(narrow("block_count", MC_TRY(head.get_uint_opt(arch_key("block_count")))));
    m.n_experts = MC_TRY(narrow("expert_count", MC_TRY(head.get_uint_opt(arch_key("expert_count")))));
    m.n_experts_used = MC_TRY(narrow("expert_used_count", MC_TRY(head.get_uint_opt(arch_key("expert_used_count")))));
    m.n_experts_shared = MC_TRY(narrow("expert_shared_count", MC_TRY(head.get_uint_opt(arch_key("expert_shared_count")))));
    m.n_leading_dense = MC_TRY(narrow("leading_dense_block_count", MC_TRY(head.get_uint_opt(arch_key("leading_dense_block_count")))));
    // What a model of today has, with wide margins: everything sized per expert (heat, residency,
    // a hook's slices) is bounded by these before it is made. A file past them is refused, named:
    // a 4 MiB GGUF of 4.2 million one-byte experts held the daemon's loop 13 s at registration.
    if (m.n_blocks > kMaxModelBlocks)
        return failf("{}: {} is {}, more than any model's ({})", head.path, arch_key("block_count"), m.n_blocks,
                     kMaxModelBlocks);
    if (m.n_experts > kMaxExpertsPerLayer)
        return failf("{}: {} is {}, more than any model's ({})", head.path, arch_key("expert_count"), m.n_experts,
                     kMaxExpertsPerLayer);
    if (uint64_t{m.n_blocks} * m.n_experts > kMaxModelExperts)
        return failf("{}: {} x {} = {} x {} experts, more than any model's ({})", head.path, arch_key("block_count"),
                     arch_key("expert_count"), m.n_blocks, m.n_experts, kMaxModelExperts);

    std::vector<MoeLayer> by_block;
    for (uint32_t fi = 0; fi < parts.size(); ++fi) {
        const auto& f = parts[fi];
        m.files.push_back({f.path, f.file_size});
        uint64_t data_bytes = 0;
        for (const auto& t : f.tensors) {
            data_bytes += t.nbytes;
            const auto bn = parse_block_name(t.name);
            const bool expert = bn && ends_with(bn->base, "_exps");
            const bool shared = bn && contains(bn->base, "_shexp");
            // by_block is indexed by the block number of a name: bound it before it sizes anything.
            if ((expert || shared) && bn->block >= (m.n_blocks != 0 ? m.n_blocks : kMaxBlocks))
                return failf("{}: tensor '{}': block {} is past {} = {}", f.path, t.name, bn->block,
                             arch_key("block_count"),
                             m.n_blocks != 0 ? fmt::to_string(m.n_blocks) : "(missing)");
            if (!ggml_type_known(t.type)) {
                m.unknown_type_tensors.push_back({t.name, fi, t.type.id, t.nbytes, expert});
                m.dense_bytes_total += t.nbytes;
                continue;
            }
            if (!expert) {
                if (shared) {
                    m.shared_expert_bytes_total += t.nbytes;
                    if (bn->block >= by_block.size()) by_block.resize(bn->block + 1);
                    by_block[bn->block].shared_expert_bytes += t.nbytes;
                } else {
                    m.dense_bytes_total += t.nbytes;
                }
                continue;
            }
            const std::string where = fmt::format("{}: tensor '{}'", f.path, t.name);
            if (m.n_experts == 0)
                return failf("{} holds routed experts but '{}' is missing or 0", where,
                             arch_key("expert_count"));
            const int64_t last = t.ne[t.n_dims - 1];
            if (t.n_dims < 2 || last != static_cast<int64_t>(m.n_experts))
                return failf("{}: its last dimension is {} but {} is {}: the tensor shape does not "
                             "match the metadata", where, last, arch_key("expert_count"), m.n_experts);
            if (bn->block < m.n_leading_dense)
                return failf("{}: block {} holds experts but {} says the first {} blocks are dense",
                             where, bn->block, arch_key("leading_dense_block_count"), m.n_leading_dense);
            if (bn->block >= by_block.size()) by_block.resize(bn->block + 1);
            auto& layer = by_block[bn->block];
            layer.index = bn->block;
            const uint64_t per = t.nbytes / m.n_experts;  // exact: the last dimension is n_experts
            layer.tensors.push_back({t.name, fi, t.file_offset, per, t.type});
            layer.bytes_per_expert += per;
            m.expert_bytes_total += t.nbytes;
            m.spans_.push_back({fi, t.file_offset, t.file_offset + t.nbytes, per, bn->block});
        }
        m.header_bytes_total += f.file_size - data_bytes;
    }
    for (uint32_t b = 0; b < by_block.size(); ++b) {
        by_block[b].index = b;
        if (!by_block[b].tensors.empty()) m.layers.push_back(std::move(by_block[b]));
    }
    if (!m.layers.empty()) {
        if (m.n_experts_used == 0)
            return failf("{}: the model has routed experts but '{}' is missing or 0", head.path,
                         arch_key("expert_used_count"));
        if (m.n_experts_used > m.n_experts)
            return failf("{}: {} = {} is more than {} = {}", head.path, arch_key("expert_used_count"),
                         m.n_experts_used, arch_key("expert_count"), m.n_experts);
    }
    std::sort(m.spans_.begin(), m.spans_.end(), [](const Span& a, const Span& b) {
        return a.file != b.file ? a.file < b.file : a.begin < b.begin;
    });
    return m;
}

Result<ExpertMap> load_expert_map(const std::string& path) {
    const auto parts = MC_TRY(open_gguf_model(path));
    return ExpertMap::build(parts);
}

}  // namespace moecache
