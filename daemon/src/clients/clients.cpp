// The daemon's side of the client socket (docs/protocol.md): what each message does (who may
// connect, and the connections themselves, are the ClientHub's), and the telemetry rings read on
// every turn of the loop. Everything a client sends is
// untrusted: a message that does not decode, a descriptor that is not a readable regular file, a
// model or block it did not register gets a Failure naming what is wrong; a protocol violation
// (a packet that does not decode, a request before Hello) also closes the connection, a request
// that cannot be met does not. Other clients never notice.
#include "clients/client_hub.h"
#include "moecache/daemon/daemon.h"

#include "moecache/daemon/prefetcher.h"
#include "moecache/daemon/system_memory.h"
#include "moecache/first_fill.h"
#include "moecache/log.h"

#include <fcntl.h>
#include <sys/epoll.h>
#include <sys/stat.h>
#include <unistd.h>

#include <poll.h>

#include <algorithm>
#include <cmath>
#include <cstring>

namespace moecache::daemon {
namespace {

using namespace moecache::protocol;

// Routing records read in a turn, all clients together, shared out evenly (each at least
// kMinEventsPerClient): a ring left fuller fills, and its client counts what it could not write.
// Each client could take 2^16 a turn: 16 full rings held the loop ~1 s a turn (64 of them ~4 s),
// and with it D-Bus answers and every client's directives.
constexpr size_t kEventsPerTurn = 1u << 16;
constexpr size_t kMinEventsPerClient = 1024;

const char* kind_of(mode_t m) {
    if (S_ISDIR(m)) return "a directory";
    if (S_ISFIFO(m)) return "a pipe";
    if (S_ISSOCK(m)) return "a socket";
    if (S_ISCHR(m)) return "a character device";
    if (S_ISBLK(m)) return "a block device";
    if (S_ISLNK(m)) return "a symbolic link";
    return "not a regular file";
}

// Why a descriptor cannot stand for a model file the client may read, or "" if it can.
std::string unusable(int fd, size_t index) {
    struct stat st {};
    if (::fstat(fd, &st) != 0) return fmt::format("descriptor {}: fstat failed: {}", index, std::strerror(errno));
    const int flags = ::fcntl(fd, F_GETFL);
    if (flags >= 0 && (flags & O_PATH))
        return fmt::format("descriptor {} was opened with O_PATH: it proves no right to read the file", index);
    if (!S_ISREG(st.st_mode)) return fmt::format("descriptor {} is {}, not a model file", index, kind_of(st.st_mode));
    if (flags < 0 || (flags & O_ACCMODE) == O_WRONLY)
        return fmt::format("descriptor {} is not open for reading", index);
    return "";
}

}  // namespace

bool Daemon::on_client_packet(Client& c, Packet& p) {
    if (p.oversized)
        return hub_->refuse(c, 0, EMSGSIZE,
                            fmt::format("a packet longer than the {} bytes a message may have", kMaxMessageBytes));
    if (p.fds_truncated)
        return hub_->refuse(
            c, 0, EMSGSIZE,
            fmt::format("a packet with more descriptors than any message takes (at most {})", kMaxModelFiles));
    auto m = decode(p.bytes, p.fds.size());
    if (!m) return hub_->refuse(c, 0, EPROTO, m.error().what());
    const uint32_t rq = m->request;
    if (!c.hello && !std::holds_alternative<Hello>(m->body))
        return hub_->refuse(c, rq, EPROTO,
                            fmt::format("{} before Hello: say Hello first", to_string(type_of(m->body))));
    if (auto* h = std::get_if<Hello>(&m->body)) {
        if (c.hello) return hub_->refuse(c, rq, EPROTO, "a second Hello");
        if (kVersion < h->min_version || kVersion > h->max_version)
            return hub_->refuse(c, rq, EPROTONOSUPPORT,
                                fmt::format("this moecached speaks protocol version {}; the client asks for {} to {}",
                                            kVersion, h->min_version, h->max_version));
        c.hello = true;
        c.name = h->name;
        hub_->reply(c, rq, HelloReply{kVersion, c.id});
        c.one_place_told = !config_.keep_ram_copy;
        send_vram_policy(c);
        return true;
    }
    if (std::holds_alternative<RegisterModel>(m->body)) return register_model(c, rq, p.fds);
    if (auto* d = std::get_if<DescribeMapping>(&m->body)) {
        if (std::find(c.models.begin(), c.models.end(), d->model) == c.models.end())
            return hub_->cannot(c, rq, ENOENT, fmt::format("model {} is not one this client registered", d->model));
        for (auto& e : models_->all()) {
            if (e->id != d->model || !e->res) continue;
            const auto& files = e->res->model().files();
            if (d->file >= files.size())
                return hub_->cannot(
                    c, rq, EINVAL,
                    fmt::format("model {} has {} files; there is no file {}", d->model, files.size(), d->file));
            // A mapping covers whole pages: its last may run past the end of the file.
            const uint64_t size = files[d->file].identity.size;
            const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
            const uint64_t mappable = (size + page - 1) / page * page;
            if (d->file_offset > size || d->length > mappable - d->file_offset)
                return hub_->cannot(
                    c, rq, EINVAL,
                    fmt::format("a mapping of {} bytes from offset {} runs past the end of file {} ({} bytes)",
                                d->length, d->file_offset, d->file, files[d->file].identity.size));
        }
        hub_->reply(c, rq, Ok{});
        return true;
    }
    if (auto* t = std::get_if<TelemetrySetup>(&m->body)) {
        if (c.ring) return hub_->cannot(c, rq, EEXIST, "a telemetry ring is attached already");
        auto ring = telemetry::TelemetryRing::attach(p.fds.front().get(), t->ring_bytes);
        if (!ring) return hub_->cannot(c, rq, EINVAL, ring.error().what());
        c.ring = std::make_unique<telemetry::TelemetryRing>(std::move(*ring));
        hub_->reply(c, rq, Ok{});
        return true;
    }
    if (auto* x = std::get_if<ExpertPlacement>(&m->body)) return on_placement(c, *x);
    if (auto* x = std::get_if<PoolStats>(&m->body)) return on_pool_stats(c, *x);
    if (auto* x = std::get_if<Unmapped>(&m->body)) return on_unmapped(c, *x);
    if (std::holds_alternative<Goodbye>(m->body)) {
        hub_->reply(c, rq, Ok{});
        hub_->drop(c, "it said goodbye");
        return true;
    }
    return hub_->refuse(c, rq, EPROTO,
                        fmt::format("{} is a message the daemon sends, not one it takes", to_string(type_of(m->body))));
}

// One place: an expert in a client's VRAM pool is recorded as held there. Whether RAM gives it
// up is settled at the turn's decisions (settle_one_place): only once the client reported a pool,
// only when every client of the model holds it, and only for a client allowed to evict. A one-way
// message: a bad one is answered, nothing else.
bool Daemon::on_placement(Client& c, const ExpertPlacement& x) {
    if (std::find(c.models.begin(), c.models.end(), x.model) == c.models.end())
        return hub_->cannot(c, 0, ENOENT,
                            fmt::format("ExpertPlacement: model {} is not one this client registered", x.model));
    ModelEntry* e = nullptr;
    for (auto& m : models_->all())
        if (m->id == x.model && m->res) e = m.get();
    if (e == nullptr)
        return hub_->cannot(c, 0, ENOENT, fmt::format("ExpertPlacement: model {} is not loaded", x.model));
    const auto layer = e->res->layer_of_block(x.block);
    if (!layer || x.expert >= e->res->n_experts())
        return hub_->cannot(
            c, 0, EINVAL,
            fmt::format("ExpertPlacement: model {} has no routed expert {} in block {}", x.model, x.expert, x.block));
    const uint32_t slot = *layer * e->res->n_experts() + x.expert;
    const auto key = std::make_pair(x.model, slot);
    if (!c.has_pool) {
        c.has_pool = true;
        request_place();  // its directives go out with the turn's placement
    }
    if (x.device == kHostTier) {
        if (c.vram.erase(key) > 0) {
            one_place_due_.insert(x.model);
            MC_LOG(LOG_DEBUG, "client {}: expert {} of block {} of {} left its VRAM pool", c.id, x.expert, x.block, e->path);
        }
        return true;
    }
    if (!c.vram.insert(key).second) return true;
    MC_LOG(LOG_DEBUG, "client {}: expert {} of block {} of {} is in its VRAM pool on device {}", c.id, x.expert, x.block,
           e->path, x.device);
    if (c.pool_reported) one_place_due_.insert(x.model);
    return true;
}

bool Daemon::is_admin(const Client& c) const {
    return c.peer.uid == 0 ||
           (admin_gid_ && (c.peer.gid == *admin_gid_ ||
                           std::find(c.peer.groups.begin(), c.peer.groups.end(), *admin_gid_) != c.peer.groups.end()));
}

bool Daemon::may_release_ram(const Client& c, const ModelEntry& m) const {
    return is_admin(c) || (m.registered && !m.operator_added);  // a model its users brought: theirs to place
}

bool Daemon::steers(const Client& c, const ModelEntry& m) const {
    return is_admin(c) || (m.registered && !m.operator_added && c.peer.uid == m.owner_uid);
}

bool Daemon::recency_trusted(const ModelEntry& m) const {
    // Reports within the last minute: a runtime reports every token while it runs.
    constexpr auto kLately = std::chrono::seconds(60);
    const auto now = std::chrono::steady_clock::now();
    if (m.steered_routing && now - *m.steered_routing < kLately) return true;
    const auto users = std::count_if(m.routed_by.begin(), m.routed_by.end(), [&](const auto& v) { return now - v.second < kLately; });
    // None: the heat is the page cache's uses, which the kernel reports (eBPF), not a client.
    return users != 1;
}

// The turn's one-place decisions, from what every live client says its pool holds: an expert
// leaves RAM (unlocked, its pages dropped) when each client of the model holds it in VRAM, at
// least one of them may evict, and [vram] keep_ram_copy is off; it is wanted in RAM again as soon
// as that stops holding (a client leaves or registers, a pool gives it up).
void Daemon::settle_one_place() {
    std::set<uint32_t> due;
    due.swap(one_place_due_);
    for (uint32_t id : due) {
        ModelEntry* m = models_->find(id);
        if (m == nullptr || !m->res) continue;
        ModelResidency& r = *m->res;
        const uint32_t n = r.n_slots();
        std::vector<uint32_t> holders(n, 0);
        std::vector<uint8_t> evictor(n, 0);
        uint32_t clients = 0;
        for (const auto& c : hub_->all()) {
            if (c->dead || std::find(c->models.begin(), c->models.end(), id) == c->models.end()) continue;
            ++clients;
            if (!c->pool_reported) continue;  // its placements wait for its pool
            const bool may = may_release_ram(*c, *m);
            bool holds_any = false;
            for (auto it = c->vram.lower_bound({id, 0}); it != c->vram.end() && it->first == id; ++it) {
                if (it->second >= n) continue;
                ++holders[it->second];
                evictor[it->second] |= may ? 1 : 0;
                holds_any = true;
            }
            if (holds_any && !may && c->told_not_releasing.insert(id).second)
                MC_LOG(LOG_NOTICE,
                       "client {} (uid {}): its VRAM pool does not take {} out of RAM: that is an eviction, for root "
                       "and group {} only (or a model its users registered)",
                       c->id, c->peer.uid, m->path, config_.dbus_admin_group);
        }
        bool relock = false;
        std::vector<uint32_t> released;
        const std::vector<uint8_t> leaves =
            released_from_ram(holders, evictor, clients, m->one_place, config_.keep_ram_copy);
        for (uint32_t slot = 0; slot < n; ++slot) {
            const bool was = r.ram_released(slot);
            const bool now = leaves[slot] != 0;
            r.set_vram(slot, holders[slot], now);
            if (now && !was) released.push_back(slot);
            if (was && !now) {
                relock = true;
                MC_LOG(LOG_DEBUG, "{}: expert {} is wanted in RAM again", m->path, slot);
            }
        }
        for (uint32_t slot : released) {
            if (r.pinned(slot)) continue;
            if (r.state(slot).tier() == Tier::Locked) {
                if (auto x = r.release(slot, /*drop=*/true); !x) {
                    MC_LOG(LOG_WARNING, "{}: releasing expert {} (now in VRAM): {}", m->path, slot, x.error().what());
                } else {
                    ++vram_releases_;
                    MC_LOG(LOG_DEBUG, "{}: expert {} leaves RAM: every client holds it in VRAM", m->path, slot);
                    // Like every unlock: a hook whose registered tier follows the locks may have
                    // registered it on a Lock that crossed its own placement.
                    tell_clients(*m, slot, protocol::Action::Unlock);
                }
            }
            r.drop_cached(slot);
        }
        if (relock) request_place();
    }
}

// A hook's pool counters are cumulative for its life: the daemon adds what grew since the last
// report, so that its totals survive clients that come and go (a counter that went back is a
// restarted count: all of it is new).
bool Daemon::on_pool_stats(Client& c, const PoolStats& x) {
    auto& last = c.pools[x.device];
    auto& t = pool_totals_[x.device];
    t.device = x.device;
    auto grow = [](uint64_t now, uint64_t before) { return now >= before ? now - before : now; };
    t.hits += grow(x.hits, last.hits);
    t.misses += grow(x.misses, last.misses);
    t.hit_bytes += grow(x.hit_bytes, last.hit_bytes);
    t.miss_bytes += grow(x.miss_bytes, last.miss_bytes);
    last = x;
    if (x.pool_bytes > 0 && !c.pool_reported) {
        c.pool_reported = c.has_pool = true;
        c.pool_since = std::chrono::steady_clock::now();
        one_place_due_.insert(c.models.begin(), c.models.end());  // its placements count from now
    }
    return true;
}

// A hook whose runtime copies model-sized buffers from memory that maps no model: counted like the
// pool counters (cumulative per client, the daemon adds what grew).
bool Daemon::on_unmapped(Client& c, const Unmapped& x) {
    unmapped_bytes_ += x.bytes >= c.unmapped.bytes ? x.bytes - c.unmapped.bytes : x.bytes;
    c.unmapped = x;
    return true;
}

namespace {
// Whether a loaded model's files are exactly these inodes, in this order (part 1 first).
bool same_files(const ModelResidency& r, const std::vector<FileIdentity>& ids) {
    const auto& files = r.model().files();
    if (files.size() != ids.size()) return false;
    for (size_t i = 0; i < ids.size(); ++i)
        if (files[i].identity.dev != ids[i].dev || files[i].identity.ino != ids[i].ino) return false;
    return true;
}
}  // namespace

bool Daemon::register_model(Client& c, uint32_t rq, std::vector<UniqueFd>& fds) {
    // The client proves it may read every file by handing over a readable descriptor of it; the
    // daemon opens the model by the path the kernel gives for the descriptor and checks that each
    // file it opened is the inode the client handed over. Never a path the client names.
    std::vector<FileIdentity> ids;
    for (size_t i = 0; i < fds.size(); ++i) {
        if (auto why = unusable(fds[i].get(), i); !why.empty()) return hub_->cannot(c, rq, EBADF, why);
        auto id = identity_of(fds[i].get(), fmt::format("descriptor {}", i));
        if (!id) return hub_->cannot(c, rq, id.error().errnum, id.error().what());
        ids.push_back(*id);
    }
    ModelEntry* entry = nullptr;
    for (auto& e : models_->all())
        if (e->res && same_files(*e->res, ids)) entry = e.get();
    if (!entry) {
        char link[64];
        std::snprintf(link, sizeof link, "/proc/self/fd/%d", fds.front().get());
        char target[4096];
        const ssize_t n = ::readlink(link, target, sizeof target - 1);
        if (n > 0) target[n] = '\0';
        // The path must lead to the very inode the client handed over.
        auto at_path = n > 0 && target[0] == '/' ? identity_of_path(target) : Result<FileIdentity>(failf("no path"));
        if (!at_path || at_path->dev != ids.front().dev || at_path->ino != ids.front().ino)
            return hub_->cannot(c, rq, ESTALE,
                                "the model file has no path the daemon can open that leads to it (deleted, replaced, "
                                "a memfd, or in another mount namespace)");
        std::string path = target;
        if (auto split = parse_split_name(path)) path = split_path(split->prefix, 0, split->count);
        const bool existed = models_->find_path(path) != nullptr;
        if (!existed) {
            ModelConfig mc;
            mc.path = path;
            mc.where = fmt::format("registered by client {} (pid {}, uid {})", c.id, c.peer.pid, c.peer.uid);
            models_->add(mc, path);
        }
        entry = models_->find_path(path);
        if (!existed) {
            entry->registered = true;
            entry->owner_uid = c.peer.uid;
        }
        std::vector<int> handed;
        for (const auto& fd : fds) handed.push_back(fd.get());
        PendingRegistration p{c.id, rq, entry->id, existed, ids};
        if (!entry->res) {
            // Its header is read and its setup made off the loop: the answer comes when that is done
            // (finish_registrations), within [prefetch] read_deadline.
            models_->open(*entry, entry->operator_added || !entry->registered ? nullptr : &handed);
            if (entry->opening) {
                registering_.push_back(std::move(p));
                return true;
            }
        }
        return finish_registration(c, p);
    }
    PendingRegistration p{c.id, rq, entry->id, true, ids};
    return finish_registration(c, p);
}

// The registrations that waited for this model's open: each answered, in the order they came.
void Daemon::finish_registrations(uint32_t model) {
    std::vector<PendingRegistration> due;
    std::erase_if(registering_, [&](PendingRegistration& p) {
        if (p.model != model) return false;
        due.push_back(std::move(p));
        return true;
    });
    for (const auto& p : due) {
        Client* c = nullptr;
        for (auto& o : hub_->all())
            if (o->id == p.client && !o->dead) c = o.get();
        if (c != nullptr) {
            if (!finish_registration(*c, p)) hub_->drop(*c, "its registration failed");
            continue;
        }
        // Its client went while it opened: a model only it brought goes too (as reap_clients does).
        ModelEntry* m = models_->find(model);
        const bool held = std::any_of(hub_->all().begin(), hub_->all().end(), [&](const auto& o) {
            return std::find(o->models.begin(), o->models.end(), model) != o->models.end();
        });
        const bool waited = std::any_of(registering_.begin(), registering_.end(),
                                        [&](const PendingRegistration& o) { return o.model == model; });
        if (m != nullptr && m->registered && !m->operator_added && !held && !waited)
            models_->remove(model, "the client that registered it is gone");
    }
}

bool Daemon::finish_registration(Client& c, const PendingRegistration& p) {
    const uint32_t rq = p.request;
    ModelEntry* entry = models_->find(p.model);
    if (entry == nullptr) return hub_->cannot(c, rq, ENOENT, "the model went away while it was being opened");
    {
        std::string why;
        int errnum = ESTALE;
        if (!entry->res) {
            why = entry->error;
            errnum = entry->set_aside_until > std::chrono::steady_clock::now() ? ETIMEDOUT : EINVAL;
        } else if (!same_files(*entry->res, p.ids)) {
            why = fmt::format("{}: the files the daemon opened are not the ones the client handed over (replaced "
                              "meanwhile, or not all parts, part 1 first)",
                              entry->path);
        }
        if (!why.empty()) {
            const bool waited = std::any_of(registering_.begin(), registering_.end(),
                                            [&](const PendingRegistration& o) { return o.model == p.model; });
            if (!p.existed && !waited) models_->remove(entry->id, "registration refused");
            return hub_->cannot(c, rq, errnum, why);
        }
    }
    entry->runtime_left.reset();
    if (std::find(c.models.begin(), c.models.end(), entry->id) == c.models.end()) {
        c.models.push_back(entry->id);
        one_place_due_.insert(entry->id);  // one more client that needs what its pool does not hold
    }
    const auto& map = entry->res->model().map();
    // One place as this model needs it, decided now and sent before the answer:
    // the client hears it before its model counts as registered, and before its hook's pool forms.
    std::set<uint32_t> registered;
    for (const auto& o : hub_->all())
        if (!o->dead) registered.insert(o->models.begin(), o->models.end());
    if (const auto now = read_system_memory()) memory_now_ = *now;  // the cap as it is, not as at the last placement
    decide_one_place(lock_cap(), registered);
    tell_vram_policy();
    hub_->reply(c, rq,
                ModelRegistered{entry->id, static_cast<uint32_t>(map.layers.size()), map.n_experts,
                                static_cast<uint32_t>(map.files.size())});
    // What is locked already (a warm start's locks, another runtime's): a client learns the locks
    // from Lock and Unlock only (a CUDA hook registers them for DMA, and fills its pool from them),
    // so it hears of those made before it came, now, before anything decided later.
    for (uint32_t slot = 0; slot < entry->res->n_slots(); ++slot)
        if (entry->res->state(slot).tier() == Tier::Locked)
            hub_->reply(
                c, 0, Directive{Action::Lock, entry->id, map.layers[slot / map.n_experts].index, slot % map.n_experts});
    return true;
}

// The pool budgets and whether experts in its pools leave RAM, as the client was last told.
void Daemon::send_vram_policy(Client& c) {
    hub_->reply(c, 0,
                VramPolicy{kAllDevices, config_.vram_pool.value_or(kNoPoolLimit), c.one_place_told, c.recency_told});
    for (const auto& [device, bytes] : config_.vram_pool_device)
        hub_->reply(c, 0, VramPolicy{device, bytes, c.one_place_told, c.recency_told});
}

// One place for a client: unless [vram] keep_ram_copy, while any of its models needs it
// (ModelEntry::one_place); a client with no model yet hears the default. Sent again when it changes.
void Daemon::tell_vram_policy() {
    for (auto& cp : hub_->all()) {
        Client& c = *cp;
        if (c.dead || !c.hello) continue;
        bool found = false, wants = false;
        for (const auto& m : models_->all())
            if (std::find(c.models.begin(), c.models.end(), m->id) != c.models.end()) {
                found = true;
                wants = wants || m->one_place;
            }
        const bool one_place = !config_.keep_ram_copy && (!found || wants);
        if (one_place == c.one_place_told) continue;
        c.one_place_told = one_place;
        send_vram_policy(c);
    }
}

void Daemon::tell_clients(const ModelEntry& m, uint32_t slot, Action action) {
    if (hub_->empty() || slot == kDenseSlot || !m.res) return;
    const auto& map = m.res->model().map();
    const uint32_t layer = slot / map.n_experts;
    if (layer >= map.layers.size()) return;
    const Directive d{action, m.id, map.layers[layer].index, slot % map.n_experts};
    for (auto& c : hub_->all())
        if (!c->dead && std::find(c->models.begin(), c->models.end(), m.id) != c->models.end()) c->outbox.push_back(d);
}

// The daemon's view of what belongs in VRAM, for each client with a pool: by heat (all clients'
// telemetry, and the profile saved before a restart or shared by the model's family), among
// admitted experts, the elite of each layer and the hottest of any layer up to [vram] directed of
// the pool it reported (pool_wanted). Promote what joins it, hottest first (the hook fills its
// pool in that order), Unpromote what leaves; the hook's own policy fills the rest of its pool.
// The pool's recency split (HeatTable::SplitFor::Pool, learnt at the pool's size) takes its share
// out of the directed part, and the client is told to keep the rest as an LRU (VramPolicy recency).
void Daemon::direct_pools() {
    for (auto& cp : hub_->all()) {
        Client& c = *cp;
        if (c.dead || !c.has_pool) continue;
        std::set<std::pair<uint32_t, uint32_t>> want;
        std::vector<std::pair<uint32_t, uint32_t>> order;  // hottest first
        PlannerSettings settings{config_.admit_after_uses, config_.elite_share, config_.hysteresis};
        uint64_t pool_bytes = 0;
        for (const auto& [device, stats] : c.pools) pool_bytes += stats.pool_bytes;
        size_t n_models = 0;
        bool recency = false;
        c.directed_capacity = 0;
        for (auto& m : models_->all())
            if (m->res && std::find(c.models.begin(), c.models.end(), m->id) != c.models.end()) ++n_models;
        for (auto& m : models_->all()) {
            if (!m->res || std::find(c.models.begin(), c.models.end(), m->id) == c.models.end()) continue;
            // The pool's share for this model, in experts of its mean size (split evenly between the
            // client's models).
            const uint64_t expert_bytes = m->res->n_slots() > 0 ? m->res->model().map().expert_bytes_total / m->res->n_slots() : 0;
            const double room = static_cast<double>(pool_bytes) / static_cast<double>(std::max<size_t>(n_models, 1));
            const double pool_experts =
                expert_bytes > 0 ? std::min<double>(room / static_cast<double>(expert_bytes), m->res->n_slots()) : 0;
            std::vector<uint8_t> held(m->res->n_slots(), 0);
            for (const auto& [mid, slot] : c.promoted)
                if (mid == m->id && slot < held.size()) held[slot] = 1;
            const PoolDirected d =
                direct_pool(m->res->heat(), settings, m->one_place, config_.pool_directed, pool_experts, held);
            recency = recency || d.recency;
            c.directed_capacity += d.capacity;
            for (uint32_t slot : d.wanted)
                if (want.emplace(m->id, slot).second) order.emplace_back(m->id, slot);
        }
        auto send = [&](std::pair<uint32_t, uint32_t> key, Action a) {
            for (auto& m : models_->all())
                if (m->id == key.first && m->res) {
                    const auto& map = m->res->model().map();
                    const uint32_t l = key.second / map.n_experts;
                    c.outbox.push_back(Directive{a, m->id, map.layers[l].index, key.second % map.n_experts});
                }
        };
        for (const auto& key : order)
            if (c.promoted.insert(key).second) send(key, Action::Promote);
        for (auto it = c.promoted.begin(); it != c.promoted.end();) {
            if (want.count(*it) == 0) {
                send(*it, Action::Unpromote);
                it = c.promoted.erase(it);
            } else {
                ++it;
            }
        }
        if (recency != c.recency_told && c.hello) {
            c.recency_told = recency;
            MC_LOG(LOG_INFO, "client {}: the part of its pool not directed {}", c.id,
                   recency ? "keeps what was used last (the routing reuses it)" : "follows its use counts again");
            send_vram_policy(c);
        }
    }
    bind_promoted();
}

// One read, one place, from the start: while every client of a model fills its pool for the first
// time (a runtime that starts warm: a profile, its family's heat), an expert every one of them was
// directed to hold (under one place) is read by those hooks from the file into VRAM (into free
// slots); the daemon does not read it into RAM for a lock first. One it locked already stays
// locked until a pool takes it (the hook fills from the registered pages). Once a pool holds nine
// in ten of what it was directed to, its changes (the ranking moving) go through RAM's locks again,
// as a pool's later fills displace what it holds: a read from the file for each of those would
// churn storage. A client without a pool, or one whose pool may not take experts out of RAM, needs
// them in RAM: then nothing is bound.
void Daemon::bind_promoted() {
    for (auto& cp : hub_->all()) {
        Client& c = *cp;
        if (c.dead || c.pool_filled || !c.pool_reported) continue;
        size_t held = 0;
        for (const auto& key : c.promoted) held += c.vram.count(key);
        // Filled (moecache/first_fill.h): the direction is nine in ten of the pool's size (not the
        // few experts the first routing named) and the pool holds nine in ten of it.
        const bool full =
            10 * c.promoted.size() >= 9 * uint64_t{c.directed_capacity} && first_fill_held(held, c.promoted.size());
        if (full || std::chrono::steady_clock::now() - c.pool_since > kFirstFillBound) c.pool_filled = true;
    }
    for (auto& m : models_->all()) {
        if (!m->res) continue;
        const uint32_t n = m->res->n_slots();
        std::vector<ClientPool> pools;
        for (const auto& c : hub_->all()) {
            if (c->dead || std::find(c->models.begin(), c->models.end(), m->id) == c->models.end()) continue;
            ClientPool& p = pools.emplace_back();
            p.pooled = c->has_pool && c->pool_reported;
            p.may_release = may_release_ram(*c, *m);
            p.filling = !c->pool_filled;
            p.holds.assign(n, 0);
            p.promoted.assign(n, 0);
            for (auto it = c->vram.lower_bound({m->id, 0}); it != c->vram.end() && it->first == m->id; ++it)
                if (it->second < n) p.holds[it->second] = 1;
            for (auto it = c->promoted.lower_bound({m->id, 0}); it != c->promoted.end() && it->first == m->id; ++it)
                if (it->second < n) p.promoted[it->second] = 1;
        }
        std::vector<uint8_t> bound =
            bound_for_vram(pools, n, m->one_place, config_.keep_ram_copy, config_.fill_from_files);
        // A read for a lock still queued (planned before the pools were known: a runtime's hook
        // registers its model a moment before its pool) is cancelled: the hook reads it.
        for (uint32_t s = 0; s < bound.size(); ++s) {
            if (!bound[s] || m->res->vram_bound(s) || m->res->state(s).tier() != Tier::Fetching || m->res->pinned(s))
                continue;
            prefetcher_->cancel(fetch_tag(m->id, s));
            m->res->abandon(s);
        }
        (void)m->res->set_vram_bound(std::move(bound));
    }
}

void Daemon::consume_client_telemetry() {
    busy_rings_ = false;
    any_rings_ = false;
    size_t rings = 0;
    for (const auto& cp : hub_->all()) rings += cp->ring && !cp->dead ? 1 : 0;
    const size_t share = rings == 0 ? kEventsPerTurn : std::max(kEventsPerTurn / rings, kMinEventsPerClient);
    // Who is read first moves each turn: no client is always last.
    const size_t first = hub_->empty() ? 0 : ring_turn_++ % hub_->all().size();
    for (size_t nth = 0; nth < hub_->all().size(); ++nth) {
        Client& c = *hub_->all()[(first + nth) % hub_->all().size()];
        // A client that has gone still has its last records read: they were sent.
        if (!c.ring) continue;
        // The client's models, resolved once per turn rather than per event.
        std::vector<ModelEntry*> mine;
        for (auto& m : models_->all())
            if (m->res && std::find(c.models.begin(), c.models.end(), m->id) != c.models.end()) mine.push_back(m.get());
        // A decision larger than a record comes as records in a row, the later ones continued:
        // joined into one before it is recorded, so that heat, the split learner and the trace see
        // the decision whole. One that a turn's end cut is joined as far as this turn read it.
        ModelEntry* joining = nullptr;
        uint16_t joining_block = 0;
        uint32_t joining_tokens = 0;
        joined_.clear();
        const auto record_joined = [&] {
            if (joining) record_routing(*joining, joining_block, joined_, joining_tokens);
            joining = nullptr;
            joined_.clear();
        };
        auto n = c.ring->consume(
            [&](const telemetry::RoutingEvent& e) {
                const auto it = std::find_if(mine.begin(), mine.end(), [&](const ModelEntry* m) { return m->id == e.model; });
                if (it == mine.end()) {
                    ++c.bad_events;
                    return;
                }
                ModelEntry& m = **it;
                const uint32_t n_experts = m.res->n_experts();
                uint32_t experts[telemetry::kMaxExpertsPerRecord];
                uint32_t k = 0;
                for (uint32_t i = 0; i < e.n_experts; ++i)
                    if (e.experts[i] < n_experts) experts[k++] = e.experts[i];
                // A router picks an expert once: a record naming one twice is malformed (22 times
                // over read as perfect reuse, it turned the recency split up and the lock cap to 0).
                uint32_t sorted[telemetry::kMaxExpertsPerRecord];
                std::copy(experts, experts + k, sorted);
                std::sort(sorted, sorted + k);
                const bool repeats = std::adjacent_find(sorted, sorted + k) != sorted + k;
                if (k != e.n_experts || repeats || !m.res->layer_of_block(e.block)) {
                    ++c.bad_events;
                    return;
                }
                ++c.events;
                const auto now = std::chrono::steady_clock::now();
                m.routed_by[c.peer.uid] = now;
                if (steers(c, m)) m.steered_routing = now;
                const std::span<const uint32_t> these(experts, k);
                if (e.continued && joining == &m && joining_block == e.block) {
                    joined_.insert(joined_.end(), these.begin(), these.end());
                    return;
                }
                record_joined();
                if (e.continued) {  // its start was read by an earlier turn
                    record_routing(m, e.block, these, 0, true);
                    return;
                }
                joining = &m;
                joining_block = e.block;
                joining_tokens = e.tokens;
                joined_.assign(these.begin(), these.end());
            },
            c.dead ? SIZE_MAX : share);
        record_joined();
        if (!n) {
            MC_LOG(LOG_WARNING, "client {}: telemetry ring dropped: {}", c.id, n.error().what());
            c.ring.reset();
            continue;
        }
        any_rings_ = true;
        // A ring that was a quarter full, or that gave its whole share, is read again soon: see loop_timeout().
        if (*n >= c.ring->capacity() / 4 || *n >= share) busy_rings_ = true;
    }
}

// The connections that went this turn: what they held in VRAM or needed in RAM is settled again,
// and a model a client registered (and no configuration names) goes with the last client holding it.
void Daemon::reap_clients() {
    const std::vector<uint32_t> left = hub_->reap();
    one_place_due_.insert(left.begin(), left.end());
    for (uint32_t id : left) {
        if (hub_->held(id)) continue;
        ModelEntry* m = models_->find(id);
        if (m == nullptr) continue;
        m->runtime_left = std::chrono::steady_clock::now();
        if (m->registered) models_->remove(id, "its last client is gone");
    }
}

}  // namespace moecache::daemon
