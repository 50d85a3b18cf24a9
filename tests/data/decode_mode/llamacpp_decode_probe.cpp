// llama.cpp's logits at every position of one prompt, computed as a server decodes: one llama_decode per
// token (teacher-forced: the prompt's own next id, not the sampled one), each reading the cache the earlier
// ones wrote; or the whole prompt in one llama_decode, for comparison. For llamacpp_decode.json (README.md
// here; not built by the project). CPU only, 2 threads, llama.cpp's default context settings otherwise (f16
// KV cache, flash attention auto), empty cache, no BOS: the ids as given.
// Writes int32 {T, V}, then float32 logits [T, V]. make_llamacpp_decode.py runs it on every fixture.
//
//   L=LLAMA_CPP_DIR; g++ -O1 -std=c++17 llamacpp_decode_probe.cpp -I$L/include -I$L/ggml/include \
//     -L$L/build/bin -lllama -lggml -lggml-base -Wl,-rpath,$L/build/bin -o decode_probe
//   ./decode_probe MODEL.gguf OUT.bin MODE id0 id1 ...      MODE: decode | prompt
#include "llama.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

static void log_cb(ggml_log_level level, const char * text, void *) {
    if (level >= GGML_LOG_LEVEL_WARN || getenv("DECODE_PROBE_VERBOSE")) {
        fputs(text, stderr);
    }
}

int main(int argc, char ** argv) {
    if (argc < 5) {
        fprintf(stderr, "usage: %s MODEL.gguf OUT.bin decode|prompt id0 id1 ...\n", argv[0]);
        return 2;
    }
    const std::string mode = argv[3];
    if (mode != "decode" && mode != "prompt") {
        fprintf(stderr, "unknown mode %s\n", argv[3]);
        return 2;
    }
    std::vector<llama_token> ids;
    for (int i = 4; i < argc; ++i) {
        ids.push_back(atoi(argv[i]));
    }
    const int T = (int) ids.size();

    llama_log_set(log_cb, nullptr);
    llama_backend_init();
    auto mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) {
        fprintf(stderr, "model load failed\n");
        return 1;
    }
    auto cp = llama_context_default_params();
    cp.n_ctx = 256; cp.n_batch = 256; cp.n_ubatch = 256; cp.n_threads = 2; cp.n_threads_batch = 2;
    llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) {
        fprintf(stderr, "context creation refused\n");
        return 3;
    }
    const int V = llama_vocab_n_tokens(llama_model_get_vocab(model));
    std::vector<float> logits(size_t(T) * V);
    const int per_call = mode == "decode" ? 1 : T;
    llama_batch b = llama_batch_init(per_call, 0, 1);
    for (int start = 0; start < T; start += per_call) {
        for (int i = 0; i < per_call; ++i) {
            b.token[i] = ids[start + i];
            b.pos[i] = start + i;
            b.n_seq_id[i] = 1;
            b.seq_id[i][0] = 0;
            b.logits[i] = 1;
        }
        b.n_tokens = per_call;
        if (llama_decode(ctx, b) != 0) {
            fprintf(stderr, "llama_decode failed at position %d\n", start);
            return 1;
        }
        for (int i = 0; i < per_call; ++i) {
            memcpy(logits.data() + size_t(start + i) * V, llama_get_logits_ith(ctx, i), sizeof(float) * V);
        }
    }
    FILE * f = fopen(argv[2], "wb");
    const int hdr[2] = { T, V };
    fwrite(hdr, sizeof(int), 2, f);
    fwrite(logits.data(), sizeof(float), logits.size(), f);
    fclose(f);
    llama_batch_free(b);
    llama_free(ctx);
    llama_model_free(model);
    return 0;
}
