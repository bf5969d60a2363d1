#include "moecache/client/protocol.h"

#include <sys/socket.h>

#include <algorithm>
#include <cstring>

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
    std::visit(
        [&](const auto& x) {
            using T = std::decay_t<decltype(x)>;
            if constexpr (std::is_same_v<T, Hello>) {
                body.u16(x.min_version);
                body.u16(x.max_version);
                body.str(x.name.substr(0, kMaxName));
            } else if constexpr (std::is_same_v<T, RegisterModel>) {
                body.u32(x.files);
            } else if constexpr (std::is_same_v<T, DescribeMapping>) {
                body.u32(x.model);
                body.u32(x.file);
                body.u64(x.address);
                body.u64(x.length);
                body.u64(x.file_offset);
            } else if constexpr (std::is_same_v<T, TelemetrySetup>) {
                body.u32(x.ring_bytes);
            } else if constexpr (std::is_same_v<T, HelloReply>) {
                body.u16(x.version);
                body.u32(x.client_id);
            } else if constexpr (std::is_same_v<T, Failure>) {
                body.u32(static_cast<uint32_t>(x.errnum));
                std::string text = x.text.substr(0, kMaxErrorText);
                for (char& c : text)
                    if (c < 0x20 || c > 0x7e) c = '?';
                body.str(text);
            } else if constexpr (std::is_same_v<T, ModelRegistered>) {
                body.u32(x.model);
                body.u32(x.layers);
                body.u32(x.experts);
                body.u32(x.files);
            } else if constexpr (std::is_same_v<T, Directive>) {
                body.u8(static_cast<uint8_t>(x.action));
                body.u32(x.model);
                body.u32(x.block);
                body.u32(x.expert);
            } else if constexpr (std::is_same_v<T, ExpertPlacement>) {
                body.u32(x.model);
                body.u32(x.block);
                body.u32(x.expert);
                body.u32(x.device);
            } else if constexpr (std::is_same_v<T, PoolStats>) {
                body.u32(x.device);
                body.u64(x.hits);
                body.u64(x.misses);
                body.u64(x.hit_bytes);
                body.u64(x.miss_bytes);
                body.u64(x.pool_bytes);
                if (x.miss_path != MissPath::Unknown) body.u8(static_cast<uint8_t>(x.miss_path));
            } else if constexpr (std::is_same_v<T, Unmapped>) {
                body.u64(x.copies);
                body.u64(x.bytes);
                body.u8(x.no_model ? 1 : 0);
            } else if constexpr (std::is_same_v<T, VramPolicy>) {
                body.u32(x.device);
                body.u64(x.pool_bytes);
                body.u8(x.one_place ? 1 : 0);
                if (x.recency) body.u8(1);  // present only when on: one encoding per message
            }
        },
        m.body);
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
    switch (static_cast<Type>(type)) {
        case Type::Hello: {
            Hello h;
            h.min_version = r.u16("Hello.min_version");
            h.max_version = r.u16("Hello.max_version");
            h.name = r.str("Hello.name", kMaxName);
            if (r.error().empty() && h.min_version > h.max_version)
                r.fail(fmt::format("at byte {}: Hello asks for versions {} to {}, an empty range", kHeaderBytes,
                                   h.min_version, h.max_version));
            MC_TRY_VOID(expect_fds(0, "Hello"));
            m.body = h;
            break;
        }
        case Type::RegisterModel: {
            RegisterModel x;
            x.files = r.u32("RegisterModel.files");
            if (r.error().empty() && (x.files == 0 || x.files > kMaxModelFiles))
                r.fail(fmt::format("at byte {}: RegisterModel names {} files; a model has 1 to {}", kHeaderBytes,
                                   x.files, kMaxModelFiles));
            if (r.error().empty()) MC_TRY_VOID(expect_fds(x.files, "RegisterModel"));
            m.body = x;
            break;
        }
        case Type::DescribeMapping: {
            DescribeMapping x;
            x.model = r.u32("DescribeMapping.model");
            x.file = r.u32("DescribeMapping.file");
            x.address = r.u64("DescribeMapping.address");
            x.length = r.u64("DescribeMapping.length");
            x.file_offset = r.u64("DescribeMapping.file_offset");
            if (r.error().empty() && (x.length == 0 || x.address + x.length < x.address ||
                                      x.file_offset + x.length < x.file_offset))
                r.fail(fmt::format("at byte {}: DescribeMapping of {} bytes at {:#x} (file offset {}) is empty or "
                                   "wraps around",
                                   kHeaderBytes + 8, x.length, x.address, x.file_offset));
            MC_TRY_VOID(expect_fds(0, "DescribeMapping"));
            m.body = x;
            break;
        }
        case Type::TelemetrySetup: {
            TelemetrySetup x;
            x.ring_bytes = r.u32("TelemetrySetup.ring_bytes");
            if (r.error().empty() && (x.ring_bytes < kMinRingBytes || x.ring_bytes > kMaxRingBytes))
                r.fail(fmt::format("at byte {}: a telemetry ring of {} bytes; it must be {} to {}", kHeaderBytes,
                                   x.ring_bytes, kMinRingBytes, kMaxRingBytes));
            if (r.error().empty()) MC_TRY_VOID(expect_fds(1, "TelemetrySetup"));
            m.body = x;
            break;
        }
        case Type::Goodbye:
            MC_TRY_VOID(expect_fds(0, "Goodbye"));
            m.body = Goodbye{};
            break;
        case Type::HelloReply: {
            HelloReply x;
            x.version = r.u16("HelloReply.version");
            x.client_id = r.u32("HelloReply.client_id");
            MC_TRY_VOID(expect_fds(0, "HelloReply"));
            m.body = x;
            break;
        }
        case Type::Ok:
            MC_TRY_VOID(expect_fds(0, "Ok"));
            m.body = Ok{};
            break;
        case Type::Failure: {
            Failure x;
            x.errnum = static_cast<int32_t>(r.u32("Failure.errnum"));
            x.text = r.str("Failure.text", kMaxErrorText);
            MC_TRY_VOID(expect_fds(0, "Failure"));
            m.body = x;
            break;
        }
        case Type::ModelRegistered: {
            ModelRegistered x;
            x.model = r.u32("ModelRegistered.model");
            x.layers = r.u32("ModelRegistered.layers");
            x.experts = r.u32("ModelRegistered.experts");
            x.files = r.u32("ModelRegistered.files");
            MC_TRY_VOID(expect_fds(0, "ModelRegistered"));
            m.body = x;
            break;
        }
        case Type::Directive: {
            Directive x;
            const uint8_t a = r.u8("Directive.action");
            if (r.error().empty() && (a < 1 || a > 5))
                r.fail(fmt::format("at byte {}: Directive action {} is not one of 1 (promote) .. 5 (unpromote)",
                                   kHeaderBytes, a));
            x.action = static_cast<Action>(a);
            x.model = r.u32("Directive.model");
            x.block = r.u32("Directive.block");
            x.expert = r.u32("Directive.expert");
            MC_TRY_VOID(expect_fds(0, "Directive"));
            m.body = x;
            break;
        }
        case Type::ExpertPlacement: {
            ExpertPlacement x;
            x.model = r.u32("ExpertPlacement.model");
            x.block = r.u32("ExpertPlacement.block");
            x.expert = r.u32("ExpertPlacement.expert");
            x.device = r.u32("ExpertPlacement.device");
            MC_TRY_VOID(expect_fds(0, "ExpertPlacement"));
            m.body = x;
            break;
        }
        case Type::PoolStats: {
            PoolStats x;
            x.device = r.u32("PoolStats.device");
            if (r.error().empty() && x.device >= kMaxPoolDevices)
                r.fail(fmt::format("at byte {}: PoolStats device {} is not below {}", kHeaderBytes, x.device, kMaxPoolDevices));
            x.hits = r.u64("PoolStats.hits");
            x.misses = r.u64("PoolStats.misses");
            x.hit_bytes = r.u64("PoolStats.hit_bytes");
            x.miss_bytes = r.u64("PoolStats.miss_bytes");
            x.pool_bytes = r.u64("PoolStats.pool_bytes");
            if (r.more()) {
                const uint8_t path = r.u8("PoolStats.miss_path");
                if (r.error().empty() && (path == 0 || path > kLastMissPath))
                    r.fail(fmt::format("at byte {}: PoolStats miss_path is {}, not 1 .. {} (the byte is there only when known)",
                                       kHeaderBytes + 44, path, kLastMissPath));
                x.miss_path = static_cast<MissPath>(path);
            }
            MC_TRY_VOID(expect_fds(0, "PoolStats"));
            m.body = x;
            break;
        }
        case Type::Unmapped: {
            Unmapped x;
            x.copies = r.u64("Unmapped.copies");
            x.bytes = r.u64("Unmapped.bytes");
            const uint8_t none = r.u8("Unmapped.no_model");
            if (r.error().empty() && none > 1)
                r.fail(fmt::format("at byte {}: Unmapped no_model is {}, not 0 or 1", kHeaderBytes + 16, none));
            x.no_model = none == 1;
            MC_TRY_VOID(expect_fds(0, "Unmapped"));
            m.body = x;
            break;
        }
        case Type::VramPolicy: {
            VramPolicy x;
            x.device = r.u32("VramPolicy.device");
            x.pool_bytes = r.u64("VramPolicy.pool_bytes");
            const uint8_t one = r.u8("VramPolicy.one_place");
            if (r.error().empty() && one > 1)
                r.fail(fmt::format("at byte {}: VramPolicy one_place is {}, not 0 or 1", kHeaderBytes + 12, one));
            x.one_place = one == 1;
            if (r.more()) {
                const uint8_t rec = r.u8("VramPolicy.recency");
                if (r.error().empty() && rec != 1)
                    r.fail(fmt::format("at byte {}: VramPolicy recency is {}: the byte is there only when it is 1",
                                       kHeaderBytes + 13, rec));
                x.recency = rec == 1;
            }
            MC_TRY_VOID(expect_fds(0, "VramPolicy"));
            m.body = x;
            break;
        }
        default:
            return failf("at byte 4: message type {} is not one this end knows", type);
    }
    if (!r.error().empty()) return failf("{}", r.error());
    if (!r.at_end())
        return failf("at byte {}: {} bytes follow the end of a {} message", r.at(), bytes.size() - r.at(),
                     to_string(static_cast<Type>(type)));
    return m;
}

}  // namespace moecache::protocol
