// Weights repacked at load into 16-row groups, for int8 GEMMs that keep the multiply units busy.
//
// The in-place kernels (dot_*.cpp) read one GGUF row at a time and, per token and 256 values,
// spend more instructions unpacking, scaling and converting than multiplying: at 8-32 tokens (a
// prompt's experts, 16 decode streams) they reach about a third of the int8 dot's peak. A packed
// group lays 16 rows side by side so that one 64-byte register holds 4 values of every row:
// one dpbusd (VNNI) multiplies 16 rows by 4 broadcast activation bytes, the unpack is shared by
// the 16 rows and by a tile of tokens, and the per-sub-block scales apply to 16 rows at once
// (as llama.cpp's repacked "Q4_K x 8" CPU buffers do, with our own layout).
//
// Packed Q4_K, per group of 16 rows and per 256-value super-block (kQ4KX16Bytes bytes):
//   [0, 32)      d     fp16 x 16 rows
//   [32, 64)     dmin  fp16 x 16 rows
//   [64, 192)    sc[s][r]  the 6-bit scale of sub-block s (32 values) of row r
//   [192, 320)   mn[s][r]  its 6-bit min
//   [320, 2368)  qs: register i (0..31) at 320 + 64 i, byte 4 r + j: low nibble value 8 i + j,
//                high nibble value 8 i + 4 + j of row r (j 0..3)
// Same values and same size class as the GGUF (148 bytes a row and super-block against 144).
//
// Packed Q6_K, per group and super-block (kQ6KX16Bytes, the GGUF's 210 a row padded to whole
// cache lines: 212):
//   [0, 32)      d     fp16 x 16 rows
//   [32, 288)    sc[j][r]  the int8 scale of sub-block j (16 values) of row r
//   [288, 3360)  per 32-value sub-block s, 384 bytes at 288 + 384 s (smk.h q6k_x16_lo/hi): the low 4
//                bits of its values as Q4_K's qs (register i = 4 s .. 4 s + 3: values 8 i .. 8 i + 7),
//                then their top 2 bits, 64 bytes per register pair p = 2 s, 2 s + 1 (registers 2p,
//                2p + 1), byte 4 r + j bits 0-1 value 16p + j, 2-3 value 16p + 4 + j, 4-5 value
//                16p + 8 + j, 6-7 16p + 12 + j. One stream a super-block: with the low and top bits
//                in two regions 2 KB apart, the tile read 36 GB/s where Q4_K's read 40-63.
//   [3360, 3392) padding
// Packed Q8_0 (only where dpbusd takes unsigned bytes: AVX-512 VNNI), per group and 32-value block
// (kQ80X16Bytes, the GGUF's 34 bytes a row exactly):
//   [0, 32)      d     fp16 x 16 rows
//   [32, 544)    register i (0..7) at 32 + 64 i, byte 4 r + j: value 4 i + j of row r plus 128, so
//                unsigned; the 128 comes back as 128 times the block's activation sum (Act::s)
// Packed MXFP4, per group and 32-value block (kMxfp4X16Bytes, the GGUF's 17 bytes a row exactly):
//   [0, 16)      the E8M0 scale byte of each row
//   [16, 272)    register i (0..3) at 16 + 64 i, byte 4 r + j: low nibble the e2m1 code of value
//                8 i + j, high nibble of value 8 i + 4 + j, of row r (j 0..3)
// A group's blocks are contiguous; groups follow each other (group stride blocks * bytes).
#include <cmath>

#include "smk.h"

namespace smk {

int packed_bytes(int type) {
    switch (type) {
        case T_Q4_K: return kQ4KX16Bytes;
        case T_Q6_K: return kQ6KX16Bytes;
        case T_Q8_0: return kQ80X16Bytes;
        case T_MXFP4: return kMxfp4X16Bytes;
        default: return 0;
    }
}
int packed_unit(int type) { return type == T_Q8_0 || type == T_MXFP4 ? 32 : 256; }

namespace {

void repack_q4k(const uint8_t* w, size_t wstride, int rows, int k, uint8_t* out) {
    const int nsb = k / 256;
    for (int g = 0; g < rows / kPackRows; ++g) {
        for (int sb = 0; sb < nsb; ++sb) {
            uint8_t* o = out + (size_t(g) * nsb + sb) * kQ4KX16Bytes;
            for (int r = 0; r < kPackRows; ++r) {
                const uint8_t* b = w + size_t(g * kPackRows + r) * wstride + size_t(sb) * 144;
                std::memcpy(o + 2 * r, b, 2);
                std::memcpy(o + 32 + 2 * r, b + 2, 2);
                uint8_t sc[8], mn[8];
                k4_scales(b + 4, sc, mn);
                for (int s = 0; s < 8; ++s) {
                    o[64 + 16 * s + r] = sc[s];
                    o[192 + 16 * s + r] = mn[s];
                }
                // GGUF: byte 32c + l of the quants holds value 64c + l (low nibble), 64c + 32 + l (high)
                const uint8_t* qs = b + 16;
                uint8_t v[256];
                for (int c = 0; c < 4; ++c)
                    for (int l = 0; l < 32; ++l) {
                        v[64 * c + l] = qs[32 * c + l] & 15;
                        v[64 * c + 32 + l] = qs[32 * c + l] >> 4;
                    }
                for (int i = 0; i < 32; ++i)
                    for (int j = 0; j < 4; ++j) o[320 + 64 * i + 4 * r + j] = uint8_t(v[8 * i + j] | v[8 * i + 4 + j] << 4);
            }
        }
    }
}

// Q6_K's 256 unsigned 6-bit values (0..63; the weight is d * sc[v / 16] * (u - 32)).
void q6k_values(const uint8_t* b, uint8_t v[256]) {
    for (int n = 0; n < 2; ++n) {
        const uint8_t* ql = b + 64 * n;
        const uint8_t* qh = b + 128 + 32 * n;
        uint8_t* y = v + 128 * n;
        for (int l = 0; l < 32; ++l) {
            y[l] = uint8_t((ql[l] & 15) | ((qh[l] & 3) << 4));
            y[l + 32] = uint8_t((ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4));
            y[l + 64] = uint8_t((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4));
            y[l + 96] = uint8_t((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4));
        }
    }
}

void repack_q6k(const uint8_t* w, size_t wstride, int rows, int k, uint8_t* out) {
    const int nsb = k / 256;
    for (int g = 0; g < rows / kPackRows; ++g) {
        for (int sb = 0; sb < nsb; ++sb) {
            uint8_t* o = out + (size_t(g) * nsb + sb) * kQ6KX16Bytes;
            std::memset(o + 3360, 0, kQ6KX16Bytes - 3360);
            for (int r = 0; r < kPackRows; ++r) {
                const uint8_t* b = w + size_t(g * kPackRows + r) * wstride + size_t(sb) * 210;
                std::memcpy(o + 2 * r, b + 208, 2);
                for (int j = 0; j < 16; ++j) o[32 + 16 * j + r] = b[192 + j];
                uint8_t v[256];
                q6k_values(b, v);
                for (int i = 0; i < 32; ++i)
                    for (int j = 0; j < 4; ++j)
                        o[q6k_x16_lo(i) + 4 * r + j] = uint8_t((v[8 * i + j] & 15) | (v[8 * i + 4 + j] & 15) << 4);
                for (int p = 0; p < 16; ++p)
                    for (int j = 0; j < 4; ++j)
                        o[q6k_x16_hi(p) + 4 * r + j] = uint8_t(v[16 * p + j] >> 4 | (v[16 * p + 4 + j] >> 4) << 2 |
                                                               (v[16 * p + 8 + j] >> 4) << 4 | (v[16 * p + 12 + j] >> 4) << 6);
            }
        }
    }
}

// The 32-value-block layouts: `row(o, r, src)` writes row r's part of a group's block from its GGUF block.
template <int SrcBytes, int DstBytes, class Row>
void repack_by_block(const uint8_t* w, size_t wstride, int rows, int k, uint8_t* out, Row row) {
    const int nb = k / 32;
    for (int g = 0; g < rows / kPackRows; ++g)
        for (int b = 0; b < nb; ++b)
            for (int r = 0; r < kPackRows; ++r)
                row(out + (size_t(g) * nb + b) * DstBytes, r, w + size_t(g * kPackRows + r) * wstride + size_t(b) * SrcBytes);
}

void repack_q80(const uint8_t* w, size_t wstride, int rows, int k, uint8_t* out) {
    repack_by_block<34, kQ80X16Bytes>(w, wstride, rows, k, out, [](uint8_t* o, int r, const uint8_t* src) {
        std::memcpy(o + 2 * r, src, 2);
        for (int i = 0; i < 8; ++i)
            for (int j = 0; j < 4; ++j) o[32 + 64 * i + 4 * r + j] = uint8_t(int(int8_t(src[2 + 4 * i + j])) + 128);
    });
}

void repack_mxfp4(const uint8_t* w, size_t wstride, int rows, int k, uint8_t* out) {
    repack_by_block<17, kMxfp4X16Bytes>(w, wstride, rows, k, out, [](uint8_t* o, int r, const uint8_t* src) {
        o[r] = src[0];
        uint8_t code[32];  // GGUF: byte l holds value l (low nibble) and value l + 16 (high)
        for (int l = 0; l < 16; ++l) {
            code[l] = src[1 + l] & 15;
            code[l + 16] = src[1 + l] >> 4;
        }
        for (int i = 0; i < 4; ++i)
            for (int j = 0; j < 4; ++j) o[16 + 64 * i + 4 * r + j] = uint8_t(code[8 * i + j] | code[8 * i + 4 + j] << 4);
    });
}

// Portable kernels for packed weights: a lowered ISA (SPLITMOE_KERNELS_ISA, tests) must still run
// weights packed under a better one. Same arithmetic as the SIMD kernels: int32 sums per sub-block
// and token, scaled in float. SbDot gives row r's dot with token A over super-block sb at b.
template <int Bytes, float (*SbDot)(const uint8_t* b, int r, const Act& A, int sb), int Unit = 256>
void packed_scalar(const uint8_t* w, size_t wstride, int r0, int r1, int k, const Act* acts, int m, float* out,
                   size_t ostride) {
    const int nsb = k / Unit;
    for (int g = r0 / kPackRows; g < r1 / kPackRows; ++g)
        for (int t = 0; t < m; ++t)
            for (int r = 0; r < kPackRows; ++r) {
                float acc = 0.f;
                for (int sb = 0; sb < nsb; ++sb) acc += SbDot(w + size_t(g) * wstride + size_t(sb) * Bytes, r, acts[t], sb);
                out[size_t(t) * ostride + size_t(g * kPackRows - r0 + r)] = acc;
            }
}

float q4k_sb_dot(const uint8_t* b, int r, const Act& A, int sb) {
    const float d = ld_fp16(b + 2 * r), dmin = ld_fp16(b + 32 + 2 * r);
    float acc = 0.f;
    for (int s = 0; s < 8; ++s) {
        int32_t isum = 0;
        for (int i = 4 * s; i < 4 * s + 4; ++i)
            for (int j = 0; j < 8; ++j) {
                const uint8_t byte = b[320 + 64 * i + 4 * r + (j & 3)];
                isum += (j < 4 ? byte & 15 : byte >> 4) * A.q[256 * sb + 8 * i + j];
            }
        const int blk = 8 * sb + s;
        acc += float(isum) * (d * float(b[64 + 16 * s + r]) * A.d[blk]) - dmin * float(b[192 + 16 * s + r]) * A.s[blk];
    }
    return acc;
}

float q6k_sb_dot(const uint8_t* b, int r, const Act& A, int sb) {
    const float d = ld_fp16(b + 2 * r);
    float acc = 0.f;
    for (int jb = 0; jb < 16; ++jb) {  // 16-value sub-blocks
        int32_t isum = 0;  // sum of (u - 32) * q (Act::s16 is not filled by every ISA's quantize)
        for (int v = 16 * jb; v < 16 * jb + 16; ++v) {
            const int i = v / 8, j = v % 8, p = v / 16, f = (v % 16) / 4;
            const uint8_t lo = b[q6k_x16_lo(i) + 4 * r + (j & 3)];
            const int u = (j < 4 ? lo & 15 : lo >> 4) | ((b[q6k_x16_hi(p) + 4 * r + (j & 3)] >> (2 * f)) & 3) << 4;
            isum += (u - 32) * A.q[256 * sb + v];
        }
        acc += float(isum) * (d * float(int8_t(b[32 + 16 * jb + r])) * A.d[8 * sb + jb / 2]);
    }
    return acc;
}

float q80_block_dot(const uint8_t* b, int r, const Act& A, int blk) {
    int32_t isum = 0;
    for (int v = 0; v < 32; ++v) isum += (int(b[32 + 64 * (v / 4) + 4 * r + v % 4]) - 128) * A.q[32 * blk + v];
    return float(isum) * (ld_fp16(b + 2 * r) * A.d[blk]);
}

float mxfp4_block_dot(const uint8_t* b, int r, const Act& A, int blk) {
    int32_t isum = 0;
    for (int v = 0; v < 32; ++v) {
        const uint8_t byte = b[16 + 64 * (v / 8) + 4 * r + v % 4];
        isum += kMxfp4[(v % 8 < 4 ? byte : byte >> 4) & 15] * A.q[32 * blk + v];
    }
    return float(isum) * (e8m0_half(b[r]) * A.d[blk]);
}

}  // namespace

void init_packed_scalar(Kernels& K) {
    K.packed[T_Q4_K] = packed_scalar<kQ4KX16Bytes, q4k_sb_dot>;
    K.packed[T_Q6_K] = packed_scalar<kQ6KX16Bytes, q6k_sb_dot>;
    K.packed[T_Q8_0] = packed_scalar<kQ80X16Bytes, q80_block_dot, 32>;
    K.packed[T_MXFP4] = packed_scalar<kMxfp4X16Bytes, mxfp4_block_dot, 32>;
}

}  // namespace smk

using namespace smk;

// Bytes of `type`'s [rows, k] weight packed by 16 rows, or 0 if it cannot be packed (a type with
// no packed kernel, rows not a multiple of 16, k not whole packed blocks).
SMK_API int64_t smk_packed_size(int type, int64_t rows, int64_t k) {
    const int per = packed_bytes(type);
    const int unit = packed_unit(type);
    if (!per || rows <= 0 || k <= 0 || rows % kPackRows || k % unit) return 0;
    return rows / kPackRows * (k / unit) * per;
}

// Whether the ISA in use has a fast (SIMD) kernel for packed `type`: packing pays only then.
SMK_API int smk_packed_fast(int type) {
    return type >= 0 && type < 64 && kernels().packed[type] && kernels().packed_fast[type];
}

// Pack w ([rows, k] of `type`, row r at w + r * wstride) into out (smk_packed_size bytes, 64-byte
// aligned). Returns 0, or -1 if the weight cannot be packed.
SMK_API int smk_repack(int type, const uint8_t* w, size_t wstride, int64_t rows, int64_t k, uint8_t* out) {
    if (!smk_packed_size(type, rows, k)) return -1;
    if (type == T_Q4_K) repack_q4k(w, wstride, int(rows), int(k), out);
    if (type == T_Q6_K) repack_q6k(w, wstride, int(rows), int(k), out);
    if (type == T_Q8_0) repack_q80(w, wstride, int(rows), int(k), out);
    if (type == T_MXFP4) repack_mxfp4(w, wstride, int(rows), int(k), out);
    return 0;
}
