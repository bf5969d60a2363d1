// Copies that miss the pool, at DMA speed without page-locking the model: the hook's own threads
// copy the bytes into a few pinned buffers, and the device reads each buffer while the next one
// is filled. The driver stages a copy from pageable memory too, but with one thread (about 10 GB/s
// on an H200 host against ~47 GB/s from pinned memory); several threads reading the page cache
// keep up with the DMA.
#pragma once

#include "cuda_api.h"

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace moecache::cuda::hook {

struct Driver;

// Where a miss's bytes come from: the runtime's mapping of the model, and where the hook holds the
// file open, the same bytes in the file. They are read from the file (pread) rather than through
// the mapping: a lazily loaded model (MADV_RANDOM) faults a page at a time, one synchronous 4 KiB
// read each from storage, where pread reads the whole part in large requests, several threads at
// once, and from the page cache as fast as a memcpy.
struct HostBytes {
    const uint8_t* src = nullptr;
    int fd = -1;               // -1: the mapping only
    uint64_t file_offset = 0;  // of src[0]
    [[nodiscard]] HostBytes at(size_t off) const { return {src + off, fd, file_offset + off}; }
};
// n bytes of `from` into dst: pread from the file where there is one, the mapping for what it did not give.
void read_host_bytes(uint8_t* dst, const HostBytes& from, size_t n);
// Bytes read_host_bytes has read from files, in this process.
uint64_t host_bytes_read_from_files();
// Whether every page of [p, p + n) is in the page cache (mincore): a copy through the mapping of
// one that is not would fault it in from storage a page at a time.
bool resident(const uint8_t* p, size_t n);

// memcpy by several threads at once. The threads spin briefly after a copy (the next one often
// comes within microseconds) and then sleep.
class CopyCrew {
public:
    CopyCrew() = default;
    ~CopyCrew();
    CopyCrew(const CopyCrew&) = delete;
    CopyCrew& operator=(const CopyCrew&) = delete;
    // Starts `helpers` threads (0: the caller copies alone). Once, before any copy.
    void start(unsigned helpers);
    [[nodiscard]] unsigned helpers() const { return static_cast<unsigned>(threads_.size()); }
    // Returns when all `n` bytes are copied; the caller copies a share. Copies that come while
    // another is under way are done by their caller alone.
    void copy(void* dst, const HostBytes& src, size_t n);

private:
    void work();
    bool take_part(uint32_t generation);

    std::vector<std::thread> threads_;
    std::mutex busy_;
    std::atomic<uint32_t> generation_{0};
    std::atomic<uint64_t> next_{0};  // generation << 32 | the next part to take
    std::atomic<uint32_t> done_parts_{0};
    std::atomic<bool> stopping_{false};
    uint8_t* dst_ = nullptr;
    HostBytes src_;
    size_t n_ = 0, part_ = 0;
    uint32_t parts_ = 0;
};

// A device's pinned buffers. Each piece of a copy claims a buffer no other copy holds (a lock of
// its own, never the pool's, held only to claim and give back: no wait under it); a buffer is
// reused once the device has read it, and a buffer the device has not read within a bound (its
// stream waits on something the runtime has yet to do), or none free, is not waited for: that
// piece goes the driver's way.
class StagingRing {
public:
    // In the device's context (current on the calling thread). Null when pinned memory or events
    // cannot be had.
    static std::unique_ptr<StagingRing> create(const Driver* drv, CopyCrew* crew, size_t buffer_bytes, int buffers);
    ~StagingRing();
    StagingRing(const StagingRing&) = delete;
    StagingRing& operator=(const StagingRing&) = delete;

    // Queues the copy of [src, src + n) to dst on `stream`, in order with what the stream has queued.
    // Returns when the bytes are in pinned buffers (the source may change after that, as with the
    // driver's own copies from pageable memory). *staged counts what went through the buffers.
    CUresult copy(CUdeviceptr dst, const HostBytes& src, size_t n, CUstream stream, uint64_t* staged);
    [[nodiscard]] size_t buffer_bytes() const { return buffer_bytes_; }

private:
    struct Buffer {
        uint8_t* host = nullptr;
        CUevent read = nullptr;  // recorded after the device's read of it
        bool queued = false;     // the claimer's alone (claimed under mu_, then used without it)
        bool claimed = false;    // under mu_: a copy is using it
    };
    StagingRing(const Driver* drv, CopyCrew* crew, size_t buffer_bytes) : drv_(drv), crew_(crew), buffer_bytes_(buffer_bytes) {}
    // The next buffer no copy holds, in ring order, or null when every one is held.
    Buffer* claim();
    void give_back(Buffer& b);
    bool wait_free(Buffer& b);

    const Driver* drv_;
    CopyCrew* crew_;
    size_t buffer_bytes_;
    std::mutex mu_;
    std::vector<Buffer> buffers_;
    size_t next_ = 0;
};

}  // namespace moecache::cuda::hook
