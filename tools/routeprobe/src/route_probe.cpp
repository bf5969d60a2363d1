#include "moecache/routeprobe/route_probe.h"

#include "moecache/file_util.h"
#include "moecache/mkmodel/router_skew.h"
#include "moecache/mkmodel/synth_model.h"
#include "moecache/routeprobe/routing_stats.h"
#include "moecache/trace_format.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <numeric>

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22  // Linux 5.14; older headers lack it
#endif

namespace moecache::routeprobe {
namespace {

constexpr const char* kMaps = "/proc/self/maps";
constexpr double kFractions[] = {0.125, 0.25, 0.5};

// The generator's record of the ranking it built in, if this model came from moecache-mkmodel.
Result<std::optional<IntendedRouting>> read_intended(const GgufFile& head, const ExpertMap& map) {
    auto rank = MC_TRY(mkmodel::read_expert_ranks(head, map));
    if (!rank) return std::optional<IntendedRouting>{};
    IntendedRouting r;
    r.rank = std::move(*rank);
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

double split_half_coverage(const std::vector<uint64_t> (&half)[2], double fraction) {
    return (held_out_coverage(half[0], half[1], fraction) + held_out_coverage(half[1], half[0], fraction)) / 2;
}

}  // namespace

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
        p->vmas_before_ += found.size();
        found = merge_adjacent(std::move(found));
        if (found.empty())
            return failf("{} (device {:x}:{:x}, inode {}) is not mapped in this process at its first decode: "
                         "the runtime reads the model without mmap (--no-mmap, use_mmap=false), or this "
                         "is another model than the one the runtime loaded",
                         f.path, id.dev_major, id.dev_minor, id.inode);
        p->files_.push_back(id);
        p->mappings_.push_back(std::move(found));
    }
    p->plan_ = MC_TRY(plan_sentinels(p->map_, p->mappings_, config.page_size));
    p->pagemap_.reset(::open("/proc/self/pagemap", O_RDONLY | O_CLOEXEC));
    if (!p->pagemap_) return fail_errno("open /proc/self/pagemap");
    MC_TRY_VOID(p->isolate_sentinels());
    for (const auto& set : p->plan_.sets)
        for (uintptr_t page : set.pages) p->zap_list_.push_back({reinterpret_cast<void*>(page), config.page_size});
    p->pidfd_.reset(static_cast<int>(::syscall(SYS_pidfd_open, ::getpid(), 0u)));

    const uint32_t n = p->map_.n_experts;
    for (const auto& layer : p->map_.layers) {
        LayerCounts c;
        c.step.assign(n, 0);
        c.half[0].assign(n, 0);
        c.half[1].assign(n, 0);
        c.batch.assign(n, 0);
        c.tensor_step.assign(layer.tensors.size(), std::vector<uint64_t>(n, 0));
        c.seen_histogram.assign(n + 1, 0);
        p->layers_.push_back(std::move(c));
    }
    return p;
}

uint64_t RouteProbe::unisolated_sentinels(std::string_view maps) const {
    std::vector<FileMapping> vmas;
    for (const auto& id : files_) {
        auto found = find_mappings(maps, id);
        vmas.insert(vmas.end(), found.begin(), found.end());
    }
    std::sort(vmas.begin(), vmas.end(), [](const FileMapping& a, const FileMapping& b) { return a.start < b.start; });
    uint64_t bad = 0;
    for (const auto& set : plan_.sets)
        for (size_t e = 0; e < set.pages.size(); ++e) {
            auto it = std::upper_bound(vmas.begin(), vmas.end(), set.pages[e],
                                       [](uintptr_t a, const FileMapping& v) { return a < v.start; });
            const bool inside = it != vmas.begin() && set.pages[e] < std::prev(it)->end &&
                                std::prev(it)->start >= set.pieces[e].begin && std::prev(it)->end <= set.pieces[e].end;
            if (!inside) ++bad;
        }
    return bad;
}

Result<void> RouteProbe::isolate_sentinels() {
    uint64_t maps_now = 0, limit = 0;
    if (auto text = read_proc_text(kMaps)) maps_now = static_cast<uint64_t>(std::count(text->begin(), text->end(), '\n'));
    if (auto text = read_proc_text("/proc/sys/vm/max_map_count")) limit = std::strtoull(text->c_str(), nullptr, 10);
    const uint64_t needed = 2 * plan_.pieces.size() + 1;
    if (limit != 0 && maps_now + needed + 1024 > limit)
        return failf("one VMA per expert slice needs up to {} more mappings, and vm.max_map_count is {} with {} "
                     "in use: raise it (sysctl vm.max_map_count)", needed, limit, maps_now);
    // Two flags the runtime does not rely on, one for even pieces and one for odd ones, so that
    // neighbours differ from each other and from what lies between expert tensors. The next pair
    // is tried (on top) where the mapping already carries one of them. MADV_RANDOM only matters to
    // reads from storage, of which a cached model has none; MADV_DONTDUMP only to core dumps.
    struct Pair {
        int advice[2];
        const char* name;
    };
    const Pair pairs[] = {{{MADV_NOHUGEPAGE, MADV_DONTDUMP}, "MADV_NOHUGEPAGE / MADV_DONTDUMP"},
                          {{MADV_DONTDUMP, MADV_RANDOM}, "MADV_DONTDUMP / MADV_RANDOM"},
                          {{MADV_RANDOM, MADV_NOHUGEPAGE}, "MADV_RANDOM / MADV_NOHUGEPAGE"}};
    uint64_t bad = plan_.n_sentinels;
    for (const auto& pair : pairs) {
        bool ok = true;
        for (size_t i = 0; i < plan_.pieces.size() && ok; ++i) {
            const auto& r = plan_.pieces[i];
            ok = ::madvise(reinterpret_cast<void*>(r.begin), r.end - r.begin, pair.advice[i % 2]) == 0;
        }
        if (!ok) continue;
        const auto maps = MC_TRY(read_proc_text(kMaps));
        bad = unisolated_sentinels(maps);
        if (bad == 0) {
            isolation_flags_ = pair.name;
            for (const auto& id : files_) vmas_after_ += find_mappings(maps, id).size();
            break;
        }
    }
    if (isolation_flags_.empty())
        return failf("could not give each expert slice a VMA of its own ({} of {} sentinels share one): "
                     "without that, one fault maps the pages of several experts", bad, plan_.n_sentinels);
    populate_cached();
    return {};
}

void RouteProbe::populate_cached() {
    // Splitting a VMA inside a huge-page mapping unmaps that range. Map again now what is in the
    // page cache, so that the runtime's own faults (first touches) do not happen during the
    // measurement; what is not cached is left alone rather than read from storage. Optional:
    // MADV_POPULATE_READ arrived in Linux 5.14, and without it the first decodes fault a little more.
    const uintptr_t page = plan_.page_size;
    std::vector<unsigned char> resident;
    for (const auto& file_maps : mappings_)
        for (const auto& m : file_maps) {
            resident.assign((m.end - m.start) / page, 0);
            if (::mincore(reinterpret_cast<void*>(m.start), m.end - m.start, resident.data()) != 0) continue;
            for (size_t i = 0; i < resident.size();) {
                if (!(resident[i] & 1)) {
                    ++i;
                    continue;
                }
                size_t j = i;
                while (j < resident.size() && (resident[j] & 1)) ++j;
                (void)::madvise(reinterpret_cast<void*>(m.start + i * page), (j - i) * page, MADV_POPULATE_READ);
                i = j;
            }
        }
}

Result<void> RouteProbe::read_present(const SentinelSet& set, std::vector<uint8_t>& present) {
    const uint64_t page = plan_.page_size;
    const uintptr_t first = set.pages.front();
    const size_t entries = (set.pages.back() - first) / page + 1;
    pagemap_buf_.resize(entries);
    MC_TRY_VOID(pread_exact(pagemap_.get(), pagemap_buf_.data(), entries * 8, first / page * 8, "/proc/self/pagemap"));
    present.resize(set.pages.size());
    for (size_t e = 0; e < set.pages.size(); ++e)
        present[e] = static_cast<uint8_t>(pagemap_buf_[(set.pages[e] - first) / page] >> 63);
    return {};
}

Result<void> RouteProbe::zap_sentinels() {
    // One process_madvise call per 1024 pages flushes the TLB once per call instead of once per
    // page: 0.2 instead of 1.7 us a page here. Older kernels refuse MADV_DONTNEED there (EINVAL);
    // then one madvise per page.
    size_t done = 0;
    while (pidfd_ && done < zap_list_.size()) {
        const size_t n = std::min<size_t>(zap_list_.size() - done, 1024);
        const long rc = ::syscall(SYS_process_madvise, pidfd_.get(), zap_list_.data() + done, n, MADV_DONTNEED, 0u);
        if (rc <= 0) {
            pidfd_.reset();  // not supported here: from now on, one madvise per page
            break;
        }
        done += static_cast<size_t>(rc) / plan_.page_size;
    }
    for (; done < zap_list_.size(); ++done)
        if (::madvise(zap_list_[done].iov_base, plan_.page_size, MADV_DONTNEED) != 0)
            return fail_errno("madvise(MADV_DONTNEED) on a sentinel page of {}", map_.files[0].path);
    return {};
}

Result<void> RouteProbe::begin_decode() {
    const auto t0 = std::chrono::steady_clock::now();
    // The runtime may have freed the model (and something else may live at its addresses now):
    // MADV_DONTNEED goes only where the planned mappings still are.
    const auto maps = MC_TRY(read_proc_text(kMaps));
    for (size_t f = 0; f < files_.size(); ++f)
        if (!same_mappings(merge_adjacent(find_mappings(maps, files_[f])), mappings_[f]))
            return failf("the mapping of {} changed since the first decode (model freed or remapped)",
                         map_.files[f].path);
    const auto t1 = std::chrono::steady_clock::now();
    check_seconds_ += std::chrono::duration<double>(t1 - t0).count();
    MC_TRY_VOID(zap_sentinels());
    zap_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();
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
    if (!trace_full_) {
        const auto us = std::chrono::duration_cast<std::chrono::microseconds>(t0 - created_).count();
        std::vector<uint32_t> experts;
        for (size_t l = 0; l < layers_.size(); ++l) {
            experts.clear();
            for (uint32_t e = 0; e < n; ++e)
                if (touched[l][e]) experts.push_back(e);
            trace::append_decision(trace_decisions_, static_cast<uint64_t>(us), 0, map_.layers[l].index,
                                   static_cast<uint32_t>(std::max(n_tokens, 1)), experts);
        }
        trace_full_ = trace_decisions_.size() >= kMaxTraceBytes;
    }
    const size_t parity = steps_ % 2;
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
                ++lc.half[parity][e];
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

std::string RouteProbe::trace() const {
    return trace::header_line(0) + trace::model_line(trace::model_of(0, map_, config_.model_path)) + trace_decisions_;
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
    j["trace_truncated"] = trace_full_;
    uint64_t sentinels = 0;
    for (const auto& s : plan_.sets) sentinels += s.pages.size();
    j["method"] = {
        {"name", "per-decode sentinel pages: MADV_DONTNEED before, /proc/self/pagemap after"},
        {"page_size", plan_.page_size},
        {"min_slice_bytes", plan_.min_slice_bytes},
        {"sentinel_pages", sentinels},
        {"isolation", fmt::format("one VMA per expert slice, neighbours marked {}", isolation_flags_)},
        {"model_vmas_before", vmas_before_},
        {"model_vmas_after", vmas_after_},
    };
    j["decode_calls"] = decode_calls_;
    j["single_token_steps"] = steps_;
    j["batches"] = batches_;
    j["batch_tokens"] = batch_tokens_;
    j["tensor_disagreements"] = tensor_disagreements_;
    j["probe_seconds"] = probe_seconds_;
    j["probe_seconds_checking_maps"] = check_seconds_;
    j["probe_seconds_zapping"] = zap_seconds_;
    j["mean_experts_per_layer_per_step"] = mean_experts_per_layer_per_step();

    json layers = json::array();
    std::vector<double> cov_sum(std::size(kFractions), 0.0), half_sum(std::size(kFractions), 0.0);
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
        json cj = json::object(), hj = json::object();
        for (size_t i = 0; i < std::size(kFractions); ++i) {
            const auto key = fmt::format("{}", kFractions[i]);
            cj[key] = coverage(lc.step, kFractions[i]);
            hj[key] = split_half_coverage(lc.half, kFractions[i]);
            cov_sum[i] += cj[key].get<double>();
            half_sum[i] += hj[key].get<double>();
        }
        lj["coverage"] = cj;
        lj["coverage_split_half"] = hj;
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
    json cov = json::object(), half = json::object();
    const auto n_layers = static_cast<double>(layers_.size());
    for (size_t i = 0; i < std::size(kFractions); ++i) {
        cov[fmt::format("{}", kFractions[i])] = cov_sum[i] / n_layers;
        half[fmt::format("{}", kFractions[i])] = half_sum[i] / n_layers;
    }
    j["coverage"] = cov;  // means over layers
    j["coverage_split_half"] = half;
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
