// The daemon's side of the client socket (docs/protocol.md): what each message does (who may
// connect, and the connections themselves, are the ClientHub's), and the telemetry rings read on
// every turn of the loop. Everything a client sends is
// untrusted: a message that does not decode, a descriptor that is not a readable regular file, a
// model or block it did not register gets a Failure naming what is wrong; a protocol violation
// (a packet that does not decode, a request before Hello) also closes the connection, a request
// that cannot be met does not. Other clients never notice.
#include "sessions/client_sessions.h"
#include "clients/access.h"
#include "clients/client_hub.h"
#include "moecache/daemon/decide_step.h"
#include "moecache/daemon/model_registry.h"

#include "moecache/daemon/prefetcher.h"
#include "moecache/daemon/system_memory.h"
#include "moecache/file_util.h"
#include "moecache/first_fill.h"
#include "moecache/log.h"
#include "moecache/text.h"

#include <fcntl.h>
#include <sys/epoll.h>
#include <sys/stat.h>
#include <unistd.h>

#include <poll.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <set>

namespace moecache::daemon {
namespace {

using namespace moecache::protocol;

const char* kind_of(mode_t m) {
    if (S_ISDIR(m)) return "a directory";
    if (S_ISFIFO(m)) return "a pipe";
    if (S_ISSOCK(m)) return "a socket";
    if (S_ISCHR(m)) return "a character device";
    if (S_ISBLK(m)) return "a block device";
    if (S_ISLNK(m)) return "a symbolic link";
    return "not a regular file";
}

// Why a descriptor cannot stand for a model file the client may read, or "" if it can. Looked at
// as the kernel has it cached: a plain fstat of a file on NFS, SMB or FUSE asks the server, and a
// hung one (or a user's own FUSE file system) never answers; on the loop that held it for good.
std::string unusable(int fd, size_t index) {
    mode_t mode = 0;
    if (auto id = cached_identity_of(fd, fmt::format("descriptor {}", index), &mode); !id) return id.error().what();
    const int flags = ::fcntl(fd, F_GETFL);
    if (flags >= 0 && (flags & O_PATH))
        return fmt::format("descriptor {} was opened with O_PATH: it proves no right to read the file", index);
    if (!S_ISREG(mode)) return fmt::format("descriptor {} is {}, not a model file", index, kind_of(mode));
    if (flags < 0 || (flags & O_ACCMODE) == O_WRONLY)
        return fmt::format("descriptor {} is not open for reading", index);
    return "";
}

}  // namespace

ClientSessions::ClientSessions(const Config& config, const std::optional<gid_t>& admin_gid, ModelRegistry& models,
                               ClientHub& hub, DecideStep& decide, RoutingSink routing)
    : config_(config),
      admin_gid_(admin_gid),
      models_(models),
      hub_(hub),
      decide_(decide),
      routing_(std::move(routing)) {}

bool ClientSessions::on_packet(Client& c, Packet& p) {
    if (p.oversized)
        return hub_.refuse(c, 0, EMSGSIZE,
                           fmt::format("a packet longer than the {} bytes a message may have", kMaxMessageBytes));
    if (p.fds_truncated)
        return hub_.refuse(
            c, 0, EMSGSIZE,
            fmt::format("a packet with more descriptors than any message takes (at most {})", kMaxModelFiles));
    auto m = decode(p.bytes, p.fds.size());
    if (!m) return hub_.refuse(c, 0, EPROTO, m.error().what());
    const uint32_t rq = m->request;
    if (!c.hello && !std::holds_alternative<Hello>(m->body))
        return hub_.refuse(c, rq, EPROTO, fmt::format("{} before Hello: say Hello first", to_string(type_of(m->body))));
    if (auto* h = std::get_if<Hello>(&m->body)) {
        if (c.hello) return hub_.refuse(c, rq, EPROTO, "a second Hello");
        if (kVersion < h->min_version || kVersion > h->max_version)
            return hub_.refuse(c, rq, EPROTONOSUPPORT,
                               fmt::format("this moecached speaks protocol version {}; the client asks for {} to {}",
                                           kVersion, h->min_version, h->max_version));
        c.hello = true;
        c.name = h->name;
        if (c.peer.pid > 0)
            if (auto cmdline = read_whole_file(fmt::format("/proc/{}/cmdline", c.peer.pid), 1 << 16, "command line"))
                c.role = process_role(split_cmdline(*cmdline), nullptr, nullptr);
        if (const std::string problem = command_line_problem(c.role); !problem.empty())
            MC_LOG(LOG_WARNING, "client {} ({}, pid {}): {}", c.id, printable_utf8(c.name), c.peer.pid, problem);
        hub_.reply(c, rq, HelloReply{kVersion, c.id});
        c.one_place_told = !config_.keep_ram_copy;
        decide_.send_vram_policy(c);
        return true;
    }
    if (std::holds_alternative<RegisterModel>(m->body)) return register_model(c, rq, p.fds);
    if (auto* d = std::get_if<DescribeMapping>(&m->body)) {
        if (std::find(c.models.begin(), c.models.end(), d->model) == c.models.end())
            return hub_.cannot(c, rq, ENOENT, fmt::format("model {} is not one this client registered", d->model));
        for (auto& e : models_.all()) {
            if (e->id != d->model || !e->res) continue;
            const auto& files = e->res->model().files();
            if (d->file >= files.size())
                return hub_.cannot(
                    c, rq, EINVAL,
                    fmt::format("model {} has {} files; there is no file {}", d->model, files.size(), d->file));
            // A mapping covers whole pages: its last may run past the end of the file.
            const uint64_t size = files[d->file].identity.size;
            const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
            const uint64_t mappable = (size + page - 1) / page * page;
            if (d->file_offset > size || d->length > mappable - d->file_offset)
                return hub_.cannot(
                    c, rq, EINVAL,
                    fmt::format("a mapping of {} bytes from offset {} runs past the end of file {} ({} bytes)",
                                d->length, d->file_offset, d->file, files[d->file].identity.size));
        }
        hub_.reply(c, rq, Ok{});
        return true;
    }
    if (auto* t = std::get_if<TelemetrySetup>(&m->body)) {
        if (c.ring) return hub_.cannot(c, rq, EEXIST, "a telemetry ring is attached already");
        auto ring = telemetry::TelemetryRing::attach(p.fds.front().get(), t->ring_bytes);
        if (!ring) return hub_.cannot(c, rq, EINVAL, ring.error().what());
        c.ring = std::make_unique<telemetry::TelemetryRing>(std::move(*ring));
        hub_.reply(c, rq, Ok{});
        return true;
    }
    if (auto* x = std::get_if<ExpertPlacement>(&m->body)) return on_placement(c, *x);
    if (auto* x = std::get_if<PoolStats>(&m->body)) return on_pool_stats(c, *x);
    if (auto* x = std::get_if<Unmapped>(&m->body)) return on_unmapped(c, *x);
    if (std::holds_alternative<Goodbye>(m->body)) {
        hub_.reply(c, rq, Ok{});
        hub_.drop(c, "it said goodbye");
        return true;
    }
    return hub_.refuse(c, rq, EPROTO,
                       fmt::format("{} is a message the daemon sends, not one it takes", to_string(type_of(m->body))));
}

// One place: an expert in a client's VRAM pool is recorded as held there. Whether RAM gives it
// up is settled at the turn's decisions (DecideStep::settle_one_place): only once the client reported a pool,
// only when every client of the model holds it, and only for a client allowed to evict. A one-way
// message: a bad one is answered, nothing else.
bool ClientSessions::on_placement(Client& c, const ExpertPlacement& x) {
    if (std::find(c.models.begin(), c.models.end(), x.model) == c.models.end())
        return hub_.cannot(c, 0, ENOENT,
                           fmt::format("ExpertPlacement: model {} is not one this client registered", x.model));
    ModelEntry* e = nullptr;
    for (auto& m : models_.all())
        if (m->id == x.model && m->res) e = m.get();
    if (e == nullptr) return hub_.cannot(c, 0, ENOENT, fmt::format("ExpertPlacement: model {} is not loaded", x.model));
    const auto layer = e->res->layer_of_block(x.block);
    if (!layer || x.expert >= e->res->n_experts())
        return hub_.cannot(
            c, 0, EINVAL,
            fmt::format("ExpertPlacement: model {} has no routed expert {} in block {}", x.model, x.expert, x.block));
    const uint32_t slot = *layer * e->res->n_experts() + x.expert;
    const auto key = std::make_pair(x.model, slot);
    if (!c.has_pool) {
        c.has_pool = true;
        decide_.request();  // its directives go out with the turn's placement
    }
    if (x.device == kHostTier) {
        if (c.vram.erase(key) > 0) {
            decide_.one_place_due(x.model);
            MC_LOG(LOG_DEBUG, "client {}: expert {} of block {} of {} left its VRAM pool", c.id, x.expert, x.block,
                   e->path);
        }
        return true;
    }
    if (!c.vram.insert(key).second) return true;
    MC_LOG(LOG_DEBUG, "client {}: expert {} of block {} of {} is in its VRAM pool on device {}", c.id, x.expert,
           x.block, e->path, x.device);
    if (c.pool_reported) decide_.one_place_due(x.model);
    return true;
}

// A hook's pool counters are cumulative for its life: the daemon adds what grew since the last
// report, so that its totals survive clients that come and go (a counter that went back is a
// restarted count: all of it is new).
bool ClientSessions::on_pool_stats(Client& c, const PoolStats& x) {
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
        decide_.one_place_due(c.models.begin(), c.models.end());  // its placements count from now
    }
    return true;
}

// A hook whose runtime copies model-sized buffers from memory that maps no model: counted like the
// pool counters (cumulative per client, the daemon adds what grew).
bool ClientSessions::on_unmapped(Client& c, const Unmapped& x) {
    unmapped_bytes_ += x.bytes >= c.unmapped.bytes ? x.bytes - c.unmapped.bytes : x.bytes;
    c.unmapped = x;
    return true;
}

namespace {
// A model only users' clients brought: no [[model]] names it and none came over D-Bus.
bool users_model(const ModelEntry& m) { return m.registered && !m.operator_added; }
}  // namespace

// Every model a user registers costs the daemon memory and descriptors, and each tick a look at
// the page cache for each of its experts: one uid registering a few thousand sparse files, or a
// handful that claim a quarter of a million tiny experts each, held the loop seconds a tick and
// grew without end. What the clients of one uid (root's: of one cgroup) hold is bounded.
std::string ClientSessions::past_share(const Client& c, const ModelEntry* m, bool pending) {
    if (m != nullptr && !users_model(*m)) return "";
    const std::string& key = c.peer.fairness_key;
    std::set<uint32_t> ids;
    for (const auto& o : hub_.all())
        if (!o->dead && o->peer.fairness_key == key) ids.insert(o->models.begin(), o->models.end());
    if (pending)
        for (const auto& p : registering_)
            if (const Client* o = hub_.find(p.client); o != nullptr && o->peer.fairness_key == key) ids.insert(p.model);
    if (m != nullptr && ids.count(m->id) > 0) return "";  // held already: nothing more
    uint32_t models = 0;
    uint64_t experts = 0;
    for (uint32_t id : ids) {
        const ModelEntry* e = models_.find(id);
        if (e == nullptr || !users_model(*e)) continue;
        ++models;
        if (e->res) experts += e->res->n_slots();
    }
    if (models >= config_.max_models_per_uid)
        return fmt::format(
            "{} holds {} models that users registered already, the most [clients] max_models_per_uid "
            "allows (root's are counted per cgroup)",
            key, models);
    if (m == nullptr || !m->res) return "";  // its experts are counted once it is open
    if (experts + m->res->n_slots() > config_.max_experts_per_uid)
        return fmt::format(
            "{}: its {} experts and the {} of the models {} holds already are more than the {} "
            "[clients] max_experts_per_uid allows (root's are counted per cgroup)",
            m->path, m->res->n_slots(), experts, key, config_.max_experts_per_uid);
    return "";
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

bool ClientSessions::register_model(Client& c, uint32_t rq, std::vector<UniqueFd>& fds) {
    // The client proves it may read every file by handing over a readable descriptor of it; the
    // daemon opens the model by the path the kernel gives for the descriptor and checks that each
    // file it opened is the inode the client handed over. Never a path the client names.
    std::vector<FileIdentity> ids;
    for (size_t i = 0; i < fds.size(); ++i) {
        if (auto why = unusable(fds[i].get(), i); !why.empty()) return hub_.cannot(c, rq, EBADF, why);
        auto id = cached_identity_of(fds[i].get(), fmt::format("descriptor {}", i));
        if (!id) return hub_.cannot(c, rq, id.error().errnum, id.error().what());
        ids.push_back(*id);
    }
    ModelEntry* entry = nullptr;
    for (auto& e : models_.all())
        if (e->res && same_files(*e->res, ids)) entry = e.get();
    if (entry != nullptr)
        if (const auto why = past_share(c, entry, true); !why.empty()) return hub_.cannot(c, rq, EDQUOT, why);
    if (!entry) {
        char link[64];
        std::snprintf(link, sizeof link, "/proc/self/fd/%d", fds.front().get());
        char target[4096];
        const ssize_t n = ::readlink(link, target, sizeof target - 1);
        if (n > 0) target[n] = '\0';
        // The path must lead to the very inode the client handed over. Where the dentry cache cannot
        // say without asking the file system (a lookup of NFS or FUSE), the open checks it, off the
        // loop (ModelRegistry::open); a model the daemon has already is its files whatever the name.
        auto at_path =
            n > 0 && target[0] == '/' ? cached_identity_of_path(target) : Result<FileIdentity>(failf("no path"));
        const bool at_open = !at_path && at_path.error().errnum == EAGAIN;
        if (!at_open && (!at_path || at_path->dev != ids.front().dev || at_path->ino != ids.front().ino))
            return hub_.cannot(c, rq, ESTALE,
                               "the model file has no path the daemon can open that leads to it (deleted, replaced, "
                               "a memfd, or in another mount namespace)");
        std::string path = target;
        if (auto split = parse_split_name(path)) path = split_path(split->prefix, 0, split->count);
        const bool existed = models_.find_path(path) != nullptr;
        if (const auto why = past_share(c, models_.find_path(path), true); !why.empty())
            return hub_.cannot(c, rq, EDQUOT, why);
        if (!existed) {
            ModelConfig mc;
            mc.path = path;
            mc.where = fmt::format("registered by client {} (pid {}, uid {})", c.id, c.peer.pid, c.peer.uid);
            models_.add(mc, path);
        }
        entry = models_.find_path(path);
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
            models_.open(*entry, entry->operator_added || !entry->registered ? nullptr : &handed);
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
void ClientSessions::finish_registrations(uint32_t model) {
    std::vector<PendingRegistration> due;
    std::erase_if(registering_, [&](PendingRegistration& p) {
        if (p.model != model) return false;
        due.push_back(std::move(p));
        return true;
    });
    for (const auto& p : due) {
        Client* c = nullptr;
        for (auto& o : hub_.all())
            if (o->id == p.client && !o->dead) c = o.get();
        if (c != nullptr) {
            if (!finish_registration(*c, p)) hub_.drop(*c, "its registration failed");
            continue;
        }
        // Its client went while it opened: a model only it brought goes too (as reap() does).
        ModelEntry* m = models_.find(model);
        const bool held = std::any_of(hub_.all().begin(), hub_.all().end(), [&](const auto& o) {
            return std::find(o->models.begin(), o->models.end(), model) != o->models.end();
        });
        const bool waited = std::any_of(registering_.begin(), registering_.end(),
                                        [&](const PendingRegistration& o) { return o.model == model; });
        if (m != nullptr && m->registered && !m->operator_added && !held && !waited)
            models_.remove(model, "the client that registered it is gone");
    }
}

bool ClientSessions::finish_registration(Client& c, const PendingRegistration& p) {
    const uint32_t rq = p.request;
    ModelEntry* entry = models_.find(p.model);
    if (entry == nullptr) return hub_.cannot(c, rq, ENOENT, "the model went away while it was being opened");
    {
        std::string why;
        int errnum = ESTALE;
        if (!entry->res) {
            why = entry->error;
            errnum = entry->set_aside_until > std::chrono::steady_clock::now() ? ETIMEDOUT : EINVAL;
        } else if (!same_files(*entry->res, p.ids)) {
            why = fmt::format(
                "{}: the files the daemon opened are not the ones the client handed over (replaced "
                "meanwhile, or not all parts, part 1 first)",
                entry->path);
        } else if (why = past_share(c, entry, false); !why.empty()) {
            errnum = EDQUOT;  // its experts, now that it is open
        }
        if (!why.empty()) {
            const bool waited = std::any_of(registering_.begin(), registering_.end(),
                                            [&](const PendingRegistration& o) { return o.model == p.model; });
            if (!p.existed && !waited) models_.remove(entry->id, "registration refused");
            return hub_.cannot(c, rq, errnum, why);
        }
    }
    entry->runtime_left.reset();
    if (std::find(c.models.begin(), c.models.end(), entry->id) == c.models.end()) {
        c.models.push_back(entry->id);
        decide_.one_place_due(entry->id);  // one more client that needs what its pool does not hold
    }
    const auto& map = entry->res->model().map();
    // One place as this model needs it, decided now and sent before the answer:
    // the client hears it before its model counts as registered, and before its hook's pool forms.
    std::set<uint32_t> registered;
    for (const auto& o : hub_.all())
        if (!o->dead) registered.insert(o->models.begin(), o->models.end());
    decide_.read_memory();  // the cap as it is, not as at the last placement
    decide_.decide_one_place(decide_.lock_cap(), registered);
    decide_.tell_vram_policy();
    hub_.reply(c, rq,
               ModelRegistered{entry->id, static_cast<uint32_t>(map.layers.size()), map.n_experts,
                               static_cast<uint32_t>(map.files.size())});
    // What is locked already (a warm start's locks, another runtime's): a client learns the locks
    // from Lock and Unlock only (a CUDA hook registers them for DMA, and fills its pool from them),
    // so it hears of those made before it came, now, before anything decided later.
    for (uint32_t slot = 0; slot < entry->res->n_slots(); ++slot)
        if (entry->res->state(slot).tier() == Tier::Locked)
            hub_.reply(
                c, 0, Directive{Action::Lock, entry->id, map.layers[slot / map.n_experts].index, slot % map.n_experts});
    return true;
}

void ClientSessions::read_rings() {
    busy_rings_ = false;
    any_rings_ = false;
    size_t rings = 0;
    for (const auto& cp : hub_.all()) rings += cp->ring && !cp->dead ? 1 : 0;
    const size_t share = rings == 0 ? kEventsPerTurn : std::max(kEventsPerTurn / rings, kMinEventsPerClient);
    // Who is read first moves each turn: no client is always last.
    const size_t first = hub_.empty() ? 0 : ring_turn_++ % hub_.all().size();
    for (size_t nth = 0; nth < hub_.all().size(); ++nth) {
        Client& c = *hub_.all()[(first + nth) % hub_.all().size()];
        // A client that has gone still has its last records read: they were sent.
        if (!c.ring) continue;
        // The client's models, resolved once per turn rather than per event.
        std::vector<ModelEntry*> mine;
        for (auto& m : models_.all())
            if (m->res && std::find(c.models.begin(), c.models.end(), m->id) != c.models.end()) mine.push_back(m.get());
        // A decision larger than a record comes as records in a row, the later ones continued:
        // joined into one before it is recorded, so that heat, the split learner and the trace see
        // the decision whole. One that a turn's end cut is joined as far as this turn read it.
        ModelEntry* joining = nullptr;
        uint16_t joining_block = 0;
        uint32_t joining_tokens = 0;
        joined_.clear();
        const auto record_joined = [&] {
            if (joining) routing_(*joining, joining_block, joined_, joining_tokens, false);
            joining = nullptr;
            joined_.clear();
        };
        auto n = c.ring->consume(
            [&](const telemetry::RoutingEvent& e) {
                const auto it =
                    std::find_if(mine.begin(), mine.end(), [&](const ModelEntry* m) { return m->id == e.model; });
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
                if (steers(c, m, admin_gid_)) m.steered_routing = now;
                const std::span<const uint32_t> these(experts, k);
                if (e.continued && joining == &m && joining_block == e.block) {
                    joined_.insert(joined_.end(), these.begin(), these.end());
                    return;
                }
                record_joined();
                if (e.continued) {  // its start was read by an earlier turn
                    routing_(m, e.block, these, 0, true);
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
void ClientSessions::reap() {
    const std::vector<uint32_t> left = hub_.reap();
    decide_.one_place_due(left.begin(), left.end());
    for (uint32_t id : left) {
        if (hub_.held(id)) continue;
        ModelEntry* m = models_.find(id);
        if (m == nullptr) continue;
        m->runtime_left = std::chrono::steady_clock::now();
        if (m->registered) models_.remove(id, "its last client is gone");
    }
}

}  // namespace moecache::daemon
