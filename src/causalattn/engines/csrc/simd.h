// Vector types, the base-2 exponential and tanh, and the GEMM micro-kernel of the native
// engine. Written with GCC/Clang vector extensions: the extension is compiled on the
// machine that runs it (-march=native), so the same code becomes AVX2, AVX-512 or NEON.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace causalattn {

// The constants Python computes with too are defined once, in causalattn/constants.py; the
// build (causalattn/engines/cpp.py's DEFINES) passes each one as -DCAUSALATTN_<NAME>.
#ifndef CAUSALATTN_LOG2E
#error "build through causalattn.engines.cpp: it passes causalattn/constants.py's constants"
#endif
constexpr double LOG2E = CAUSALATTN_LOG2E;
constexpr double LN2 = CAUSALATTN_LN2;

#if defined(__AVX512F__)
constexpr int VBYTES = 64;
#elif defined(__AVX__)
constexpr int VBYTES = 32;
#else
constexpr int VBYTES = 16;
#endif

typedef float vf __attribute__((vector_size(VBYTES)));
typedef double vd __attribute__((vector_size(VBYTES)));
typedef int32_t vi32 __attribute__((vector_size(VBYTES)));
typedef int64_t vi64 __attribute__((vector_size(VBYTES)));
typedef uint32_t vu32 __attribute__((vector_size(VBYTES)));

// Per compute type T: the vector, its lane count and the integer vector of its width.
template <typename T>
struct Vec;
template <>
struct Vec<float> {
  using v = vf;
  using vi = vi32;
  static constexpr int N = VBYTES / 4;
};
template <>
struct Vec<double> {
  using v = vd;
  using vi = vi64;
  static constexpr int N = VBYTES / 8;
};

template <typename T>
inline typename Vec<T>::v vload(const T* p) {
  typename Vec<T>::v x;
  std::memcpy(&x, p, sizeof(x));  // unaligned load
  return x;
}
template <typename T>
inline void vstore(T* p, typename Vec<T>::v x) {
  std::memcpy(p, &x, sizeof(x));
}
template <typename T>
inline typename Vec<T>::v vset(T s) {
  return typename Vec<T>::v{} + s;
}

template <typename T>
inline T hsum(typename Vec<T>::v x) {
  T s = 0;
  for (int i = 0; i < Vec<T>::N; ++i) s += x[i];
  return s;
}
template <typename T>
inline T hmax(typename Vec<T>::v x) {  // NaN-propagating
  T m = x[0];
  for (int i = 1; i < Vec<T>::N; ++i) m = (x[i] > m || x[i] != x[i]) ? x[i] : m;
  return m;
}
template <typename T>
inline T smax(T a, T b) {  // NaN-propagating max of scalars (b wins on NaN)
  return (b > a || b != b) ? b : a;
}

// 2^x, elementwise. exp2(-inf) = 0 exactly (masked scores give exactly zero weight), NaN
// stays NaN, x >= 127 (or 1023) saturates. x = n + f with n = round(x), |f| <= 1/2; 2^f by a
// polynomial fitted here to it on [-1/2, 1/2] (float: degree 6, relative error 3e-9) or its
// Taylor series (double: degree 13, 2e-17).
__attribute__((always_inline)) inline vf exp2v(vf x) {
  const vf lo = vset<float>(-127.f), hi = vset<float>(127.f);
  x = x < lo ? lo : x;  // comparisons with NaN are false: NaN passes through
  x = x > hi ? hi : x;
  const vf magic = vset<float>(12582912.f);  // 1.5·2^23: adding it rounds to an integer
  vf n = (x + magic) - magic;
  vf f = x - n;
  const float c[7] = {1.f,          0.6931471824645996f,   0.24022644758224487f,
                      0.05550334602594376f, 0.009618792682886124f, 0.0013397912262007594f,
                      0.00015257236373145133f};
  vf p = vset<float>(c[6]);
  for (int i = 5; i >= 0; --i) p = p * f + c[i];
  vi32 e = (__builtin_convertvector(n, vi32) + 127) << 23;  // 2^n; n = -127 gives 0.0
  return p * (vf)e;
}

__attribute__((always_inline)) inline vd exp2v(vd x) {
  const vd lo = vset<double>(-1023.), hi = vset<double>(1023.);
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const vd magic = vset<double>(6755399441055744.);  // 1.5·2^52
  vd n = (x + magic) - magic;
  vd f = x - n;
  // ln2^i / i!, i = 0..13
  const double c[14] = {1.,
                        LN2,
                        0.2402265069591007,
                        0.05550410866482158,
                        0.009618129107628477,
                        0.0013333558146428443,
                        0.00015403530393381606,
                        1.525273380405984e-05,
                        1.3215486790144307e-06,
                        1.0178086009239699e-07,
                        7.054911620801123e-09,
                        4.445538271870811e-10,
                        2.567843599348821e-11,
                        1.3691488853904124e-12};
  vd p = vset<double>(c[13]);
  for (int i = 12; i >= 0; --i) p = p * f + c[i];
  vi64 e = (__builtin_convertvector(n, vi64) + 1023) << 52;
  return p * (vd)e;
}

// 1/a: the reciprocal estimate and one Newton step where the ISA has it (23 of 24 bits, a
// fraction of a division's cost), else a division.
template <typename V>
__attribute__((always_inline)) inline V recip(V a) {
#if defined(__AVX__) && !defined(__AVX512F__)
  if constexpr (sizeof(a[0]) == 4) {
    const V r = (V)__builtin_ia32_rcpps256((vf)a);
    return r * (2.f - a * r);
  }
#endif
  using T = decltype(a[0] + 0);
  return T(1) / a;
}

// tanh(x) = (t - 1) / (t + 1), t = 2^(2x·log2 e), x clamped to ±10 (where tanh is ±1 to
// float precision): NaN stays NaN, the absolute error a few 1e-8 (softcap multiplies it by
// the cap, so what counts is absolute).
template <typename V>
__attribute__((always_inline)) inline V tanhv(V x) {
  using T = decltype(x[0] + 0);
  const V lim = vset<T>(T(10));
  x = x > lim ? lim : x;
  x = x < -lim ? -lim : x;
  const V t = exp2v(x * T(2 * LOG2E));
  return (t - T(1)) * recip(t + T(1));
}

template <typename T>
inline T exp2s(T x) {  // scalar through the vector path: the same bits as the tiles
  typename Vec<T>::v v = vset<T>(x);
  return exp2v(v)[0];
}

// Elementwise max (not NaN-propagating: NaN reads propagate through the exponentials).
template <typename V>
inline V vmax(V a, V b) {
#if defined(__AVX__) && !defined(__AVX512F__)
  if constexpr (sizeof(a[0]) == 4) return (V)__builtin_ia32_maxps256((vf)a, (vf)b);
  else return (V)__builtin_ia32_maxpd256((vd)a, (vd)b);
#else
  return a > b ? a : b;
#endif
}

// ---- GEMM micro-kernel -------------------------------------------------------------------
// C[R × NR] (+)= A[R × K] · B[K × NR], NR = 2 vectors, R <= MR. A is read in place: element
// (r, k) at A[r·rsa + k·csa] (a row-major A: csa = 1; a transposed one: rsa = 1). B holds NR
// consecutive values per k, rows ldb apart (a packed panel: ldb = NR; a row-major matrix
// read in place: its leading dimension). C is row-major with leading dimension ldc.
template <typename T>
constexpr int NR = 2 * Vec<T>::N;
constexpr int MR = 6;

template <int R, bool ACC, typename T>
inline void micro(long K, const T* __restrict A, long rsa, long csa, const T* __restrict B,
                  long ldb, T* __restrict C, long ldc) {
  using V = typename Vec<T>::v;
  constexpr int N = Vec<T>::N;
  V c0[R], c1[R];
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) c0[r] = c1[r] = V{};
  for (long k = 0; k < K; ++k) {
    V b0 = vload(B), b1 = vload(B + N);
    B += ldb;
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      T a = A[r * rsa + k * csa];
      c0[r] += a * b0;
      c1[r] += a * b1;
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) {
    T* c = C + r * ldc;
    if (ACC) {
      vstore(c, vload(c) + c0[r]);
      vstore(c + N, vload(c + N) + c1[r]);
    } else {
      vstore(c, c0[r]);
      vstore(c + N, c1[r]);
    }
  }
}

// the same for any rows <= MR
template <bool ACC, typename T>
inline void micro_rows(int rows, long K, const T* A, long rsa, long csa, const T* B, long ldb,
                       T* C, long ldc) {
  switch (rows) {
    case 6: micro<6, ACC>(K, A, rsa, csa, B, ldb, C, ldc); break;
    case 5: micro<5, ACC>(K, A, rsa, csa, B, ldb, C, ldc); break;
    case 4: micro<4, ACC>(K, A, rsa, csa, B, ldb, C, ldc); break;
    case 3: micro<3, ACC>(K, A, rsa, csa, B, ldb, C, ldc); break;
    case 2: micro<2, ACC>(K, A, rsa, csa, B, ldb, C, ldc); break;
    default: micro<1, ACC>(K, A, rsa, csa, B, ldb, C, ldc); break;
  }
}

}  // namespace causalattn
