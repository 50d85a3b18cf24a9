// llama.cpp's logits at every position of one prompt, with or without one LoRA adapter at scale 1, for
// the cross-check in README.md (not built by the project). CPU only, 2 threads, F32 KV cache, no flash
// attention, the whole prompt in one llama_decode and one ubatch, from an empty cache, no BOS: the ids
// as given. Writes int32 {T, V}, then float32 logits [T, V]. make_lora_fixtures.py --probe runs it.
//
//   L=LLAMA_CPP_DIR; g++ -O1 -std=c++17 llamacpp_lora_probe.cpp -I$L/include -I$L/ggml/include \
//     -L$L/build/bin -lllama -lggml -lggml-base -Wl,-rpath,$L/build/bin -o llamacpp_lora_probe
//   ./llamacpp_lora_probe MODEL.gguf OUT.bin LORA.gguf|- id0 id1 ...
#include "llama.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

static void log_cb(ggml_log_level level, const char * text, void *) {
    if (level >= GGML_LOG_LEVEL_WARN || getenv("LORA_PROBE_VERBOSE")) {
        fputs(text, stderr);
    }
}

int main(int argc, char ** argv) {
    if (argc < 5) {
        fprintf(stderr, "usage: %s MODEL.gguf OUT.bin LORA.gguf|- id0 id1 ...\n", argv[0]);
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
    // F32 cache, no flash attention: with either default (F16 cache, CPU flash attention on) llama.cpp
    // is ~2e-3 max-abs from transformers' float32 logits; with neither, ~2e-6.
    cp.type_k = GGML_TYPE_F32;
    cp.type_v = GGML_TYPE_F32;
    cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
    llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) {
        fprintf(stderr, "context creation refused\n");
        return 3;
    }
    if (strcmp(argv[3], "-") != 0) {
        llama_adapter_lora * lora = llama_adapter_lora_init(model, argv[3]);
        if (!lora) {
            fprintf(stderr, "adapter load failed\n");
            return 4;
        }
        float scale = 1.0f;
        if (llama_set_adapters_lora(ctx, &lora, 1, &scale) != 0) {
            fprintf(stderr, "adapter not set\n");
            return 5;
        }
    }

    llama_batch b = llama_batch_init(T, 0, 1);
    for (int i = 0; i < T; ++i) {
        b.token[i] = ids[i];
        b.pos[i] = i;
        b.n_seq_id[i] = 1;
        b.seq_id[i][0] = 0;
        b.logits[i] = 1;
    }
    b.n_tokens = T;
    if (llama_decode(ctx, b) != 0) {
        fprintf(stderr, "llama_decode failed\n");
        return 1;
    }

    const int V = llama_vocab_n_tokens(llama_model_get_vocab(model));
    FILE * f = fopen(argv[2], "wb");
    const int hdr[2] = { T, V };
    fwrite(hdr, sizeof(int), 2, f);
    for (int i = 0; i < T; ++i) {
        fwrite(llama_get_logits_ith(ctx, i), sizeof(float), V, f);
    }
    fclose(f);
    llama_batch_free(b);
    llama_free(ctx);
    llama_model_free(model);
    return 0;
}
