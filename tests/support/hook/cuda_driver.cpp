#include "cuda_driver.h"

#include <dlfcn.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

namespace moecache::test {

void* dlsym_knob(void* lib, const char* name) { return dlsym(lib, name); }

bool CudaDriver::get(void*& fn, const char* name, cuuint64_t flags) {
    // At CUDA 12.0's ABI: CUDA 13 gave cuCtxSynchronize a context argument (cuCtxSynchronize_v2).
    return get_proc(name, &fn, 12000, flags, nullptr) == CUDA_SUCCESS && fn != nullptr;
}

std::string CudaDriver::load() {
    lib = dlopen("libcuda.so.1", RTLD_NOW);
    if (lib == nullptr) return std::string("no libcuda.so.1 here: ") + dlerror();
    fake_ = dlsym(lib, "fake_cuda_counts") != nullptr;
    get_proc = reinterpret_cast<GetProc>(dlsym(lib, "cuGetProcAddress_v2"));
    if (get_proc == nullptr) return "libcuda.so.1 has no cuGetProcAddress_v2";
    struct Want {
        const char* name;
        cuuint64_t flags;
    };
    void* fns[22] = {};
    const Want want[] = {
        {"cuInit", 0}, {"cuDeviceGet", 0}, {"cuDeviceGetCount", 0},
        {"cuDevicePrimaryCtxRetain", 0}, {"cuCtxSetCurrent", 0}, {"cuStreamCreate", 0},
        {"cuStreamDestroy", 0}, {"cuStreamSynchronize", 0}, {"cuCtxSynchronize", 0},
        {"cuMemAlloc", 0}, {"cuMemFree", 0}, {"cuMemGetInfo", 0}, {"cuMemcpyHtoD", 0},
        {"cuMemcpyHtoDAsync", 0}, {"cuMemcpyHtoDAsync", CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM},
        {"cuMemcpyAsync", 0}, {"cuMemcpy", 0}, {"cuMemcpyDtoH", 0},
        {"cuStreamBeginCapture", 0}, {"cuStreamEndCapture", 0},
    };
    for (size_t i = 0; i < std::size(want); ++i)
        if (!get(fns[i], want[i].name, want[i].flags)) return std::string("cuGetProcAddress gave no ") + want[i].name;
    auto as = [&](auto& slot, size_t i) { slot = reinterpret_cast<std::remove_reference_t<decltype(slot)>>(fns[i]); };
    as(init, 0), as(device_get, 1), as(device_count, 2), as(primary_ctx_retain, 3), as(ctx_set_current, 4);
    as(stream_create, 5), as(stream_destroy, 6), as(stream_synchronize, 7), as(ctx_synchronize, 8);
    as(mem_alloc, 9), as(mem_free, 10), as(mem_get_info, 11), as(htod, 12), as(htod_async, 13);
    as(htod_async_ptsz, 14), as(memcpy_async, 15), as(memcpy_sync, 16), as(dtoh, 17);
    as(begin_capture, 18), as(end_capture, 19);
    if (init(0) != CUDA_SUCCESS) return "cuInit failed: no usable CUDA device here";
    if (!use_device(0)) return "no primary context on device 0";
    return "";
}

bool CudaDriver::use_device(int d) {
    CUdevice dev = 0;
    CUcontext ctx = nullptr;
    return device_get(&dev, d) == CUDA_SUCCESS && primary_ctx_retain(&ctx, dev) == CUDA_SUCCESS &&
           ctx_set_current(ctx) == CUDA_SUCCESS;
}

bool HookProbe::load() {
    stats_get = reinterpret_cast<decltype(stats_get)>(dlsym(RTLD_DEFAULT, "moecache_cuda_stats_get"));
    sync = reinterpret_cast<decltype(sync)>(dlsym(RTLD_DEFAULT, "moecache_cuda_sync"));
    pool_bytes = reinterpret_cast<decltype(pool_bytes)>(dlsym(RTLD_DEFAULT, "moecache_cuda_pool_bytes"));
    return stats_get != nullptr && sync != nullptr && pool_bytes != nullptr;
}

moecache_cuda_stats HookProbe::stats() const {
    moecache_cuda_stats s{};
    stats_get(&s);
    return s;
}

std::string MappedModel::open(const std::string& path) {
    auto parts = open_gguf_model(path);
    if (!parts) return parts.error().message;
    auto m = ExpertMap::build(*parts);
    if (!m) return m.error().message;
    map = std::move(*m);
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return "cannot open " + path;
    size = static_cast<size_t>(lseek(fd, 0, SEEK_END));
    void* p = mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
    ::close(fd);
    if (p == MAP_FAILED) return "cannot map " + path;
    base = static_cast<const uint8_t*>(p);
    return "";
}

MappedModel::~MappedModel() {
    if (base != nullptr) munmap(const_cast<uint8_t*>(base), size);
}

namespace {

std::vector<std::pair<uint32_t, uint32_t>> groups_of(std::vector<uint32_t> ids) {
    std::sort(ids.begin(), ids.end());
    ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
    std::vector<std::pair<uint32_t, uint32_t>> groups;
    for (uint32_t id : ids) {
        if (!groups.empty() && groups.back().second + 1 == id) groups.back().second = id;
        else groups.emplace_back(id, id);
    }
    return groups;
}

uint64_t copy_bytes(uint32_t first, uint32_t last, uint64_t slice, uint32_t n) {
    return (last - first + 1) * slice + (last < n - 1 ? std::min<uint64_t>(slice, 512) : 0);
}

CUresult issue(CudaDriver& cu, CUdeviceptr dst, const void* src, uint64_t bytes, CUstream stream, CopyKind how) {
    switch (how) {
        case CopyKind::Async: return cu.htod_async(dst, src, bytes, stream);
        case CopyKind::PerThread: return cu.htod_async_ptsz(dst, src, bytes, nullptr);
        case CopyKind::Sync: return cu.htod(dst, src, bytes);
        case CopyKind::Unified: return cu.memcpy_async(dst, reinterpret_cast<CUdeviceptr>(src), bytes, stream);
    }
    return CUDA_ERROR_INVALID_VALUE;
}

}  // namespace

bool copy_experts(CudaDriver& cu, const MappedModel& m, CUdeviceptr dst, uint32_t l, uint32_t t, std::vector<uint32_t> ids,
                  CUstream stream) {
    const auto& tensor = m.map.layers[l].tensors[t];
    for (auto [first, last] : groups_of(std::move(ids))) {
        const uint64_t off = first * tensor.bytes_per_expert;
        if (cu.htod_async(dst + off, m.base + tensor.offset + off, copy_bytes(first, last, tensor.bytes_per_expert, m.map.n_experts),
                          stream) != CUDA_SUCCESS)
            return false;
    }
    return true;
}

int copy_and_check(CudaDriver& cu, const MappedModel& m, CUdeviceptr dst, uint32_t l, uint32_t t, std::vector<uint32_t> ids,
                   CUstream stream, CopyKind how) {
    const auto& tensor = m.map.layers[l].tensors[t];
    const uint64_t slice = tensor.bytes_per_expert;
    const uint32_t n = m.map.n_experts;
    const auto groups = groups_of(std::move(ids));
    std::vector<uint8_t> garbage(slice * n + 512, 0xA5), back(slice * n + 512);
    EXPECT_EQ(cu.htod(dst, garbage.data(), garbage.size()), CUDA_SUCCESS);
    for (auto [first, last] : groups) {
        const uint64_t off = first * slice;
        EXPECT_EQ(issue(cu, dst + off, m.base + tensor.offset + off, copy_bytes(first, last, slice, n), stream, how), CUDA_SUCCESS);
    }
    EXPECT_EQ(cu.ctx_synchronize(), CUDA_SUCCESS);
    EXPECT_EQ(cu.dtoh(back.data(), dst, back.size()), CUDA_SUCCESS);
    uint64_t pos = 0;
    for (auto [first, last] : groups) {
        const uint64_t off = first * slice, bytes = copy_bytes(first, last, slice, n);
        if (memcmp(back.data() + off, m.base + tensor.offset + off, bytes) != 0) {
            ADD_FAILURE() << "layer slot " << l << " tensor " << t << " experts " << first << ".." << last << " (copy kind "
                          << static_cast<int>(how) << "): destination differs from the file";
            return -1;
        }
        // Bytes no copy wrote are untouched.
        for (uint64_t i = pos; i < off; i += 4096)
            if (back[i] != 0xA5) {
                ADD_FAILURE() << "a byte outside every copy changed at " << i;
                return -1;
            }
        pos = off + bytes;
    }
    return static_cast<int>(groups.size());
}

}  // namespace moecache::test
