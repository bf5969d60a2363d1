#include "moecache/device_list.h"

#include <charconv>

namespace moecache {

Result<std::vector<DeviceItem>> parse_device_list(std::string_view text, uint32_t max_devices) {
    std::vector<DeviceItem> out;
    bool plain = false;
    std::vector<bool> named(max_devices, false);
    size_t at = 0;
    while (at <= text.size()) {
        size_t comma = text.find(',', at);
        if (comma == std::string_view::npos) comma = text.size();
        const std::string_view item = text.substr(at, comma - at);
        at = comma + 1;
        if (item.empty()) return failf("an empty item in '{}'", text);
        const size_t colon = item.find(':');
        DeviceItem d{std::nullopt, std::string(colon == std::string_view::npos ? item : item.substr(colon + 1)),
                     std::string(item)};
        if (colon == std::string_view::npos) {
            if (plain) return failf("'{}': a value for every device is given twice", item);
            plain = true;
        } else {
            const std::string_view dev = item.substr(0, colon);
            uint32_t n = 0;
            const auto [p, ec] = std::from_chars(dev.data(), dev.data() + dev.size(), n);
            if (dev.empty() || ec != std::errc{} || p != dev.data() + dev.size() || n >= max_devices)
                return failf("'{}': a device is a number from 0 to {}, as in \"0:12GiB,1:6GiB\"", item, max_devices - 1);
            if (named[n]) return failf("'{}': device {} is given twice", item, n);
            named[n] = true;
            d.device = n;
        }
        out.push_back(std::move(d));
    }
    return out;
}

}  // namespace moecache
