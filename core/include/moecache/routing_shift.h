// What is left of what was learnt of a model's routing when the routing shifts (a topic, a
// language, another client: daemon/shift_detector.h sees it). The daemon cuts its heat to this
// share, and every VRAM pool of the model (the hook's, the ggml backend's: ExpertHeat::forget) its
// own use counts, told by a Shifted directive: one rule on both sides.
#pragma once

namespace moecache {

// A hundredth, so that the new hot set ranks first within tens of tokens instead of the half-life's
// thousands (moecache-sim's topic-shift preset, 12 layers x 3000 tokens, 25 % of RAM: 64.9 % held
// without a cut, 69.6 % with a cut to a tenth, 71.2 % to a hundredth; 71.6 % counting from zero at
// the very token of the shift). The pools' counts cut the same way: topic-shift VRAM 10/25/50 %,
// with the daemon's 128-event shift window, 52.1/71.0/85.2 -> 52.8/71.6/85.5 (their counts halve
// only every ~1000 tokens, and the part of a pool the daemon does not direct held the old hot set).
inline constexpr double kKeepAtShift = 0.01;

}  // namespace moecache
