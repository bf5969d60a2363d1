// Router telemetry: which experts a layer's tokens were routed to. llama.cpp reads its router's
// choices back to the host (one small device-to-host copy of the ids tensor, `n_used` ids a
// token) and then copies, grouped, the experts those ids name. In decode that is one token; in a
// prompt batch, hundreds, and the copies then carry nearly every expert of the layer: the copy
// alone says only "the batch used these". The read-back says how many of its tokens chose each,
// which the report carries as levels (moecache/batch_report.h).
// It is used only where it checks out against the copy that follows (every id an expert of the
// layer, the copy's group the first run of what the ids name), else the copy's experts are the
// report, as they were. Each thread's last read-back is its own: the runtime reads ids and copies
// experts on one thread.
#include "engine.h"

#include "moecache/batch_report.h"

#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <vector>

namespace moecache::cuda::hook {
namespace {

constexpr size_t kMaxReadbackBytes = 256u << 10;  // 8 ids a token, 8 192 tokens
constexpr uint32_t kPerTokenReports = 16;         // batches of at most this many tokens: each token's experts

struct Readback {
    const void* dst = nullptr;
    size_t bytes = 0;
    uint64_t seq = 0;       // read-backs noted on this thread
    uint64_t used = 0;      // the read-back that gave this layer's report ...
    uint32_t model = UINT32_MAX, block = UINT32_MAX;  // ... and the layer it was for
    uint32_t tokens = 0;                              // ... and its tokens
    std::vector<int32_t> ids;
    std::vector<uint32_t> count, picked;
};
thread_local Readback t_readback;

}  // namespace

void Engine::note_readback(const void* dst, size_t bytes) {
    if (dst == nullptr || bytes < sizeof(int32_t) || bytes > kMaxReadbackBytes || bytes % sizeof(int32_t) != 0) return;
    Readback& rb = t_readback;
    rb.dst = dst;
    rb.bytes = bytes;
    ++rb.seq;
}

void Engine::report_copy(Model& m, const ExpertCopy& cls, bool routing) {
    Readback& rb = t_readback;
    if (rb.model != m.id || rb.block != cls.block) rb.tokens = 0;  // the batch it was read back for has moved on
    if (rb.dst != nullptr && rb.seq == rb.used && rb.model == m.id && rb.block == cls.block)
        return;  // a later group of a batch whose routing was reported from its read-back
    const uint32_t ne = m.map.n_experts, k = m.map.n_experts_used;
    if (rb.dst == nullptr || rb.seq == rb.used || k == 0 || (rb.bytes / sizeof(int32_t)) % k != 0) {
        if (routing) report(m, cls.block, cls.first_expert, cls.n_experts);
        return;
    }
    // Read as another process would (process_vm_readv): memory the runtime freed meanwhile is an
    // error here, never a fault in the runtime.
    const size_t n = rb.bytes / sizeof(int32_t);
    rb.ids.resize(n);
    iovec local{rb.ids.data(), rb.bytes}, remote{const_cast<void*>(rb.dst), rb.bytes};
    bool ok = ::process_vm_readv(::getpid(), &local, 1, &remote, 1, 0) == static_cast<ssize_t>(rb.bytes);
    rb.count.assign(ne, 0);
    for (size_t i = 0; ok && i < n; ++i) {
        const int32_t id = rb.ids[i];
        ok = id >= 0 && static_cast<uint32_t>(id) < ne;
        if (ok) ++rb.count[static_cast<size_t>(id)];
    }
    ok = ok && first_group_of(rb.count, cls.first_expert, cls.n_experts);
    if (!ok) {
        readbacks_refused_.fetch_add(1, std::memory_order_relaxed);
        if (routing) report(m, cls.block, cls.first_expert, cls.n_experts);
        return;
    }
    rb.used = rb.seq;
    rb.model = m.id;
    rb.block = cls.block;
    readback_reports_.fetch_add(1, std::memory_order_relaxed);
    const auto tokens = static_cast<uint32_t>(n / k);
    rb.tokens = tokens;
    if (tokens <= kPerTokenReports) {
        for (uint32_t t = 0; t < tokens; ++t) {
            rb.picked.clear();
            for (uint32_t j = 0; j < k; ++j) rb.picked.push_back(static_cast<uint32_t>(rb.ids[t * k + j]));
            report_experts(m, cls.block, rb.picked.data(), k, 1);
        }
        return;
    }
    // A prompt batch: the experts more of its tokens chose than an even share, with its token count
    // (the union would be nearly every expert, and heat flat), then its ranking by how many chose
    // each, as reports of 0 tokens (moecache/batch_report.h).
    batch_report(rb.count, tokens, k, rb.picked, [&](const std::vector<uint32_t>& e, uint32_t n_tokens) {
        report_experts(m, cls.block, e.data(), static_cast<uint32_t>(e.size()), n_tokens);
    });
}

const std::vector<uint32_t>* Engine::decode_readback(const Model& m, uint32_t block) {
    const Readback& rb = t_readback;
    if (rb.dst == nullptr || rb.seq != rb.used || rb.model != m.id || rb.block != block || rb.tokens == 0 ||
        rb.tokens > kPerTokenReports || rb.count.size() != m.map.n_experts)
        return nullptr;
    return &rb.count;
}

uint64_t Engine::readback_seq() { return t_readback.seq; }

bool Engine::first_group_of(const std::vector<uint32_t>& count, uint32_t first, uint32_t n) {
    const uint32_t end = first + n, ne = static_cast<uint32_t>(count.size());
    if (end > ne) return false;
    for (uint32_t e = 0; e < first; ++e)
        if (count[e] != 0) return false;
    for (uint32_t e = first; e < end; ++e)
        if (count[e] == 0) return false;
    return end == ne || count[end] == 0;
}

bool Engine::readback_is_batch(const Model& m, uint32_t block) {
    const Readback& rb = t_readback;
    return rb.dst != nullptr && rb.seq == rb.used && rb.model == m.id && rb.block == block && rb.tokens > kPerTokenReports;
}

}  // namespace moecache::cuda::hook
