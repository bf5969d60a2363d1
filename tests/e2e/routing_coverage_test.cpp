// Routing coverage of generated models, measured from a real llama.cpp run (work in progress).
#include <gtest/gtest.h>
