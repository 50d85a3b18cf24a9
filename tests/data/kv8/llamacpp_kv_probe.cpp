// llama.cpp's logits at every position of one prompt, with a chosen KV-cache type and flash-attention
// setting, for llamacpp_kv.json (README.md here; not built by the project). CPU only, 2 threads, the
// whole prompt in one llama_decode and one ubatch, from an empty cache, no BOS: the ids as given.
// Writes int32 {T, V}, then float32 logits [T, V]. Prints "kv_probe: flash_attn=<on|off>" (what the
// context resolved AUTO to) on stderr. make_llamacpp_kv.py runs it on every fixture.
//
//   L=LLAMA_CPP_DIR; g++ -O1 -std=c++17 llamacpp_kv_probe.cpp -I$L/include -I$L/ggml/include \
//     -L$L/build/bin -lllama -lggml -lggml-base -Wl,-rpath,$L/build/bin -o kv_probe
//   ./kv_probe MODEL.gguf OUT.bin TYPE_K TYPE_V FA id0 id1 ...
//     TYPE_K, TYPE_V: f32 | f16 | bf16 | q8_0        FA: on | off | auto
#include "llama.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

static ggml_type parse_type(const char * s) {
    const std::string t = s;
    if (t == "f32")  { return GGML_TYPE_F32; }
    if (t == "f16")  { return GGML_TYPE_F16; }
    if (t == "bf16") { return GGML_TYPE_BF16; }
    if (t == "q8_0") { return GGML_TYPE_Q8_0; }
    fprintf(stderr, "unknown KV type %s\n", s);
    exit(2);
}

static llama_flash_attn_type parse_fa(const char * s) {
    const std::string t = s;
    if (t == "on")   { return LLAMA_FLASH_ATTN_TYPE_ENABLED; }
    if (t == "off")  { return LLAMA_FLASH_ATTN_TYPE_DISABLED; }
    if (t == "auto") { return LLAMA_FLASH_ATTN_TYPE_AUTO; }
    fprintf(stderr, "unknown flash-attention setting %s\n", s);
    exit(2);
}

// libllama has no getter for the resolved flash-attention flag; its context log names it.
static int g_fa_resolved = -1;

static void log_cb(ggml_log_level level, const char * text, void *) {
    if (strstr(text, "Flash Attention enabled"))  { g_fa_resolved = 1; }
    if (strstr(text, "Flash Attention not supported")) { g_fa_resolved = 0; }
    if (strstr(text, "flash_attn") && strstr(text, "= enabled"))  { g_fa_resolved = 1; }
    if (strstr(text, "flash_attn") && strstr(text, "= disabled")) { g_fa_resolved = 0; }
    if (level >= GGML_LOG_LEVEL_WARN || getenv("KV_PROBE_VERBOSE")) {
        fputs(text, stderr);
    }
}

int main(int argc, char ** argv) {
    if (argc < 7) {
        fprintf(stderr, "usage: %s MODEL.gguf OUT.bin TYPE_K TYPE_V FA id0 id1 ...\n", argv[0]);
        return 2;
    }
    const char * path = argv[1];
    const char * out  = argv[2];
    std::vector<llama_token> ids;
    for (int i = 6; i < argc; ++i) {
        ids.push_back(atoi(argv[i]));
    }
    const int T = (int) ids.size();

    llama_log_set(log_cb, nullptr);
    llama_backend_init();
    auto mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    llama_model * model = llama_model_load_from_file(path, mp);
    if (!model) {
        fprintf(stderr, "model load failed\n");
        return 1;
    }

    auto cp = llama_context_default_params();
    cp.n_ctx = 256; cp.n_batch = 256; cp.n_ubatch = 256; cp.n_threads = 2; cp.n_threads_batch = 2;
    cp.type_k = parse_type(argv[3]);
    cp.type_v = parse_type(argv[4]);
    cp.flash_attn_type = parse_fa(argv[5]);
    if (cp.flash_attn_type != LLAMA_FLASH_ATTN_TYPE_AUTO) {
        g_fa_resolved = cp.flash_attn_type == LLAMA_FLASH_ATTN_TYPE_ENABLED;
    }
    llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) {
        fprintf(stderr, "context creation refused\n");
        return 3;
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
    fprintf(stderr, "kv_probe: flash_attn=%s\n", g_fa_resolved == 1 ? "on" : g_fa_resolved == 0 ? "off" : "unknown");

    const int V = llama_vocab_n_tokens(llama_model_get_vocab(model));
    FILE * f = fopen(out, "wb");
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
