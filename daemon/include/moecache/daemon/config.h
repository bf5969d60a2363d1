// moecached's configuration: TOML text (the main file, then drop-ins from moecached.toml.d/ in
// name order, later values replacing earlier ones) -> these plain structs -> validated. Loading
// fails with a message naming the file, the key and what is wrong before anything runs.
#pragma once

#include "moecache/error.h"

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace moecache::daemon {

// A size the user wrote as bytes ("48GiB", "512MiB", "1073741824") or as a share of RAM ("60%").
struct ByteAmount {
    uint64_t bytes = 0;        // when percent is unset
    std::optional<double> percent;  // of MemTotal, 0 < percent <= 100
    [[nodiscard]] uint64_t resolve(uint64_t mem_total) const;
};

struct ExpertPin {
    uint32_t layer = 0;
    uint32_t first = 0, last = 0;  // inclusive expert range; a whole layer is 0..UINT32_MAX
    bool whole_layer = false;      // "12": every expert of the layer (not a range that was written)
};

struct ModelConfig {
    std::string path;             // a path or a glob (*, ?, [..]); any part of a split set
    std::optional<ByteAmount> budget;  // this model's lock budget; unset: the global budget only
    std::vector<ExpertPin> pins;  // always locked (within budgets)
    bool lock_dense = true;       // lock the non-expert tensors (attention, norms, embeddings) too
    // Models of one family share heat while loaded together (a low-bit quantization for prompt
    // processing and a higher one for decoding, say): what one routes warms the other. Unset: the
    // family is the heat profile key (architecture, shape, name), so quantizations of one model
    // are a family without being told. Members must have the same MoE shape.
    std::string family;
    std::optional<ByteAmount> family_budget;  // locked by the whole family at most (the smallest given wins)
    // Keep its locks at full rank while no runtime uses it (never on standby, never giving way to a
    // family member in use): ollama unloads an idle model and loads it again on the next request.
    bool keep = false;
    std::string where;            // "FILE:LINE:COL: model[N]" (N counts within FILE), for messages
};

struct Config {
    // [daemon]
    std::string state_dir = "/var/lib/moecache";
    // Heat profiles shared by a fleet (read only; "" for none): a model whose profile state_dir
    // does not have yet starts warm from the one here (a ConfigMap on Kubernetes, an NFS folder).
    std::string fleet_profiles;
    std::string socket_path = "/run/moecache/moecached.sock";
    std::string log_level = "info";  // error, warning, info, debug
    double tick_seconds = 1.0;       // how often residency is refreshed and placement decided
    // Set at start when nothing else did (the value is 0): its locked model pages count in its
    // RSS, which would make it the OOM killer's first pick in a cgroup it shares.
    int oom_score_adj = -250;

    // [budget]
    ByteAmount lock_budget{0, 50.0};           // all locked bytes together
    ByteAmount reserve{2ull << 30, std::nullopt};  // never locked: locked <= MemTotal - reserve

    // [prefetch]
    uint32_t queue_depth = 32;
    uint32_t read_size = 1u << 20;  // bytes per read request
    // "auto": io_uring, or pread threads where io_uring is denied (a container's seccomp profile);
    // "io_uring" or "threads" to force one. threads: the pread engine's readers (0: up to 16).
    std::string prefetch_engine = "auto";
    uint32_t prefetch_threads = 0;
    int numa_node = -1;             // -1: wherever the kernel puts pages
    // Seconds a read of a model file may take (its header at open, an expert's range) before the
    // file counts as not answering (a hung NFS or SMB server, a FUSE file system that stopped):
    // its model is set aside for a while and other models are read meanwhile.
    double read_deadline_seconds = 30;
    // When a runtime reads part of an expert from storage (a miss, as eBPF sees it), read the rest
    // of that expert at once, into the page cache (not locked): the runtime's next faults in it hit.
    bool on_miss = true;
    // At a warm start (a heat profile loaded or imported), read the experts the profile has seen
    // used beyond what is locked, hottest first, as far as free memory (of the machine and of the
    // daemon's memory cgroup) goes: not locked, the kernel takes them back as it needs. Unset
    // limit: as far as free memory goes; warm_start false: nothing beyond the locks.
    bool warm_start = true;
    std::optional<ByteAmount> warm_limit;

    // [pressure]
    bool pressure_enabled = true;
    uint32_t pressure_stall_us = 100000;    // PSI trigger: "some" stall of this many us ...
    uint32_t pressure_window_us = 1000000;  // ... within this window
    double pressure_release_share = 0.10;   // share of locked bytes released per pressure event
    double pressure_recover_seconds = 30;   // quiet time before taking memory back

    // [policy]
    double decay_half_life_tokens = 4096;
    uint32_t admit_after_uses = 2;
    double elite_share = 0.125;  // of each layer's experts, never released by the policy
    double hysteresis = 0.25;    // a newcomer must be this much hotter than the one it replaces
    // Prefetch what the next token is predicted to use (RoutePredictor, from the router decisions
    // clients report) into the page cache, not locked; only while the predictions have been right
    // (PredictionTrust) and the prefetch queue has nothing waiting. Off by default: docs/sim.md
    // measures where it pays.
    bool predict = false;
    double save_interval_seconds = 60;

    // [telemetry]
    std::string page_cache_telemetry = "auto";  // eBPF page-cache events: auto, on, off
    uint32_t page_cache_ring_bytes = 4u << 20;  // the BPF ring buffer, a power of two

    // [clients]
    std::vector<uint32_t> client_allow_uids;  // empty: any uid; root may always connect
    std::vector<uint32_t> client_allow_gids;  // a peer whose primary gid is listed may connect too
    uint32_t max_clients = 256;
    // Connections one uid may hold at once; root's are counted per cgroup (a service, a pod's
    // container), since every pod of a node may run as root.
    uint32_t max_clients_per_uid = 64;
    // What the clients of one uid (root's: of one cgroup, as above) may hold at once of models users
    // registered (no [[model]] names them, none came over D-Bus): models, and their experts (layers
    // x routed experts) together. Each such model costs the daemon memory, descriptors and, every
    // tick, work as its experts; a registration past either is refused.
    uint32_t max_models_per_uid = 16;
    uint32_t max_experts_per_uid = 32768;
    double hello_seconds = 5;           // a connection that has not said Hello by then is closed
    double idle_seconds = 300;          // one that has registered no model by then is closed (0: never)
    // What the models a uid's clients registered (and no [[model]] names) may lock together, by
    // uid. A uid not listed is held to the global budget only.
    std::map<uint32_t, ByteAmount> uid_budgets;

    // [metrics]
    // Where GET /metrics answers: "HOST:PORT" with an IP address; "" turns it off. Loopback by
    // default; a busy port is reported and the daemon runs without metrics.
    std::string metrics_listen = "127.0.0.1:8474";
    // The metrics' file label is the model's path; off: its file name and a hash of the path (which
    // keeps two files of one name apart), for a port a cluster reaches ([metrics] paths).
    bool metrics_paths = true;

    // [dbus]
    // The bus moecached takes the name org.moecache1 on: "system", "session", "off", or an address
    // ("unix:path=/run/x/bus"). A bus that cannot be reached is reported; the daemon runs without.
    std::string dbus_bus = "system";
    // Members of this group may change state over D-Bus, as root may ("" or a missing group: root
    // only). The bus policy (org.moecache1.conf) must say the same.
    std::string dbus_admin_group = "moecache";

    // [vram]
    // The VRAM pool each CUDA hook may hold per device; unset: the hook decides (its own
    // MOECACHE_CUDA_POOL, default as much as its experts need within free memory). Devices named
    // in vram_pool_device ("0:12GiB,1:6GiB") have their own.
    std::optional<uint64_t> vram_pool;
    std::map<uint32_t, uint64_t> vram_pool_device;
    // Keep the RAM copy of an expert that sits in a VRAM pool (the one-place rule off): for runtimes
    // that also compute experts on the CPU, e.g. llama.cpp below its offload batch threshold.
    bool keep_ram_copy = false;
    // The share of each pool the daemon directs: its hottest experts, which the hook fills ahead of
    // the runtime's copies (the elite of each layer always).
    double pool_directed = 0.9;
    // A pool's first fill from the model files (daemon::bind_promoted): while every pool of a model
    // fills for the first time, what they are directed to hold is not read into RAM first; the
    // hooks read it from the files (with MOECACHE_CUDA_FILL_FROM_FILES=1). Off until measured to pay
    // in the prompt-model swap (docs/moecached.md).
    bool fill_from_files = false;

    // [[model]]
    std::vector<ModelConfig> models;

    std::vector<std::string> sources;  // the files read, in order
    // Dotted key ("budget.lock") -> "FILE:LINE:COL" of the value in force, so that checks made
    // after all files are read (validate_config) can still say which file to edit.
    std::map<std::string, std::string> origins;
};

// Reads `path` and the drop-ins in `<dir of path>/moecached.toml.d/*.toml` (in name order; hidden
// files and other names skipped; no such directory is fine). Does not validate: see below.
Result<Config> load_config(const std::string& path);
// Parses one TOML text on top of `base` (for tests and drop-ins). `name` is used in messages.
Result<Config> parse_config_text(const std::string& text, const std::string& name, Config base = {});
// Checks what no single key can: budgets against each other and the machine, the PSI trigger, the
// NUMA node. `numa_node_dir` is where the kernel lists nodes (node0, node1, ...): a seam for tests.
// Model files are not checked: the daemon reports and retries missing models at run time.
Result<void> validate_config(const Config& c, uint64_t mem_total,
                             const std::string& numa_node_dir = "/sys/devices/system/node");

// The value syntaxes TOML has no type for. Their messages say what is wrong with the text; the
// caller adds the file and key.
// "4096", "48GiB", "1.5 G", "512 mib", "60%": units B, KiB, MiB, GiB, TiB (K, M, G, T mean the
// same binary units; any case); fractions of a byte are dropped; "N%" is a share of MemTotal.
Result<ByteAmount> parse_byte_amount(std::string_view text);
// "12" (all of layer 12), "12:3" (expert 3 of layer 12), "12:0-7" (experts 0..7 of layer 12).
Result<ExpertPin> parse_expert_pin(std::string_view text);

// "48 GiB" when a unit divides it, else "1000 bytes" / "51539607553 bytes (48.0 GiB)".
std::string format_bytes(uint64_t bytes);

}  // namespace moecache::daemon
