// "DEVICE:VALUE" lists, as sizes per GPU are written (MOECACHE_CUDA_POOL, [vram] pool):
// comma-separated items, each "VALUE" (every device not named) or "DEVICE:VALUE" (one device).
// Only the list is checked here; what a VALUE is, its reader says.
#pragma once

#include "moecache/error.h"

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace moecache {

struct DeviceItem {
    std::optional<uint32_t> device;  // none: every device not named
    std::string value;
    std::string text;  // the item as written, for messages
};

// Errors name the item: an empty one, a device that is no number below max_devices, a device or a
// plain value given twice.
Result<std::vector<DeviceItem>> parse_device_list(std::string_view text, uint32_t max_devices);

}  // namespace moecache
