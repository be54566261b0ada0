#pragma once

// SHA-256 (FIPS 180-4) for one thread: the functions behind device_digest.cu, in a header so
// that rollout-digest-bench can time variants of the launch around the same code. Host and
// device: the host build of the same code is unit-tested without a GPU (sha256_test.cc).
// Include from .cu files.
#include <cuda_runtime.h>

#include <cstdint>

// Fully unrolled loops on the device (every index a constant, so the state and the message
// stay in registers); the host build (tests only) leaves them to the compiler.
#ifdef __CUDA_ARCH__
#define ROLLOUT_SHA256_UNROLL _Pragma("unroll")
#else
#define ROLLOUT_SHA256_UNROLL
#endif

namespace rollout::cuda::sha256 {

__host__ __device__ __forceinline__ uint32_t Rotr(uint32_t x, int n) {
#ifdef __CUDA_ARCH__
  return __funnelshift_r(x, x, n);  // one SHF
#else
  return (x >> n) | (x << (32 - n));
#endif
}

// Memory is little endian, SHA-256's words big endian.
__host__ __device__ __forceinline__ uint32_t ByteSwap(uint32_t x) {
#ifdef __CUDA_ARCH__
  return __byte_perm(x, 0, 0x0123);  // one PRMT
#else
  return __builtin_bswap32(x);
#endif
}

// A read-only 16-byte load (the non-coherent path on the device: the bytes do not change
// while a kernel reads them).
__host__ __device__ __forceinline__ uint4 Load16(const uint4* p) {
#ifdef __CUDA_ARCH__
  return __ldg(p);
#else
  return *p;
#endif
}

// One compression of the 64-byte block w (big-endian words) into the state h.
__host__ __device__ __forceinline__ void Compress(uint32_t h[8], uint32_t w[16]) {
  // FIPS 180-4 4.2.2; a local table, so that with the rounds unrolled every K[t] is an
  // immediate operand (and host and device compile the same source).
  constexpr uint32_t kRoundConstants[64] = {
      0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4,
      0xab1c5ed5, 0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe,
      0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f,
      0x4a7484aa, 0x5cb0a9dc, 0x76f988da, 0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7,
      0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc,
      0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b,
      0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116,
      0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
      0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7,
      0xc67178f2};
  uint32_t a = h[0], b = h[1], c = h[2], d = h[3], e = h[4], f = h[5], g = h[6], hh = h[7];
  ROLLOUT_SHA256_UNROLL
  for (int t = 0; t < 64; ++t) {
    if (t >= 16) {  // the message schedule, in a ring of 16 words
      const uint32_t w15 = w[(t - 15) & 15], w2 = w[(t - 2) & 15];
      const uint32_t s0 = Rotr(w15, 7) ^ Rotr(w15, 18) ^ (w15 >> 3);
      const uint32_t s1 = Rotr(w2, 17) ^ Rotr(w2, 19) ^ (w2 >> 10);
      w[t & 15] += s0 + w[(t - 7) & 15] + s1;
    }
    const uint32_t t1 = hh + (Rotr(e, 6) ^ Rotr(e, 11) ^ Rotr(e, 25)) + ((e & f) ^ (~e & g)) +
                        kRoundConstants[t] + w[t & 15];
    const uint32_t t2 = (Rotr(a, 2) ^ Rotr(a, 13) ^ Rotr(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
    hh = g;
    g = f;
    f = e;
    e = d + t1;
    d = c;
    c = b;
    b = a;
    a = t1 + t2;
  }
  h[0] += a;
  h[1] += b;
  h[2] += c;
  h[3] += d;
  h[4] += e;
  h[5] += f;
  h[6] += g;
  h[7] += hh;
}

// w = a block of the padding of a message of `bits` bits whose `rest` (0..63) last bytes at
// `tail` follow its whole blocks (FIPS 180-4 5.1.1: a 1 bit, zeros, the length as a big-endian
// 64-bit integer). first: the block with those bytes (and the length when rest < 56); else the
// second block, zeros and the length, for rest >= 56.
__host__ __device__ __forceinline__ void PaddingBlock(const uint8_t* tail, uint32_t rest,
                                                      bool first, uint64_t bits, uint32_t w[16]) {
  const uint32_t data_bytes = first ? rest : 0;
  ROLLOUT_SHA256_UNROLL
  for (int k = 0; k < 16; ++k) {
    uint32_t word = 0;
    ROLLOUT_SHA256_UNROLL
    for (int j = 0; j < 4; ++j) {
      const uint32_t i = 4 * k + j;
      const uint32_t byte = i < data_bytes ? tail[i] : (first && i == rest ? 0x80u : 0u);
      word = (word << 8) | byte;
    }
    w[k] = word;
  }
  if (!first || rest < 56) {
    w[14] = static_cast<uint32_t>(bits >> 32);
    w[15] = static_cast<uint32_t>(bits);
  }
}

// out[0, 32) = SHA-256 of p[0, n); out is 16-byte aligned. Whole blocks are read with 16-byte
// loads (the next block's in flight during a compression) when p is 16-byte aligned, else byte
// by byte. One call site of Compress, so the unrolled rounds are in the code once.
__host__ __device__ __forceinline__ void Sha256(const uint8_t* p, uint64_t n, uint8_t* out) {
  uint32_t h[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                   0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
  const uint64_t whole = n / 64;
  const uint32_t rest = static_cast<uint32_t>(n - 64 * whole);
  const uint64_t blocks = whole + (rest >= 56 ? 2 : 1);
  const bool aligned = (reinterpret_cast<uintptr_t>(p) & 15) == 0;
  const uint4* q = reinterpret_cast<const uint4*>(p);
  uint4 m[4];
  if (aligned && whole > 0) {
    ROLLOUT_SHA256_UNROLL
    for (int k = 0; k < 4; ++k) m[k] = Load16(q + k);
  }
  uint32_t w[16];
  for (uint64_t blk = 0; blk < blocks; ++blk) {
    if (blk < whole && aligned) {
      ROLLOUT_SHA256_UNROLL
      for (int k = 0; k < 4; ++k) {
        w[4 * k] = ByteSwap(m[k].x);
        w[4 * k + 1] = ByteSwap(m[k].y);
        w[4 * k + 2] = ByteSwap(m[k].z);
        w[4 * k + 3] = ByteSwap(m[k].w);
      }
      if (blk + 1 < whole) {
        q += 4;
        ROLLOUT_SHA256_UNROLL
        for (int k = 0; k < 4; ++k) m[k] = Load16(q + k);
      }
    } else if (blk < whole) {
      const uint8_t* b = p + 64 * blk;
      ROLLOUT_SHA256_UNROLL
      for (int k = 0; k < 16; ++k) {
        w[k] = (uint32_t{b[4 * k]} << 24) | (uint32_t{b[4 * k + 1]} << 16) |
               (uint32_t{b[4 * k + 2]} << 8) | uint32_t{b[4 * k + 3]};
      }
    } else {
      PaddingBlock(p + 64 * whole, rest, blk == whole, n * 8, w);
    }
    Compress(h, w);
  }
  uint4* o = reinterpret_cast<uint4*>(out);
  o[0] = make_uint4(ByteSwap(h[0]), ByteSwap(h[1]), ByteSwap(h[2]), ByteSwap(h[3]));
  o[1] = make_uint4(ByteSwap(h[4]), ByteSwap(h[5]), ByteSwap(h[6]), ByteSwap(h[7]));
}

}  // namespace rollout::cuda::sha256

#undef ROLLOUT_SHA256_UNROLL
