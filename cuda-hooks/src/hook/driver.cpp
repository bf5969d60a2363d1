#include "driver.h"

#include <dlfcn.h>

#include <mutex>

namespace moecache::cuda::hook {

const Driver* driver() {
    static Driver d{};
    static bool ok = false;
    static std::once_flag once;
    std::call_once(once, [] {
        void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
        if (lib == nullptr) lib = dlopen("libcuda.so.1", RTLD_NOW);
        if (lib == nullptr) return;
        bool all = true;
        auto get = [&](auto& fn, const char* name) {
            fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(real_dlsym(lib, name));
            all = all && fn != nullptr;
        };
        get(d.ctx_get_current, "cuCtxGetCurrent");
        get(d.ctx_get_device, "cuCtxGetDevice");
        get(d.ctx_synchronize, "cuCtxSynchronize");
        get(d.ctx_push_current, "cuCtxPushCurrent_v2");
        get(d.ctx_pop_current, "cuCtxPopCurrent_v2");
        get(d.primary_ctx_retain, "cuDevicePrimaryCtxRetain");
        get(d.stream_is_capturing, "cuStreamIsCapturing");
        get(d.stream_synchronize, "cuStreamSynchronize");
        get(d.memcpy_htod_async, "cuMemcpyHtoDAsync_v2");
        get(d.memcpy_dtod_async, "cuMemcpyDtoDAsync_v2");
        get(d.mem_alloc, "cuMemAlloc_v2");
        get(d.mem_free, "cuMemFree_v2");
        get(d.mem_get_info, "cuMemGetInfo_v2");
        get(d.mem_host_register, "cuMemHostRegister_v2");
        get(d.mem_host_unregister, "cuMemHostUnregister");
        get(d.pointer_get_attributes, "cuPointerGetAttributes");
        get(d.event_create, "cuEventCreate");
        get(d.event_record, "cuEventRecord");
        get(d.event_query, "cuEventQuery");
        get(d.event_synchronize, "cuEventSynchronize");
        get(d.stream_wait_event, "cuStreamWaitEvent");
        get(d.mem_host_alloc, "cuMemHostAlloc");
        get(d.mem_free_host, "cuMemFreeHost");
        get(d.stream_create, "cuStreamCreate");
        get(d.stream_destroy, "cuStreamDestroy_v2");
        ok = all;
        d.device_get_count = reinterpret_cast<decltype(d.device_get_count)>(real_dlsym(lib, "cuDeviceGetCount"));
        d.device_can_access_peer = reinterpret_cast<decltype(d.device_can_access_peer)>(real_dlsym(lib, "cuDeviceCanAccessPeer"));
        d.ctx_enable_peer_access = reinterpret_cast<decltype(d.ctx_enable_peer_access)>(real_dlsym(lib, "cuCtxEnablePeerAccess"));
        d.memcpy_peer_async = reinterpret_cast<decltype(d.memcpy_peer_async)>(real_dlsym(lib, "cuMemcpyPeerAsync"));
        d.memcpy_dtoh = reinterpret_cast<decltype(d.memcpy_dtoh)>(real_dlsym(lib, "cuMemcpyDtoH_v2"));
        d.mem_get_address_range =
            reinterpret_cast<decltype(d.mem_get_address_range)>(real_dlsym(lib, "cuMemGetAddressRange_v2"));
        d.module_load_data = reinterpret_cast<decltype(d.module_load_data)>(real_dlsym(lib, "cuModuleLoadData"));
        d.module_unload = reinterpret_cast<decltype(d.module_unload)>(real_dlsym(lib, "cuModuleUnload"));
        d.module_get_function = reinterpret_cast<decltype(d.module_get_function)>(real_dlsym(lib, "cuModuleGetFunction"));
        d.launch_kernel = reinterpret_cast<decltype(d.launch_kernel)>(real_dlsym(lib, "cuLaunchKernel"));
    });
    return ok ? &d : nullptr;
}

DeviceContext::DeviceContext(const Driver* drv, int device) : drv_(drv) {
    CUcontext ctx = nullptr;
    pushed_ = drv_ != nullptr && drv_->primary_ctx_retain(&ctx, device) == CUDA_SUCCESS &&
              drv_->ctx_push_current(ctx) == CUDA_SUCCESS;
}

DeviceContext::~DeviceContext() {
    CUcontext popped = nullptr;
    if (pushed_) (void)drv_->ctx_pop_current(&popped);
}

}  // namespace moecache::cuda::hook
