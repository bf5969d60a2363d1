// The driver functions the hook itself calls, resolved straight from libcuda.so.1, never through
// the hooked entry points (so its own copies are never intercepted).
#pragma once

#include "cuda_api.h"

namespace moecache::cuda::hook {

// glibc's dlsym (the hook exports its own).
void* real_dlsym(void* handle, const char* symbol);

struct Driver {
    CUresult (*ctx_get_current)(CUcontext*);
    CUresult (*ctx_get_device)(CUdevice*);
    CUresult (*ctx_synchronize)();
    CUresult (*ctx_push_current)(CUcontext);
    CUresult (*ctx_pop_current)(CUcontext*);
    CUresult (*primary_ctx_retain)(CUcontext*, CUdevice);
    CUresult (*stream_is_capturing)(CUstream, CUstreamCaptureStatus*);
    CUresult (*stream_synchronize)(CUstream);
    CUresult (*memcpy_htod_async)(CUdeviceptr, const void*, size_t, CUstream);
    CUresult (*memcpy_dtod_async)(CUdeviceptr, CUdeviceptr, size_t, CUstream);
    CUresult (*mem_alloc)(CUdeviceptr*, size_t);
    CUresult (*mem_free)(CUdeviceptr);
    CUresult (*mem_get_info)(size_t*, size_t*);
    CUresult (*mem_host_register)(void*, size_t, unsigned int);
    CUresult (*mem_host_unregister)(void*);
    CUresult (*pointer_get_attributes)(unsigned int, CUpointer_attribute*, void**, CUdeviceptr);
    CUresult (*event_create)(CUevent*, unsigned int);
    CUresult (*event_record)(CUevent, CUstream);
    CUresult (*event_query)(CUevent);
    CUresult (*event_synchronize)(CUevent);
    CUresult (*stream_wait_event)(CUstream, CUevent, unsigned int);
    CUresult (*mem_host_alloc)(void**, size_t, unsigned int);
    CUresult (*mem_free_host)(void*);
    CUresult (*stream_create)(CUstream*, unsigned int);
    CUresult (*stream_destroy)(CUstream);
    // Optional (null when the driver lacks them): how many devices the process sees.
    CUresult (*device_get_count)(int*);
    // Optional: reading another device's pool.
    CUresult (*device_can_access_peer)(int*, CUdevice, CUdevice);
    CUresult (*ctx_enable_peer_access)(CUcontext, unsigned int);
    CUresult (*memcpy_peer_async)(CUdeviceptr, CUcontext, CUdeviceptr, CUcontext, size_t, CUstream);
    // Optional: a synchronous device-to-host copy (the check of the copy kernel's several-range form).
    CUresult (*memcpy_dtoh)(void*, CUdeviceptr, size_t);
    // Optional: the allocation a device address lies in (copies ahead stay inside it).
    CUresult (*mem_get_address_range)(CUdeviceptr*, size_t*, CUdeviceptr);
    // Optional: the hook's copy kernel (copy_kernel.h).
    CUresult (*module_load_data)(CUmodule*, const void*);
    CUresult (*module_unload)(CUmodule);
    CUresult (*module_get_function)(CUfunction*, CUmodule, const char*);
    CUresult (*launch_kernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream,
                              void**, void**);
};

// Makes `device`'s primary context current on this thread for the life of the object (the
// background thread works on every device).
class DeviceContext {
public:
    DeviceContext(const Driver* drv, int device);
    ~DeviceContext();
    DeviceContext(const DeviceContext&) = delete;
    DeviceContext& operator=(const DeviceContext&) = delete;
    [[nodiscard]] bool ok() const { return pushed_; }

private:
    const Driver* drv_;
    bool pushed_ = false;
};

// Null when libcuda.so.1 cannot be loaded or lacks one of them.
const Driver* driver();

}  // namespace moecache::cuda::hook
