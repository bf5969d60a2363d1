// A timeline of what the GPU did, for bench/gpu-timeline.py: every copy, memset and kernel with its
// device start and end (CUPTI's activity records, nanoseconds on one clock), and every wait of the
// host for a stream or the device. Loaded by the CUDA driver into any CUDA program, unmodified:
//
//   CUDA_INJECTION64_PATH=libmoecache-gputrace.so MOECACHE_GPU_TRACE=FILE program ...
//
// One line per record, written as CUPTI hands buffers back and at exit:
//   C kind src_kind bytes start end stream     (a copy: kind 1 host-to-device, 2 device-to-host,
//                                               8 device-to-device, 10 peer; src_kind 1 pageable,
//                                               2 pinned, 3 device)
//   S start end stream                         (a memset)
//   K start end stream name                    (a kernel; the name cut at 60 characters)
//   Y start end stream type                    (the host waiting: type 3 a stream, 4 a context)
// The records are the device's own times, so a hook or a library in the program changes nothing of
// them but its own work; CUPTI's own cost is a few microseconds of host time a buffer.
#include <cupti.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>

namespace {

constexpr size_t kBufferBytes = 8u << 20;

std::mutex g_mu;
FILE* g_out = nullptr;
std::atomic<bool> g_started{false};

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
    *buffer = static_cast<uint8_t*>(aligned_alloc(8, kBufferBytes));
    *size = *buffer != nullptr ? kBufferBytes : 0;
    *max_records = 0;
}

void write_record(const CUpti_Activity* r) {
    switch (r->kind) {
        case CUPTI_ACTIVITY_KIND_MEMCPY: {
            const auto* m = reinterpret_cast<const CUpti_ActivityMemcpy6*>(r);
            fprintf(g_out, "C %u %u %llu %llu %llu %u\n", static_cast<unsigned>(m->copyKind),
                    static_cast<unsigned>(m->srcKind), static_cast<unsigned long long>(m->bytes),
                    static_cast<unsigned long long>(m->start), static_cast<unsigned long long>(m->end), m->streamId);
            break;
        }
        case CUPTI_ACTIVITY_KIND_MEMSET: {
            const auto* m = reinterpret_cast<const CUpti_ActivityMemset4*>(r);
            fprintf(g_out, "S %llu %llu %u\n", static_cast<unsigned long long>(m->start),
                    static_cast<unsigned long long>(m->end), m->streamId);
            break;
        }
        case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL:
        case CUPTI_ACTIVITY_KIND_KERNEL: {
            const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(r);
            fprintf(g_out, "K %llu %llu %u %.60s\n", static_cast<unsigned long long>(k->start),
                    static_cast<unsigned long long>(k->end), k->streamId, k->name != nullptr ? k->name : "?");
            break;
        }
        case CUPTI_ACTIVITY_KIND_SYNCHRONIZATION: {
            const auto* y = reinterpret_cast<const CUpti_ActivitySynchronization2*>(r);
            fprintf(g_out, "Y %llu %llu %u %u\n", static_cast<unsigned long long>(y->start),
                    static_cast<unsigned long long>(y->end), y->streamId, static_cast<unsigned>(y->type));
            break;
        }
        default:
            break;
    }
}

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
    {
        std::lock_guard lock(g_mu);
        CUpti_Activity* r = nullptr;
        while (g_out != nullptr && cuptiActivityGetNextRecord(buffer, valid, &r) == CUPTI_SUCCESS) write_record(r);
    }
    free(buffer);
}

void finish() {
    cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
    std::lock_guard lock(g_mu);
    if (g_out != nullptr) {
        fclose(g_out);
        g_out = nullptr;
    }
}

bool start() {
    if (g_started.exchange(true)) return true;
    const char* path = getenv("MOECACHE_GPU_TRACE");
    if (path == nullptr || *path == '\0') {
        fprintf(stderr, "moecache-gputrace: MOECACHE_GPU_TRACE (the file to write) is not set: not tracing\n");
        return false;
    }
    g_out = fopen(path, "w");
    if (g_out == nullptr) {
        fprintf(stderr, "moecache-gputrace: cannot write %s: %s\n", path, strerror(errno));
        return false;
    }
    setvbuf(g_out, nullptr, _IOFBF, 1 << 20);
    const char* why = nullptr;
    if (cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed) != CUPTI_SUCCESS) why = "register callbacks";
    for (CUpti_ActivityKind k : {CUPTI_ACTIVITY_KIND_MEMCPY, CUPTI_ACTIVITY_KIND_MEMSET,
                                 CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, CUPTI_ACTIVITY_KIND_SYNCHRONIZATION})
        if (why == nullptr && cuptiActivityEnable(k) != CUPTI_SUCCESS) why = "enable an activity kind";
    if (why != nullptr) {
        fprintf(stderr, "moecache-gputrace: CUPTI refused to %s: not tracing\n", why);
        fclose(g_out);
        g_out = nullptr;
        return false;
    }
    atexit(finish);
    return true;
}

}  // namespace

// The CUDA driver calls it once when it loads the library named by CUDA_INJECTION64_PATH.
extern "C" __attribute__((visibility("default"))) int InitializeInjection() { return start() ? 1 : 0; }
