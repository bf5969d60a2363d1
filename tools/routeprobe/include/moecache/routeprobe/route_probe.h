// Measures which experts each decode of a GGUF runtime reads, from inside the runtime's process,
// without root: before a decode, the page-table entry of one sentinel page per (layer, expert
// tensor, expert) is zapped with MADV_DONTNEED (the page stays in the page cache, so the next
// touch is a cheap minor fault); after it, /proc/self/pagemap says which sentinels were touched
// again. That works where the runtime computes experts on the CPU straight from its mmap of the
// model file (llama.cpp's mul_mat_id reads only the selected experts' rows); weights repacked
// into anonymous memory or copied to a GPU are not seen, and the report's self-check (experts
// seen per layer per step against expert_used_count) shows it.
//
// The probe changes the runtime's mapping, not what it computes: the mapping is cut into one VMA
// per expert slice (sentinel_plan.h says why), which also means 4 KiB page-table entries where
// there were 2 MiB ones, and the sentinels fault once per decode that reads them. Costs here
// (Linux 6.18, 8 layers x 64 experts x 3 tensors): 1561 VMAs, ~4 ms per decode in the probe.
//
// Threads: the interposed decode entry point serialises begin/finish under one mutex; the probe
// itself has no locking.
#pragma once

#include "moecache/error.h"
#include "moecache/model.h"
#include "moecache/process_maps.h"
#include "moecache/routeprobe/sentinel_plan.h"
#include "moecache/unique_fd.h"

#include <nlohmann/json.hpp>

#include <sys/uio.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace moecache::routeprobe {

// What the generator (moecache-mkmodel) says it intended, when the model carries it.
struct IntendedRouting {
    std::string preset;
    double skew_scale = 0;
    double skew_shape = 0;
    std::vector<uint32_t> rank;  // [block * n_experts + e], 0 = hottest
};

struct ProbeConfig {
    std::string model_path;
    uint64_t page_size = 4096;
};

class RouteProbe {
public:
    // Loads the expert map, finds this process's mappings of every model file, plans sentinels and
    // cuts the mappings into one VMA per expert slice (see sentinel_plan.h).
    static Result<std::unique_ptr<RouteProbe>> create(const ProbeConfig& config);

    // Before a decode: checks that the mappings are still the ones planned for, zaps sentinels.
    Result<void> begin_decode();
    // After a decode of `n_tokens` tokens: counts the experts whose sentinels were touched.
    Result<void> finish_decode(int32_t n_tokens);

    [[nodiscard]] nlohmann::json report() const;
    // Every decode measured, as a router trace (docs/trace.md): one decision per MoE layer with
    // the experts whose sentinels were touched, the decode's token count as its tokens. Kept up
    // to kMaxTraceBytes of decisions; what comes after is left out (the report says so).
    static constexpr size_t kMaxTraceBytes = size_t{256} << 20;
    [[nodiscard]] std::string trace() const;
    [[nodiscard]] uint64_t single_token_steps() const { return steps_; }
    [[nodiscard]] double mean_experts_per_layer_per_step() const;

private:
    RouteProbe() = default;
    Result<void> read_present(const SentinelSet& set, std::vector<uint8_t>& present);
    Result<void> isolate_sentinels();
    void populate_cached();
    Result<void> zap_sentinels();
    // Sentinels whose VMA, in the text of /proc/self/maps, reaches outside their expert's slice.
    [[nodiscard]] uint64_t unisolated_sentinels(std::string_view maps) const;

    ProbeConfig config_;
    ExpertMap map_;
    std::optional<IntendedRouting> intended_;
    std::vector<InodeId> files_;
    std::vector<std::vector<FileMapping>> mappings_;  // [file], as found, contiguous runs merged
    SentinelPlan plan_;
    UniqueFd pagemap_;
    UniqueFd pidfd_;  // this process, for process_madvise; closed where that is not supported
    std::vector<iovec> zap_list_;  // every sentinel page
    std::vector<uint64_t> pagemap_buf_;
    bool checked_zap_ = false;
    std::string isolation_flags_;  // the madvise advice that keeps the VMA pieces apart
    uint64_t vmas_before_ = 0, vmas_after_ = 0;  // lines of /proc/self/maps for the model files

    // Counts. "step" = a decode of one token; batches of more tokens are kept apart, since the
    // experts of a batch are the union over its tokens.
    uint64_t decode_calls_ = 0;
    uint64_t steps_ = 0;
    uint64_t batches_ = 0;
    uint64_t batch_tokens_ = 0;
    uint64_t tensor_disagreements_ = 0;  // an expert with some but not all sentinels touched
    double probe_seconds_ = 0;  // spent in the probe, all told
    double check_seconds_ = 0;  // of which re-reading /proc/self/maps before each decode
    double zap_seconds_ = 0;    // and MADV_DONTNEED on the sentinels
    std::string trace_decisions_;  // the decision lines of trace()
    bool trace_full_ = false;
    std::chrono::steady_clock::time_point created_ = std::chrono::steady_clock::now();
    struct LayerCounts {
        std::vector<uint64_t> step;   // [expert], single-token steps
        std::vector<uint64_t> half[2];  // [expert], single-token steps of even / odd number
        std::vector<uint64_t> batch;  // [expert], batches
        std::vector<std::vector<uint64_t>> tensor_step;  // [tensor][expert], single-token steps
        std::vector<uint64_t> seen_histogram;  // [k]: steps in which k experts of the layer were seen
    };
    std::vector<LayerCounts> layers_;  // [layer slot]
};

}  // namespace moecache::routeprobe
