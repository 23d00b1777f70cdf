// Runs the example model (tiny_cnn, built by `cuvil build -f cuvil.yaml.example`) once on an
// input of zeros and prints its output: a C++ program linking a cuvil library through its
// CMake package (CMakeLists.txt) or its pkg-config file (Makefile).
#include "tiny_cnn.h"  // symbol_prefix: tiny_cnn_

#include <cstdio>
#include <vector>

int main() {
    std::vector<float> input(1 * 3 * 32 * 32, 0.0f), probs(1 * 10);
    const void* inputs[] = {input.data()};
    void* outputs[] = {probs.data()};
    tiny_cnn_session* session = tiny_cnn_session_create();
    if (session == nullptr) {
        std::fprintf(stderr, "error: %s\n", tiny_cnn_session_error(nullptr));
        return 1;
    }
    if (tiny_cnn_session_run(session, inputs, outputs) != TINY_CNN_OK) {
        std::fprintf(stderr, "error: %s\n", tiny_cnn_session_error(session));
        tiny_cnn_session_destroy(session);
        return 1;
    }
    std::printf("probs:");
    for (float p : probs) std::printf(" %.9g", p);
    std::printf("\n");
    tiny_cnn_session_destroy(session);
    return 0;
}
