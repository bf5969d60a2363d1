#include "moecache/routeprobe/route_probe.h"

#include "moecache/mkmodel/router_skew.h"
#include "moecache/routeprobe/routing_stats.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <numeric>

namespace moecache::routeprobe {
namespace {

constexpr const char* kMaps = "/proc/self/maps";
constexpr double kFractions[] = {0.125, 0.25, 0.5};

Result<void> pread_all(int fd, void* buf, size_t n, uint64_t offset, const std::string& what) {
    auto* p = static_cast<uint8_t*>(buf);
    while (n > 0) {
        const ssize_t got = ::pread(fd, p, n, static_cast<off_t>(offset));
        if (got < 0) {
            if (errno == EINTR) continue;
            return fail_errno("read {} at offset {}", what, offset);
        }
        if (got == 0) return failf("read {} at offset {}: unexpected end of file", what, offset);
        p += got;
        n -= static_cast<size_t>(got);
        offset += static_cast<uint64_t>(got);
    }
    return {};
}

// The generator's record of the ranking it built in, if this model came from moecache-mkmodel.
Result<std::optional<IntendedRouting>> read_intended(const GgufFile& head, const ExpertMap& map) {
    const auto* kv = head.find("moecache.mkmodel.expert_rank");
    if (!kv) return std::optional<IntendedRouting>{};
    const auto* arr = std::get_if<GgufArrayRef>(&kv->value);
    const uint64_t want = uint64_t{map.n_blocks} * map.n_experts;
    if (!arr || arr->element_type != GgufValueType::U32 || arr->count != want)
        return failf("{}: 'moecache.mkmodel.expert_rank' is not a u32 array of block_count x expert_count "
                     "= {} values", head.path, want);
    IntendedRouting r;
    r.rank.resize(want);
    UniqueFd fd(::open(head.path.c_str(), O_RDONLY | O_CLOEXEC));
    if (!fd) return fail_errno("open {}", head.path);
    MC_TRY_VOID(pread_all(fd.get(), r.rank.data(), want * 4, arr->offset,
                          fmt::format("{} key 'moecache.mkmodel.expert_rank'", head.path)));
    for (auto v : r.rank)
        if (v >= map.n_experts)
            return failf("{}: 'moecache.mkmodel.expert_rank' holds rank {}, past expert_count {}", head.path, v,
                         map.n_experts);
    if (const auto* p = head.find("moecache.mkmodel.preset"); p && p->as_string()) r.preset = *p->as_string();
    auto number = [&](const char* key) {
        const auto* k = head.find(key);
        const double* d = k ? std::get_if<double>(&k->value) : nullptr;
        return d ? *d : 0.0;
    };
    r.skew_scale = number("moecache.mkmodel.router_skew_scale");
    r.skew_shape = number("moecache.mkmodel.router_skew_shape");
    return std::optional<IntendedRouting>(std::move(r));
}

bool same_mappings(const std::vector<FileMapping>& a, const std::vector<FileMapping>& b) {
    return std::equal(a.begin(), a.end(), b.begin(), b.end(), [](const FileMapping& x, const FileMapping& y) {
        return x.start == y.start && x.end == y.end && x.file_offset == y.file_offset && x.perms == y.perms;
    });
}

nlohmann::json coverage_json(const std::vector<uint64_t>& counts) {
    nlohmann::json j = nlohmann::json::object();
    for (double f : kFractions) j[fmt::format("{}", f)] = coverage(counts, f);
    return j;
}

}  // namespace

std::pair<uint64_t, std::string> fault_around_window(uint64_t page_size) {
    constexpr const char* kPath = "/sys/kernel/debug/fault_around_bytes";
    if (auto text = read_proc_text(kPath)) {
        char* end = nullptr;
        const unsigned long long v = std::strtoull(text->c_str(), &end, 10);
        if (end != text->c_str() && v > 0) return {std::max<uint64_t>(v, page_size), kPath};
    }
    return {std::max<uint64_t>(65536, page_size), "kernel default (debugfs not readable)"};
}

Result<std::unique_ptr<RouteProbe>> RouteProbe::create(const ProbeConfig& config) {
    std::unique_ptr<RouteProbe> p(new RouteProbe());
    p->config_ = config;
    const auto parts = MC_TRY(open_gguf_model(config.model_path));
    p->map_ = MC_TRY(ExpertMap::build(parts));
    if (p->map_.layers.empty()) return failf("{}: the model has no routed experts", config.model_path);
    p->intended_ = MC_TRY(read_intended(parts.front(), p->map_));

    const auto maps = MC_TRY(read_proc_text(kMaps));
    for (const auto& f : p->map_.files) {
        const auto id = MC_TRY(identify_file(f.path));
        auto found = find_mappings(maps, id);
        if (found.empty())
            return failf("{} (device {:x}:{:x}, inode {}) is not mapped in this process at its first decode: "
                         "the runtime reads the model without mmap (--no-mmap, use_mmap=false), or this "
                         "is another model than the one the runtime loaded",
                         f.path, id.dev_major, id.dev_minor, id.inode);
        p->files_.push_back(id);
        p->mappings_.push_back(std::move(found));
    }
    p->plan_ = MC_TRY(plan_sentinels(p->map_, p->mappings_, config.page_size, config.fault_around_bytes));
    p->pagemap_.reset(::open("/proc/self/pagemap", O_RDONLY | O_CLOEXEC));
    if (!p->pagemap_) return fail_errno("open /proc/self/pagemap");

    const uint32_t n = p->map_.n_experts;
    for (const auto& layer : p->map_.layers) {
        LayerCounts c;
        c.step.assign(n, 0);
        c.batch.assign(n, 0);
        c.tensor_step.assign(layer.tensors.size(), std::vector<uint64_t>(n, 0));
        c.seen_histogram.assign(n + 1, 0);
        p->layers_.push_back(std::move(c));
    }
    return p;
}

Result<void> RouteProbe::read_present(const SentinelSet& set, std::vector<uint8_t>& present) {
    const uint64_t page = plan_.page_size;
    const uintptr_t first = set.pages.front();
    const size_t entries = (set.pages.back() - first) / page + 1;
    pagemap_buf_.resize(entries);
    MC_TRY_VOID(pread_all(pagemap_.get(), pagemap_buf_.data(), entries * 8, first / page * 8, "/proc/self/pagemap"));
    present.resize(set.pages.size());
    for (size_t e = 0; e < set.pages.size(); ++e)
        present[e] = static_cast<uint8_t>(pagemap_buf_[(set.pages[e] - first) / page] >> 63);
    return {};
}

Result<void> RouteProbe::begin_decode() {
    const auto t0 = std::chrono::steady_clock::now();
    // The runtime may have freed the model (and something else may live at its addresses now):
    // MADV_DONTNEED goes only where the planned mappings still are.
    const auto maps = MC_TRY(read_proc_text(kMaps));
    for (size_t f = 0; f < files_.size(); ++f)
        if (!same_mappings(find_mappings(maps, files_[f]), mappings_[f]))
            return failf("the mapping of {} changed since the first decode (model freed or remapped)",
                         map_.files[f].path);
    for (const auto& set : plan_.sets)
        for (uintptr_t p : set.pages)
            if (::madvise(reinterpret_cast<void*>(p), plan_.page_size, MADV_DONTNEED) != 0)
                return fail_errno("madvise(MADV_DONTNEED) on a sentinel page of {}", map_.files[0].path);
    if (!checked_zap_) {
        uint64_t still = 0;
        std::vector<uint8_t> present;
        for (const auto& set : plan_.sets) {
            MC_TRY_VOID(read_present(set, present));
            still += static_cast<uint64_t>(std::count(present.begin(), present.end(), 1));
        }
        if (still != 0)
            return failf("{} sentinel pages stayed mapped after MADV_DONTNEED (a locked mapping?)", still);
        checked_zap_ = true;
    }
    probe_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return {};
}

Result<void> RouteProbe::finish_decode(int32_t n_tokens) {
    const auto t0 = std::chrono::steady_clock::now();
    ++decode_calls_;
    const uint32_t n = map_.n_experts;
    // [layer slot][expert]: how many of the layer's expert tensors were touched.
    std::vector<std::vector<uint8_t>> touched(layers_.size(), std::vector<uint8_t>(n, 0));
    std::vector<uint8_t> present;
    for (const auto& set : plan_.sets) {
        MC_TRY_VOID(read_present(set, present));
        auto& lc = layers_[set.layer_slot];
        for (uint32_t e = 0; e < n; ++e) {
            if (!present[e]) continue;
            ++touched[set.layer_slot][e];
            if (n_tokens == 1) ++lc.tensor_step[set.tensor][e];
        }
    }
    if (n_tokens == 1) ++steps_;
    if (n_tokens > 1) {
        ++batches_;
        batch_tokens_ += static_cast<uint64_t>(n_tokens);
    }
    for (size_t l = 0; l < layers_.size(); ++l) {
        auto& lc = layers_[l];
        const size_t n_tensors = map_.layers[l].tensors.size();
        uint32_t seen = 0;
        for (uint32_t e = 0; e < n; ++e) {
            const uint8_t t = touched[l][e];
            if (t == 0) continue;
            ++seen;
            if (n_tokens == 1) {
                ++lc.step[e];
                if (t != n_tensors) ++tensor_disagreements_;
            } else if (n_tokens > 1) {
                ++lc.batch[e];
            }
        }
        if (n_tokens == 1) ++lc.seen_histogram[seen];
    }
    probe_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return {};
}

double RouteProbe::mean_experts_per_layer_per_step() const {
    if (steps_ == 0) return 0.0;
    uint64_t seen = 0;
    for (const auto& lc : layers_) seen = std::accumulate(lc.step.begin(), lc.step.end(), seen);
    return static_cast<double>(seen) / static_cast<double>(steps_ * layers_.size());
}

nlohmann::json RouteProbe::report() const {
    using nlohmann::json;
    json j;
    j["tool"] = "moecache-routeprobe";
    j["model"] = config_.model_path;
    json files = json::array();
    for (const auto& f : map_.files) files.push_back(f.path);
    j["files"] = files;
    j["architecture"] = map_.architecture;
    j["n_layers"] = map_.layers.size();
    j["n_blocks"] = map_.n_blocks;
    j["n_experts"] = map_.n_experts;
    j["n_experts_used"] = map_.n_experts_used;
    uint64_t sentinels = 0;
    for (const auto& s : plan_.sets) sentinels += s.pages.size();
    j["method"] = {
        {"name", "per-decode sentinel pages: MADV_DONTNEED before, /proc/self/pagemap after"},
        {"page_size", plan_.page_size},
        {"fault_around_bytes", plan_.window},
        {"fault_around_source", config_.fault_around_source},
        {"min_slice_bytes", plan_.min_slice_bytes},
        {"sentinel_pages", sentinels},
    };
    j["decode_calls"] = decode_calls_;
    j["single_token_steps"] = steps_;
    j["batches"] = batches_;
    j["batch_tokens"] = batch_tokens_;
    j["tensor_disagreements"] = tensor_disagreements_;
    j["probe_seconds"] = probe_seconds_;
    j["mean_experts_per_layer_per_step"] = mean_experts_per_layer_per_step();

    json layers = json::array();
    std::vector<double> cov_sum(std::size(kFractions), 0.0);
    double rho_sum = 0;
    size_t rho_n = 0;
    for (size_t l = 0; l < layers_.size(); ++l) {
        const auto& lc = layers_[l];
        const auto& ml = map_.layers[l];
        json lj;
        lj["block"] = ml.index;
        lj["counts"] = lc.step;
        lj["batch_counts"] = lc.batch;
        json tj = json::object();
        for (size_t t = 0; t < ml.tensors.size(); ++t) tj[ml.tensors[t].name] = lc.tensor_step[t];
        lj["tensor_counts"] = tj;
        lj["experts_seen_histogram"] = lc.seen_histogram;
        const uint64_t seen = std::accumulate(lc.step.begin(), lc.step.end(), uint64_t{0});
        lj["mean_experts_per_step"] = steps_ ? static_cast<double>(seen) / static_cast<double>(steps_) : 0.0;
        lj["coverage"] = coverage_json(lc.step);
        for (size_t i = 0; i < std::size(kFractions); ++i) cov_sum[i] += coverage(lc.step, kFractions[i]);
        lj["spearman"] = nullptr;
        if (intended_) {
            std::vector<double> popularity(map_.n_experts), measured(map_.n_experts);
            std::vector<uint32_t> rank(map_.n_experts);
            for (uint32_t e = 0; e < map_.n_experts; ++e) {
                rank[e] = intended_->rank[size_t{ml.index} * map_.n_experts + e];
                popularity[e] = -static_cast<double>(rank[e]);
                measured[e] = static_cast<double>(lc.step[e]);
            }
            lj["intended_rank"] = rank;
            if (auto rho = spearman(popularity, measured)) {
                lj["spearman"] = *rho;
                rho_sum += *rho;
                ++rho_n;
            }
        }
        layers.push_back(std::move(lj));
    }
    json cov = json::object();
    for (size_t i = 0; i < std::size(kFractions); ++i)
        cov[fmt::format("{}", kFractions[i])] = layers_.empty() ? 0.0 : cov_sum[i] / static_cast<double>(layers_.size());
    j["coverage"] = cov;  // mean over layers
    j["spearman_mean"] = rho_n ? json(rho_sum / static_cast<double>(rho_n)) : json(nullptr);
    if (intended_) {
        // What the generator's own simulation of its router predicts, for comparison.
        const auto sim = mkmodel::simulate_popularity(map_.n_experts, map_.n_experts_used,
                                                      {intended_->skew_scale, intended_->skew_shape});
        const auto curve = mkmodel::coverage_curve(sim);
        json pred = json::object();
        for (double f : kFractions) pred[fmt::format("{}", f)] = mkmodel::coverage_at(curve, f);
        j["intended"] = {{"preset", intended_->preset},
                         {"skew_scale", intended_->skew_scale},
                         {"skew_shape", intended_->skew_shape},
                         {"predicted_coverage", pred}};
    } else {
        j["intended"] = nullptr;
    }
    j["layers"] = std::move(layers);
    return j;
}

}  // namespace moecache::routeprobe
