/* Generate tokens from a generation library built by cuvil (cuvil.yaml `generate:`), no Python.

   ./generate [-n NEW] [-t TEMPERATURE] [-k TOP_K] [-p TOP_P] [-s SEED] TOKEN...

   Prefills the prompt token ids, then appends NEW tokens (default 32), greedy unless -t > 0, and
   prints them space-separated on one line. The library's header is MODEL_HEADER (the Makefile
   sets it); its symbols carry the default prefix cuvil_. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include MODEL_HEADER

int main(int argc, char** argv) {
    long new_tokens = 32;
    cuvil_sampling sampling = {0.0f, 0, 1.0f};
    uint64_t rng = 0;
    int64_t prompt[4096];
    int64_t n = 0;
    for (int i = 1; i < argc; i++) {
        if (i + 1 < argc && argv[i][0] == '-' && argv[i][1] && !argv[i][2] && strchr("ntkps", argv[i][1])) {
            char flag = argv[i][1];
            const char* value = argv[++i];
            if (flag == 'n') new_tokens = strtol(value, NULL, 10);
            else if (flag == 't') sampling.temperature = strtof(value, NULL);
            else if (flag == 'k') sampling.top_k = (int32_t)strtol(value, NULL, 10);
            else if (flag == 'p') sampling.top_p = strtof(value, NULL);
            else rng = strtoull(value, NULL, 10);
        } else if (n < 4096) {
            prompt[n++] = strtoll(argv[i], NULL, 10);
        }
    }
    if (n == 0) {
        fprintf(stderr, "usage: %s [-n NEW] [-t TEMPERATURE] [-k TOP_K] [-p TOP_P] [-s SEED] TOKEN...\n", argv[0]);
        return 2;
    }
    cuvil_session* s = cuvil_session_create();
    if (!s) { fprintf(stderr, "session_create: %s\n", cuvil_session_error(NULL)); return 1; }
    float* logits = malloc(sizeof(float) * (size_t)cuvil_vocab_size());
    int rc = logits ? cuvil_session_prefill(s, prompt, n, logits) : CUVIL_ERR_OUT_OF_MEMORY;
    for (long produced = 0; rc == 0 && produced < new_tokens; produced++) {
        int64_t token = cuvil_sample(logits, &sampling, &rng);
        printf(produced ? " %lld" : "%lld", (long long)token);
        if (produced + 1 < new_tokens) rc = cuvil_session_decode(s, token, logits);
    }
    printf("\n");
    if (rc != 0) fprintf(stderr, "error %d: %s\n", rc, cuvil_session_error(s));
    free(logits);
    cuvil_session_destroy(s);
    return rc == 0 ? 0 : 1;
}
