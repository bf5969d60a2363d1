// The keys of the dictionaries the D-Bus API returns (org.moecache1.xml: GetStatus, ListModels
// and GetModel; docs/dbus.md says what each means), named once for the daemon that writes them and
// moecachectl that reads them.
#pragma once

namespace moecache::dbus_keys {

inline constexpr const char kId[] = "id";
inline constexpr const char kPath[] = "path";
inline constexpr const char kName[] = "name";
inline constexpr const char kKey[] = "key";
inline constexpr const char kFamily[] = "family";
inline constexpr const char kLoaded[] = "loaded";
inline constexpr const char kError[] = "error";
inline constexpr const char kRegisteredByClient[] = "registered_by_client";
inline constexpr const char kOwnerUid[] = "owner_uid";
inline constexpr const char kBudgetBytes[] = "budget_bytes";
inline constexpr const char kLockedBytes[] = "locked_bytes";
inline constexpr const char kExpertBytes[] = "expert_bytes";
inline constexpr const char kExpertCachedBytes[] = "expert_cached_bytes";
inline constexpr const char kExpertLockedBytes[] = "expert_locked_bytes";
inline constexpr const char kExperts[] = "experts";
inline constexpr const char kExpertsLocked[] = "experts_locked";
inline constexpr const char kExpertsPinned[] = "experts_pinned";
inline constexpr const char kExpertsInVram[] = "experts_in_vram";
inline constexpr const char kDenseBytes[] = "dense_bytes";
inline constexpr const char kDenseTier[] = "dense_tier";
inline constexpr const char kStorageReadBytes[] = "storage_read_bytes";
inline constexpr const char kEvictedBytes[] = "evicted_bytes";
inline constexpr const char kPrefetchingExperts[] = "prefetching_experts";
inline constexpr const char kPrefetchPendingBytes[] = "prefetch_pending_bytes";
inline constexpr const char kExpertsFetching[] = "experts_fetching";
inline constexpr const char kSettled[] = "settled";
// Is it helping (daemon/include/moecache/daemon/helping.h): decode and prompt tokens its runtimes
// reported, decode routings by where the expert was, whether a runtime reports its routing.
inline constexpr const char kDecodeTokens[] = "decode_tokens";
inline constexpr const char kPromptTokens[] = "prompt_tokens";
inline constexpr const char kRoutedInVram[] = "routed_in_vram";
inline constexpr const char kRoutedInRam[] = "routed_in_ram";
inline constexpr const char kRoutedFromStorage[] = "routed_from_storage";
inline constexpr const char kRoutingReported[] = "routing_reported";
// A warm start under way: the bytes it had to read and those read so far (0 and 0: none).
inline constexpr const char kWarmTotalBytes[] = "warm_total_bytes";
inline constexpr const char kWarmDoneBytes[] = "warm_done_bytes";
inline constexpr const char kVersion[] = "version";
inline constexpr const char kPid[] = "pid";
inline constexpr const char kMemTotalBytes[] = "mem_total_bytes";
inline constexpr const char kLockBudgetBytes[] = "lock_budget_bytes";
inline constexpr const char kReserveBytes[] = "reserve_bytes";
inline constexpr const char kLockCapBytes[] = "lock_cap_bytes";
inline constexpr const char kVmlckBytes[] = "vmlck_bytes";
inline constexpr const char kUnderPressure[] = "under_pressure";
inline constexpr const char kPressureEvents[] = "pressure_events";
inline constexpr const char kPrefetchDoneBytes[] = "prefetch_done_bytes";
inline constexpr const char kPrefetchQueuedBytes[] = "prefetch_queued_bytes";
inline constexpr const char kCgroupLimitBytes[] = "cgroup_limit_bytes";
inline constexpr const char kMissFetches[] = "miss_fetches";
inline constexpr const char kMissFetchBytes[] = "miss_fetch_bytes";
inline constexpr const char kWarmFetchBytes[] = "warm_fetch_bytes";
inline constexpr const char kPredictedExperts[] = "predicted_experts";
inline constexpr const char kPredictedUsed[] = "predicted_used";
inline constexpr const char kPredictFetchBytes[] = "predict_fetch_bytes";
inline constexpr const char kModels[] = "models";
inline constexpr const char kClients[] = "clients";
inline constexpr const char kClientsRefused[] = "clients_refused";
inline constexpr const char kSocket[] = "socket";
inline constexpr const char kMetrics[] = "metrics";
inline constexpr const char kBus[] = "bus";
inline constexpr const char kPageCacheTelemetry[] = "page_cache_telemetry";
inline constexpr const char kPageCacheFaults[] = "page_cache_faults";
inline constexpr const char kPageCacheOffReason[] = "page_cache_off_reason";
inline constexpr const char kPageCacheEvents[] = "page_cache_events";
inline constexpr const char kVramReleases[] = "vram_releases";
inline constexpr const char kTracing[] = "tracing";
inline constexpr const char kTraceRecords[] = "trace_records";
// as: one line per device of a connected CUDA hook whose misses make decode slower than without
// moecache: who, which device, why, and what to do.
inline constexpr const char kHookNotices[] = "hook_notices";
// as: is it helping, a line per model and per reason that holds (moecachectl status prints them).
inline constexpr const char kHelping[] = "helping";

}  // namespace moecache::dbus_keys
