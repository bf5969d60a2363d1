// libFuzzer target for the daemon's message decoder: whatever the bytes and the descriptor count
// (the first byte), a packet is decoded or refused with an error; an accepted one re-encodes to
// the same bytes. Never a crash, a hang or undefined behaviour.
//   moecache-protocol-fuzz CORPUS_DIR      (seeds: moecache-protocol-fuzz --seeds DIR)
#include "moecache/client/protocol.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

using namespace moecache::protocol;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    if (size == 0) return 0;
    const size_t fds = data[0] % 4 == 3 ? 253 : data[0] % 4;
    auto m = decode({data + 1, size - 1}, fds);
    if (m) {
        const auto again = encode(*m);
        if (again.size() != size - 1 || std::memcmp(again.data(), data + 1, size - 1) != 0) std::abort();
        if (descriptors_of(m->body) != fds) std::abort();
    }
    return 0;
}

// Seeds: one packet of each type, with the right descriptor count, written as files to argv[2].
extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) {
    if (*argc == 3 && std::strcmp((*argv)[1], "--seeds") == 0) {
        const std::string dir = (*argv)[2];
        const Message seeds[] = {
            {1, Hello{1, 1, "llama-server"}}, {2, RegisterModel{3}},   {3, DescribeMapping{7, 2, 0x7f0000000000, 1u << 30, 4096}},
            {4, TelemetrySetup{1u << 20}},    {5, Goodbye{}},          {1, HelloReply{1, 42}},
            {2, Ok{}},                        {3, Failure{13, "no"}},  {4, ModelRegistered{9, 61, 256, 5}},
            {0, Directive{Action::Unlock, 9, 12, 255}},
            {0, VramPolicy{3, 1ull << 30, true, false}}, {0, VramPolicy{kAllDevices, kNoPoolLimit, false, true}},
        };
        int i = 0;
        for (const auto& m : seeds) {
            auto bytes = encode(m);
            bytes.insert(bytes.begin(), static_cast<uint8_t>(descriptors_of(m.body)));
            const std::string path = dir + "/seed-" + std::to_string(i++);
            FILE* f = std::fopen(path.c_str(), "wb");
            if (!f || std::fwrite(bytes.data(), 1, bytes.size(), f) != bytes.size()) std::abort();
            std::fclose(f);
        }
        std::exit(0);
    }
    return 0;
}
