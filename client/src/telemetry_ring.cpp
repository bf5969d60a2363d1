#include "moecache/client/telemetry_ring.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <utility>

namespace moecache::telemetry {
namespace {

// Offsets in the shared memory. The header is written once by the client; head and overflow by
// the producer only; tail by the consumer only.
constexpr size_t kMagicAt = 0, kVersionAt = 4, kRecordBytesAt = 8, kCapacityAt = 12;
constexpr size_t kHeadAt = 64, kOverflowAt = 72, kTailAt = 128;

struct WireRecord {
    uint64_t time_ns;
    uint32_t model;
    uint16_t block;
    uint8_t n_experts;
    uint8_t flags;
    uint32_t tokens;
    uint16_t experts[kMaxExpertsPerRecord];
};
static_assert(sizeof(WireRecord) == kRecordBytes);

uint64_t* at64(uint8_t* base, size_t off) { return reinterpret_cast<uint64_t*>(base + off); }
uint32_t* at32(uint8_t* base, size_t off) { return reinterpret_cast<uint32_t*>(base + off); }

uint32_t capacity_for(uint32_t ring_bytes) {
    if (ring_bytes < kRingHeaderBytes + kRecordBytes) return 0;
    uint64_t n = (ring_bytes - kRingHeaderBytes) / kRecordBytes;
    uint32_t p = 1;
    while (uint64_t{p} * 2 <= n) p *= 2;
    return p;
}

}  // namespace

TelemetryRing::TelemetryRing(TelemetryRing&& o) noexcept
    : fd_(std::move(o.fd_)), base_(std::exchange(o.base_, nullptr)), bytes_(std::exchange(o.bytes_, 0)),
      capacity_(o.capacity_), consumed_(o.consumed_) {}

TelemetryRing& TelemetryRing::operator=(TelemetryRing&& o) noexcept {
    if (this != &o) {
        if (base_) ::munmap(base_, bytes_);
        fd_ = std::move(o.fd_);
        base_ = std::exchange(o.base_, nullptr);
        bytes_ = std::exchange(o.bytes_, 0);
        capacity_ = o.capacity_;
        consumed_ = o.consumed_;
    }
    return *this;
}

TelemetryRing::~TelemetryRing() {
    if (base_) ::munmap(base_, bytes_);
}

Result<TelemetryRing> TelemetryRing::create(uint32_t ring_bytes) {
    const uint32_t cap = capacity_for(ring_bytes);
    if (cap == 0) return failf("a telemetry ring of {} bytes holds no record", ring_bytes);
    TelemetryRing r;
    r.fd_.reset(::memfd_create("moecache-telemetry", MFD_CLOEXEC | MFD_ALLOW_SEALING));
    if (!r.fd_) return fail_errno("memfd_create for the telemetry ring");
    if (::ftruncate(r.fd_.get(), ring_bytes) != 0) return fail_errno("sizing the telemetry ring to {} bytes", ring_bytes);
    if (::fcntl(r.fd_.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0)
        return fail_errno("sealing the telemetry ring");
    void* p = ::mmap(nullptr, ring_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, r.fd_.get(), 0);
    if (p == MAP_FAILED) return fail_errno("mapping the telemetry ring");
    r.base_ = static_cast<uint8_t*>(p);
    r.bytes_ = ring_bytes;
    r.capacity_ = cap;
    *at32(r.base_, kMagicAt) = kRingMagic;
    *at32(r.base_, kVersionAt) = kRingVersion;
    *at32(r.base_, kRecordBytesAt) = kRecordBytes;
    *at32(r.base_, kCapacityAt) = cap;
    return r;
}

Result<TelemetryRing> TelemetryRing::attach(int fd, uint32_t ring_bytes) {
    struct stat st {};
    if (::fstat(fd, &st) != 0) return fail_errno("the telemetry ring's descriptor");
    if (!S_ISREG(st.st_mode)) return failf("the telemetry ring's descriptor is not a memfd (not a regular file)");
    if (st.st_size != static_cast<off_t>(ring_bytes))
        return failf("the telemetry ring's memfd has {} bytes, not the {} announced", st.st_size, ring_bytes);
    const int seals = ::fcntl(fd, F_GET_SEALS);
    if (seals < 0) return fail_errno("the telemetry ring's descriptor is not a sealable memfd");
    if (!(seals & F_SEAL_SHRINK))
        return failf("the telemetry ring's memfd is not sealed against shrinking (F_SEAL_SHRINK): refused, since a "
                     "client could then make the daemon fault");
    const uint32_t cap = capacity_for(ring_bytes);
    if (cap == 0) return failf("a telemetry ring of {} bytes holds no record", ring_bytes);
    void* p = ::mmap(nullptr, ring_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) return fail_errno("mapping the telemetry ring");
    TelemetryRing r;
    r.base_ = static_cast<uint8_t*>(p);
    r.bytes_ = ring_bytes;
    r.capacity_ = cap;
    r.fd_.reset(::fcntl(fd, F_DUPFD_CLOEXEC, 0));
    const uint32_t magic = __atomic_load_n(at32(r.base_, kMagicAt), __ATOMIC_RELAXED);
    const uint32_t version = __atomic_load_n(at32(r.base_, kVersionAt), __ATOMIC_RELAXED);
    const uint32_t rb = __atomic_load_n(at32(r.base_, kRecordBytesAt), __ATOMIC_RELAXED);
    const uint32_t c = __atomic_load_n(at32(r.base_, kCapacityAt), __ATOMIC_RELAXED);
    if (magic != kRingMagic || version != kRingVersion || rb != kRecordBytes || c != cap)
        return failf("the telemetry ring's header (magic {:#x}, version {}, record {} bytes, {} records) is not a "
                     "version-{} ring of {} bytes",
                     magic, version, rb, c, kRingVersion, ring_bytes);
    r.consumed_ = __atomic_load_n(at64(r.base_, kTailAt), __ATOMIC_ACQUIRE);
    return r;
}

bool TelemetryRing::push(const RoutingEvent& e) {
    uint64_t* head = at64(base_, kHeadAt);
    const uint64_t h = __atomic_load_n(head, __ATOMIC_RELAXED);
    const uint64_t t = __atomic_load_n(at64(base_, kTailAt), __ATOMIC_ACQUIRE);
    if (h - t >= capacity_) {
        uint64_t* overflow = at64(base_, kOverflowAt);
        __atomic_store_n(overflow, __atomic_load_n(overflow, __ATOMIC_RELAXED) + 1, __ATOMIC_RELAXED);
        return false;
    }
    WireRecord w{};
    w.time_ns = e.time_ns;
    w.model = e.model;
    w.block = e.block;
    w.n_experts = std::min<uint8_t>(e.n_experts, kMaxExpertsPerRecord);
    w.flags = e.continued ? kRecordContinued : 0;
    w.tokens = e.tokens;
    std::memcpy(w.experts, e.experts, sizeof w.experts);
    std::memcpy(base_ + kRingHeaderBytes + (h & (capacity_ - 1)) * kRecordBytes, &w, sizeof w);
    __atomic_store_n(head, h + 1, __ATOMIC_RELEASE);
    return true;
}

Result<size_t> TelemetryRing::consume_raw(void (*fn)(void*, const RoutingEvent&), void* ctx, size_t max) {
    const uint64_t h = __atomic_load_n(at64(base_, kHeadAt), __ATOMIC_ACQUIRE);
    uint64_t t = consumed_;
    if (h < t || h - t > capacity_)
        return failf("the telemetry ring's head ({}) is impossible against its tail ({}) and {} records: the client "
                     "wrote over the ring's positions",
                     h, t, capacity_);
    size_t n = 0;
    while (t < h && n < max) {
        WireRecord w;
        std::memcpy(&w, base_ + kRingHeaderBytes + (t & (capacity_ - 1)) * kRecordBytes, sizeof w);
        RoutingEvent e;
        e.time_ns = w.time_ns;
        e.model = w.model;
        e.block = w.block;
        e.n_experts = std::min<uint8_t>(w.n_experts, kMaxExpertsPerRecord);
        e.continued = (w.flags & kRecordContinued) != 0;
        e.tokens = w.tokens;
        std::memcpy(e.experts, w.experts, sizeof e.experts);
        fn(ctx, e);
        ++t;
        ++n;
    }
    consumed_ = t;
    __atomic_store_n(at64(base_, kTailAt), t, __ATOMIC_RELEASE);
    return n;
}

RingCounters TelemetryRing::counters() const {
    RingCounters c;
    c.pushed = __atomic_load_n(at64(base_, kHeadAt), __ATOMIC_ACQUIRE);
    c.overflow = __atomic_load_n(at64(base_, kOverflowAt), __ATOMIC_RELAXED);
    c.consumed = consumed_;
    return c;
}

}  // namespace moecache::telemetry
