// Small, fast, seedable generators for synthetic weights (xoshiro256**, seeded by splitmix64).
#pragma once

#include <cmath>
#include <cstdint>

namespace moecache::mkmodel {

inline uint64_t splitmix64(uint64_t& x) {
    uint64_t z = (x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

// Mixes several values into one seed, so every (tensor, row) gets its own stream.
inline uint64_t seed_of(uint64_t a, uint64_t b, uint64_t c = 0) {
    uint64_t x = a;
    uint64_t s = splitmix64(x);
    x = s ^ b;
    s = splitmix64(x);
    x = s ^ c;
    return splitmix64(x);
}

class Rng {
public:
    explicit Rng(uint64_t seed) {
        for (auto& v : s_) v = splitmix64(seed);
    }
    uint64_t next() {
        const uint64_t result = rotl(s_[1] * 5, 7) * 9;
        const uint64_t t = s_[1] << 17;
        s_[2] ^= s_[0];
        s_[3] ^= s_[1];
        s_[1] ^= s_[2];
        s_[0] ^= s_[3];
        s_[2] ^= t;
        s_[3] = rotl(s_[3], 45);
        return result;
    }
    double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }  // [0, 1)
    double normal() {  // Box-Muller; one value per call is enough here
        double u1 = uniform();
        while (u1 <= 0.0) u1 = uniform();
        return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * uniform());
    }

private:
    static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
    uint64_t s_[4];
};

}  // namespace moecache::mkmodel
