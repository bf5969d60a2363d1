#include "moecache/client/protocol.h"

#include <sys/socket.h>

#include <algorithm>
#include <cstring>
#include <type_traits>

namespace moecache::protocol {
namespace {

class Writer {
public:
    void u8(uint8_t v) { out_.push_back(v); }
    void u16(uint16_t v) { put(v, 2); }
    void u32(uint32_t v) { put(v, 4); }
    void u64(uint64_t v) { put(v, 8); }
    void str(const std::string& s) {
        u16(static_cast<uint16_t>(s.size()));
        out_.insert(out_.end(), s.begin(), s.end());
    }
    std::vector<uint8_t> take() { return std::move(out_); }

private:
    void put(uint64_t v, int n) {
        for (int i = 0; i < n; ++i) out_.push_back(static_cast<uint8_t>(v >> (8 * i)));
    }
    std::vector<uint8_t> out_;
};

// Reads a body; the first failure sticks, and says at which byte of the packet it happened.
class Reader {
public:
    Reader(std::span<const uint8_t> b, size_t at) : b_(b), at_(at) {}
    bool need(size_t n, const char* what) {
        if (!error_.empty()) return false;
        if (b_.size() - at_ < n) {
            error_ = fmt::format("at byte {}: the packet ends inside {} ({} bytes left, {} needed)", at_, what,
                                 b_.size() - at_, n);
            return false;
        }
        return true;
    }
    uint64_t get(int n, const char* what) {
        if (!need(static_cast<size_t>(n), what)) return 0;
        uint64_t v = 0;
        for (int i = 0; i < n; ++i) v |= uint64_t{b_[at_ + static_cast<size_t>(i)]} << (8 * i);
        at_ += static_cast<size_t>(n);
        return v;
    }
    uint8_t u8(const char* what) { return static_cast<uint8_t>(get(1, what)); }
    [[nodiscard]] bool more() const { return error_.empty() && at_ < b_.size(); }
    uint16_t u16(const char* what) { return static_cast<uint16_t>(get(2, what)); }
    uint32_t u32(const char* what) { return static_cast<uint32_t>(get(4, what)); }
    uint64_t u64(const char* what) { return get(8, what); }
    std::string str(const char* what, size_t max) {
        const size_t at = at_;
        const uint16_t n = u16(what);
        if (!error_.empty()) return {};
        if (n > max) {
            error_ = fmt::format("at byte {}: {} is {} bytes long, more than the {} allowed", at, what, n, max);
            return {};
        }
        if (!need(n, what)) return {};
        std::string s(reinterpret_cast<const char*>(b_.data() + at_), n);
        for (char c : s)
            if (c < 0x20 || c > 0x7e) {
                error_ = fmt::format("at byte {}: {} holds a byte that is not printable ASCII", at_, what);
                return {};
            }
        at_ += n;
        return s;
    }
    void fail(std::string e) {
        if (error_.empty()) error_ = std::move(e);
    }
    [[nodiscard]] size_t at() const { return at_; }
    [[nodiscard]] const std::string& error() const { return error_; }
    [[nodiscard]] bool at_end() const { return at_ == b_.size(); }

private:
    std::span<const uint8_t> b_;
    size_t at_;
    std::string error_;
};

// ---- the wire table: each message's fields in order, walked by encode() and decode() alike ----
//
// wire(x, v) names every field of a message as it goes on the wire, and the checks a received
// message must pass, each where it stands (the first failure is the one said, with the byte it is
// at). Out (encode) writes the fields and skips the checks; In (decode) reads them into x.

class Out {
public:
    explicit Out(Writer& w) : w_(w) {}
    void u16(const char*, uint16_t v) { w_.u16(v); }
    void u32(const char*, uint32_t v) { w_.u32(v); }
    void u64(const char*, uint64_t v) { w_.u64(v); }
    void i32(const char*, int32_t v) { w_.u32(static_cast<uint32_t>(v)); }
    template <class E>
    void u8(const char*, E v) {
        w_.u8(static_cast<uint8_t>(v));
    }
    void flag(const char*, bool v) { w_.u8(v ? 1 : 0); }
    // A trailing byte, there only when it says something (docs/protocol.md).
    template <class E>
    void trailing_u8(const char*, E v, E absent, uint8_t) {
        if (v != absent) w_.u8(static_cast<uint8_t>(v));
    }
    void trailing_flag(const char*, bool v) {
        if (v) w_.u8(1);
    }
    void str(const char*, const std::string& s, size_t max) { w_.str(s.substr(0, max)); }
    // Free text (a Failure's): cut to `max`, every byte not printable ASCII made '?'.
    void text(const char*, const std::string& s, size_t max) {
        std::string t = s.substr(0, max);
        for (char& c : t)
            if (c < 0x20 || c > 0x7e) c = '?';
        w_.str(t);
    }
    template <class Ok, class Say>
    void check(Ok&&, Say&&) {}

private:
    Writer& w_;
};

class In {
public:
    In(Reader& r, const char* message) : r_(r), message_(message) {}
    void u16(const char* f, uint16_t& v) { v = r_.u16(name(f)); }
    void u32(const char* f, uint32_t& v) { v = r_.u32(name(f)); }
    void u64(const char* f, uint64_t& v) { v = r_.u64(name(f)); }
    void i32(const char* f, int32_t& v) { v = static_cast<int32_t>(r_.u32(name(f))); }
    template <class E>
    void u8(const char* f, E& v) {
        v = static_cast<E>(r_.u8(name(f)));
    }
    // A byte that is 0 or 1.
    void flag(const char* f, bool& v) {
        const size_t at = r_.at();
        const uint8_t b = r_.u8(name(f));
        if (r_.error().empty() && b > 1)
            r_.fail(fmt::format("at byte {}: {} {} is {}, not 0 or 1", at, message_, f, b));
        v = b == 1;
    }
    // Absent, or one of 1 .. last (never `absent`'s 0: the byte is there only when it says something).
    template <class E>
    void trailing_u8(const char* f, E& v, E absent, uint8_t last) {
        if (!r_.more()) return;
        const size_t at = r_.at();
        const uint8_t b = r_.u8(name(f));
        if (r_.error().empty() && (b == static_cast<uint8_t>(absent) || b > last))
            r_.fail(fmt::format("at byte {}: {} {} is {}, not 1 .. {} (the byte is there only when known)", at,
                                message_, f, b, last));
        v = static_cast<E>(b);
    }
    void trailing_flag(const char* f, bool& v) {
        if (!r_.more()) return;
        const size_t at = r_.at();
        const uint8_t b = r_.u8(name(f));
        if (r_.error().empty() && b != 1)
            r_.fail(fmt::format("at byte {}: {} {} is {}: the byte is there only when it is 1", at, message_, f, b));
        v = b == 1;
    }
    void str(const char* f, std::string& s, size_t max) { s = r_.str(name(f), max); }
    void text(const char* f, std::string& s, size_t max) { str(f, s, max); }  // checked as any string
    // A condition on what was read so far; say(at) names what is wrong, at the byte where the message began.
    template <class Ok, class Say>
    void check(Ok&& ok, Say&& say) {
        if (r_.error().empty() && !ok()) r_.fail(say(r_.at()));
    }

private:
    const char* name(const char* f) {
        name_ = fmt::format("{}.{}", message_, f);
        return name_.c_str();
    }
    Reader& r_;
    const char* message_;
    std::string name_;
};

template <class M, class V>
void wire(M& x, V& v) {
    (void)x;  // Goodbye and Ok have no fields
    (void)v;
    using T = std::remove_const_t<M>;
    if constexpr (std::is_same_v<T, Hello>) {
        v.u16("min_version", x.min_version);
        v.u16("max_version", x.max_version);
        v.str("name", x.name, kMaxName);
        v.check([&] { return x.min_version <= x.max_version; },
                [&](size_t) {
                    return fmt::format("at byte {}: Hello asks for versions {} to {}, an empty range", kHeaderBytes,
                                       x.min_version, x.max_version);
                });
    } else if constexpr (std::is_same_v<T, RegisterModel>) {
        v.u32("files", x.files);
        v.check([&] { return x.files != 0 && x.files <= kMaxModelFiles; },
                [&](size_t) {
                    return fmt::format("at byte {}: RegisterModel names {} files; a model has 1 to {}", kHeaderBytes,
                                       x.files, kMaxModelFiles);
                });
    } else if constexpr (std::is_same_v<T, DescribeMapping>) {
        v.u32("model", x.model);
        v.u32("file", x.file);
        v.u64("address", x.address);
        v.u64("length", x.length);
        v.u64("file_offset", x.file_offset);
        v.check(
            [&] {
                return x.length != 0 && x.address + x.length >= x.address && x.file_offset + x.length >= x.file_offset;
            },
            [&](size_t) {
                return fmt::format(
                    "at byte {}: DescribeMapping of {} bytes at {:#x} (file offset {}) is empty or "
                    "wraps around",
                    kHeaderBytes + 8, x.length, x.address, x.file_offset);
            });
    } else if constexpr (std::is_same_v<T, TelemetrySetup>) {
        v.u32("ring_bytes", x.ring_bytes);
        v.check([&] { return x.ring_bytes >= kMinRingBytes && x.ring_bytes <= kMaxRingBytes; },
                [&](size_t) {
                    return fmt::format("at byte {}: a telemetry ring of {} bytes; it must be {} to {}", kHeaderBytes,
                                       x.ring_bytes, kMinRingBytes, kMaxRingBytes);
                });
    } else if constexpr (std::is_same_v<T, HelloReply>) {
        v.u16("version", x.version);
        v.u32("client_id", x.client_id);
    } else if constexpr (std::is_same_v<T, Failure>) {
        v.i32("errnum", x.errnum);
        v.text("text", x.text, kMaxErrorText);
    } else if constexpr (std::is_same_v<T, ModelRegistered>) {
        v.u32("model", x.model);
        v.u32("layers", x.layers);
        v.u32("experts", x.experts);
        v.u32("files", x.files);
    } else if constexpr (std::is_same_v<T, Directive>) {
        v.u8("action", x.action);
        v.check([&] { return x.action >= Action::Promote && x.action <= Action::Shifted; },
                [&](size_t) {
                    return fmt::format("at byte {}: Directive action {} is not one of 1 (promote) .. 6 (shifted)",
                                       kHeaderBytes, static_cast<unsigned>(x.action));
                });
        v.u32("model", x.model);
        v.u32("block", x.block);
        v.u32("expert", x.expert);
    } else if constexpr (std::is_same_v<T, ExpertPlacement>) {
        v.u32("model", x.model);
        v.u32("block", x.block);
        v.u32("expert", x.expert);
        v.u32("device", x.device);
    } else if constexpr (std::is_same_v<T, PoolStats>) {
        v.u32("device", x.device);
        v.check([&] { return x.device < kMaxPoolDevices; },
                [&](size_t) {
                    return fmt::format("at byte {}: PoolStats device {} is not below {}", kHeaderBytes, x.device,
                                       kMaxPoolDevices);
                });
        v.u64("hits", x.hits);
        v.u64("misses", x.misses);
        v.u64("hit_bytes", x.hit_bytes);
        v.u64("miss_bytes", x.miss_bytes);
        v.u64("pool_bytes", x.pool_bytes);
        v.trailing_u8("miss_path", x.miss_path, MissPath::Unknown, kLastMissPath);
    } else if constexpr (std::is_same_v<T, Unmapped>) {
        v.u64("copies", x.copies);
        v.u64("bytes", x.bytes);
        v.flag("no_model", x.no_model);
    } else if constexpr (std::is_same_v<T, VramPolicy>) {
        v.u32("device", x.device);
        v.u64("pool_bytes", x.pool_bytes);
        v.flag("one_place", x.one_place);
        v.trailing_flag("recency", x.recency);
    }
}

}  // namespace

bool is_fast(MissPath p) { return p == MissPath::Registered || p == MissPath::DaemonLocks || p == MissPath::Unknown; }

const char* to_string(MissPath p) {
    switch (p) {
        case MissPath::Unknown: return "unknown";
        case MissPath::Registered: return "registered";
        case MissPath::DaemonLocks: return "daemon-locks";
        case MissPath::StagedChosen: return "staged-chosen";
        case MissPath::PageableChosen: return "pageable-chosen";
        case MissPath::StagedOverBudget: return "staged-over-budget";
        case MissPath::StagedRegisterFailed: return "staged-register-failed";
        case MissPath::SlowLink: return "slow-link";
    }
    return "unknown";
}

const char* reason_of(MissPath p) {
    switch (p) {
        case MissPath::Unknown: return "not said";
        case MissPath::Registered: return "misses come straight from page-locked pages of the model, at the link's speed";
        case MissPath::DaemonLocks:
            return "misses of what moecached keeps locked come at the link's speed, the rest from storage (one place)";
        case MissPath::StagedChosen:
            return "MOECACHE_CUDA_PIN=staging: misses are copied through pinned buffers, a memcpy on every layer's path";
        case MissPath::PageableChosen:
            return "MOECACHE_CUDA_PIN=off: misses are copied from pageable memory (the driver stages them with one thread)";
        case MissPath::StagedOverBudget:
            return "the models' experts are larger than the pin budget (MOECACHE_CUDA_PIN_BUDGET, half of memory by "
                   "default) and no moecached chooses which to lock: misses are staged through pinned buffers";
        case MissPath::StagedRegisterFailed:
            return "the driver would not register the model's pages for DMA: misses are staged through pinned buffers";
        case MissPath::SlowLink:
            return "the link to the GPU is slower than reading host memory: every miss costs more than the CPU's own "
                   "math on it";
    }
    return "not said";
}

const char* advice_for(MissPath p) {
    switch (p) {
        case MissPath::Unknown:
        case MissPath::Registered:
        case MissPath::DaemonLocks: return "";
        case MissPath::StagedChosen:
        case MissPath::PageableChosen:
            return "decode with GGML_OP_OFFLOAD_MIN_BATCH=1 is slower than without moecache: unset MOECACHE_CUDA_PIN "
                   "(auto), or unset GGML_OP_OFFLOAD_MIN_BATCH to compute decode's experts on the CPU";
        case MissPath::StagedOverBudget:
            return "decode with GGML_OP_OFFLOAD_MIN_BATCH=1 is slower than without moecache: run moecached (its locks "
                   "choose what is registered), raise MOECACHE_CUDA_PIN_BUDGET where RAM allows, or unset "
                   "GGML_OP_OFFLOAD_MIN_BATCH";
        case MissPath::StagedRegisterFailed:
        case MissPath::SlowLink:
            return "decode with GGML_OP_OFFLOAD_MIN_BATCH=1 is slower than without moecache: unset "
                   "GGML_OP_OFFLOAD_MIN_BATCH (the pool still serves prompts)";
    }
    return "";
}

const char* to_string(Type t) {
    switch (t) {
        case Type::Hello: return "Hello";
        case Type::RegisterModel: return "RegisterModel";
        case Type::DescribeMapping: return "DescribeMapping";
        case Type::TelemetrySetup: return "TelemetrySetup";
        case Type::Goodbye: return "Goodbye";
        case Type::ExpertPlacement: return "ExpertPlacement";
        case Type::PoolStats: return "PoolStats";
        case Type::Unmapped: return "Unmapped";
        case Type::HelloReply: return "HelloReply";
        case Type::Ok: return "Ok";
        case Type::Failure: return "Failure";
        case Type::ModelRegistered: return "ModelRegistered";
        case Type::Directive: return "Directive";
        case Type::VramPolicy: return "VramPolicy";
    }
    return "unknown";
}

Type type_of(const Body& b) {
    struct V {
        Type operator()(const Hello&) const { return Type::Hello; }
        Type operator()(const RegisterModel&) const { return Type::RegisterModel; }
        Type operator()(const DescribeMapping&) const { return Type::DescribeMapping; }
        Type operator()(const TelemetrySetup&) const { return Type::TelemetrySetup; }
        Type operator()(const Goodbye&) const { return Type::Goodbye; }
        Type operator()(const HelloReply&) const { return Type::HelloReply; }
        Type operator()(const Ok&) const { return Type::Ok; }
        Type operator()(const Failure&) const { return Type::Failure; }
        Type operator()(const ModelRegistered&) const { return Type::ModelRegistered; }
        Type operator()(const Directive&) const { return Type::Directive; }
        Type operator()(const ExpertPlacement&) const { return Type::ExpertPlacement; }
        Type operator()(const PoolStats&) const { return Type::PoolStats; }
        Type operator()(const Unmapped&) const { return Type::Unmapped; }
        Type operator()(const VramPolicy&) const { return Type::VramPolicy; }
    };
    return std::visit(V{}, b);
}

uint32_t descriptors_of(const Body& b) {
    if (const auto* r = std::get_if<RegisterModel>(&b)) return r->files;
    if (std::holds_alternative<TelemetrySetup>(b)) return 1;
    return 0;
}

std::vector<uint8_t> encode(const Message& m) {
    Writer body;
    Out fields(body);
    std::visit([&](const auto& x) { wire(x, fields); }, m.body);
    const auto b = body.take();
    Writer w;
    w.u32(kMagic);
    w.u16(static_cast<uint16_t>(type_of(m.body)));
    w.u16(kVersion);
    w.u32(static_cast<uint32_t>(kHeaderBytes + b.size()));
    w.u32(m.request);
    auto out = w.take();
    out.insert(out.end(), b.begin(), b.end());
    return out;
}

Result<void> send_packet(int socket, std::span<const uint8_t> bytes, std::span<const int> fds) {
    iovec iov{const_cast<uint8_t*>(bytes.data()), bytes.size()};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    std::vector<char> control(CMSG_SPACE(sizeof(int) * std::max<size_t>(fds.size(), 1)));
    if (!fds.empty()) {
        msg.msg_control = control.data();
        msg.msg_controllen = CMSG_SPACE(sizeof(int) * fds.size());
        cmsghdr* c = CMSG_FIRSTHDR(&msg);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
        std::memcpy(CMSG_DATA(c), fds.data(), sizeof(int) * fds.size());
    }
    const ssize_t n = ::sendmsg(socket, &msg, MSG_NOSIGNAL);
    if (n < 0) return fail_errno("sendmsg of {} bytes and {} descriptors", bytes.size(), fds.size());
    if (static_cast<size_t>(n) != bytes.size()) return failf("sendmsg: {} of {} bytes", n, bytes.size());
    return {};
}

Result<Message> decode(std::span<const uint8_t> bytes, size_t descriptors) {
    if (bytes.size() < kHeaderBytes)
        return failf("a packet of {} bytes is shorter than the {}-byte header", bytes.size(), kHeaderBytes);
    if (bytes.size() > kMaxMessageBytes)
        return failf("a packet of {} bytes is longer than the {} bytes a message may have", bytes.size(),
                     kMaxMessageBytes);
    Reader r(bytes, 0);
    const uint32_t magic = r.u32("the magic");
    if (magic != kMagic)
        return failf("at byte 0: the magic is {:#010x}, not {:#010x} (\"MCP1\"): not a moecache message", magic,
                     kMagic);
    const uint16_t type = r.u16("the type");
    const uint16_t version = r.u16("the version");
    const uint32_t length = r.u32("the length");
    Message m;
    m.request = r.u32("the request number");
    if (version != kVersion)
        return failf("at byte 6: protocol version {}; this end speaks version {}", version, kVersion);
    if (length != bytes.size())
        return failf("at byte 8: the header says {} bytes but the packet has {} (truncated or padded)", length,
                     bytes.size());
    auto expect_fds = [&](size_t n, const char* t) -> Result<void> {
        if (descriptors != n)
            return failf("a {} message came with {} descriptor(s); it takes {}", t, descriptors, n);
        return {};
    };
    // Each message's fields from the wire table, then the descriptors it takes (a RegisterModel's
    // count only once its fields were read).
    const auto body = [&]<class T>(T x) -> Result<void> {
        const char* name = to_string(type_of(Body{x}));
        In in(r, name);
        wire(x, in);
        const bool counted = std::is_same_v<T, RegisterModel> || std::is_same_v<T, TelemetrySetup>;
        if (!counted || r.error().empty()) MC_TRY_VOID(expect_fds(descriptors_of(Body{x}), name));
        m.body = std::move(x);
        return {};
    };
    Result<void> got;
    switch (static_cast<Type>(type)) {
        case Type::Hello:
            got = body(Hello{});
            break;
        case Type::RegisterModel:
            got = body(RegisterModel{});
            break;
        case Type::DescribeMapping:
            got = body(DescribeMapping{});
            break;
        case Type::TelemetrySetup:
            got = body(TelemetrySetup{});
            break;
        case Type::Goodbye:
            got = body(Goodbye{});
            break;
        case Type::HelloReply:
            got = body(HelloReply{});
            break;
        case Type::Ok:
            got = body(Ok{});
            break;
        case Type::Failure:
            got = body(Failure{});
            break;
        case Type::ModelRegistered:
            got = body(ModelRegistered{});
            break;
        case Type::Directive:
            got = body(Directive{});
            break;
        case Type::ExpertPlacement:
            got = body(ExpertPlacement{});
            break;
        case Type::PoolStats:
            got = body(PoolStats{});
            break;
        case Type::Unmapped:
            got = body(Unmapped{});
            break;
        case Type::VramPolicy:
            got = body(VramPolicy{});
            break;
        default:
            return failf("at byte 4: message type {} is not one this end knows", type);
    }
    if (!got) return tl::unexpected(got.error());
    if (!r.error().empty()) return failf("{}", r.error());
    if (!r.at_end())
        return failf("at byte {}: {} bytes follow the end of a {} message", r.at(), bytes.size() - r.at(),
                     to_string(static_cast<Type>(type)));
    return m;
}

}  // namespace moecache::protocol
