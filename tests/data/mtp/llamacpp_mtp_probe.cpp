// llama.cpp's own MTP draft logits for one prompt, for the cross-check in README.md (not built by
// the project). One main decode with h_nextn out, then an MTP context (LLAMA_CONTEXT_TYPE_MTP) on rows:
//   mode 0: (t[i+1], h[i]) at position i,   i = 0..T-2   (references.npz's definition)
//   mode 1: (t[k], h[k-1]) at position k,   k = 0..T-1, h[-1] = 0   (what common/speculative.cpp feeds)
//   mode 2: (t[i+1], h[i]) at position i+1, i = 0..T-2
// Writes int32 {T, D, V, rows}, then float32 h_nextn [T, D], main logits [T, V], draft logits [rows, V].
//
//   L=LLAMA_CPP_DIR; g++ -O1 -std=c++17 llamacpp_mtp_probe.cpp -I$L/include -I$L/src -I$L/ggml/include \
//     -L$L/build/bin -lllama -lggml -lggml-base -Wl,-rpath,$L/build/bin -o probe
//   ./probe MODEL.gguf OUT.bin MODE id0 id1 ...
#include "llama.h"
#include "llama-ext.h"

#include <cstdio>
#include <cstdlib>
#include <vector>

static void decode(llama_context * ctx, const std::vector<llama_token> & tok, const std::vector<llama_pos> & pos,
                   const std::vector<const float *> & h, int n_embd) {
    llama_batch_ext * b = llama_batch_ext_init(ctx);
    for (size_t i = 0; i < tok.size(); ++i) {
        const int idx = llama_batch_ext_add_token(b, 0, tok[i]);
        llama_batch_ext_set_pos(b, idx, &pos[i]);
        if (!h.empty()) {
            llama_batch_ext_set_embd_token(b, idx, { h[i], 1, (size_t) n_embd });
        }
        llama_batch_ext_set_output_logits(b, idx, true);
    }
    if (llama_process(ctx, LLAMA_PROCESS_TYPE_DECODE, b) != 0) {
        fprintf(stderr, "llama_process failed\n");
        exit(1);
    }
    llama_batch_ext_free(b);
}

int main(int argc, char ** argv) {
    if (argc < 5) {
        fprintf(stderr, "usage: %s MODEL.gguf OUT.bin MODE id0 id1 ...\n", argv[0]);
        return 2;
    }
    const char * path = argv[1];
    const char * out  = argv[2];
    const int    mode = atoi(argv[3]);
    std::vector<llama_token> ids;
    for (int i = 4; i < argc; ++i) {
        ids.push_back(atoi(argv[i]));
    }
    const int T = (int) ids.size();

    llama_backend_init();
    auto mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    mp.load_mtp     = true;
    llama_model * model = llama_model_load_from_file(path, mp);

    // f32 KV cache, no flash attention, one ubatch: the closest llama.cpp comes to a float32 reference
    auto cp = llama_context_default_params();
    cp.n_ctx = 256; cp.n_batch = 256; cp.n_ubatch = 256; cp.n_threads = 2; cp.n_threads_batch = 2;
    cp.type_k = GGML_TYPE_F32; cp.type_v = GGML_TYPE_F32; cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
    llama_context * tgt = llama_init_from_model(model, cp);
    llama_set_embeddings_nextn(tgt, true, false);

    const int D = llama_model_n_embd(model);
    const int V = llama_vocab_n_tokens(llama_model_get_vocab(model));
    std::vector<llama_pos> pos(T);
    for (int i = 0; i < T; ++i) {
        pos[i] = i;
    }
    decode(tgt, ids, pos, {}, D);
    const float * h_tgt = llama_get_embeddings_nextn(tgt);
    std::vector<float> h(h_tgt, h_tgt + (size_t) T * D);
    std::vector<float> main_logits;
    for (int i = 0; i < T; ++i) {
        const float * l = llama_get_logits_ith(tgt, i);
        main_logits.insert(main_logits.end(), l, l + V);
    }

    auto cd = cp;
    cd.ctx_type  = LLAMA_CONTEXT_TYPE_MTP;
    cd.ctx_other = tgt;
    llama_context * dft = llama_init_from_model(model, cd);
    llama_set_embeddings_nextn(dft, true, true);

    std::vector<float> zeros(D, 0.0f);
    std::vector<llama_token> tok;
    std::vector<llama_pos> dpos;
    std::vector<const float *> hp;
    for (int k = mode == 1 ? 0 : 1; k < T; ++k) {
        tok.push_back(ids[k]);
        dpos.push_back(mode == 0 ? k - 1 : k);
        hp.push_back(k ? &h[(size_t) (k - 1) * D] : zeros.data());
    }
    decode(dft, tok, dpos, hp, D);

    FILE * f = fopen(out, "wb");
    const int hdr[4] = { T, D, V, (int) tok.size() };
    fwrite(hdr, sizeof(int), 4, f);
    fwrite(h.data(), sizeof(float), h.size(), f);
    fwrite(main_logits.data(), sizeof(float), main_logits.size(), f);
    for (size_t i = 0; i < tok.size(); ++i) {
        fwrite(llama_get_logits_ith(dft, (int) i), sizeof(float), V, f);
    }
    fclose(f);
    llama_free(dft);
    llama_free(tgt);
    llama_model_free(model);
    return 0;
}
