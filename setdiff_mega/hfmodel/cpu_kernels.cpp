/* The CPU decode kernels of setdiff_mega/hfmodel/cpu_kernels.py (compiled there on first use, loaded by ctypes;
   its docstring states the maths). Shipped beside that module in the package and in every export.

   Two extern "C" functions over raw float32 pointers and element strides, written with GCC's vector
   extensions (16-lane float vectors: AVX-512 registers with -march=native on an AVX-512 CPU, pairs of AVX2
   registers elsewhere), no torch headers:

     sdm_decode_attention   q [B, H, T, d], K / V [B, G, N, d], additive mask [B, 1|H, T, N] (may be null),
                            out [B, H, T, d]; T <= 16 queries in the lanes. Per (b, h): Q^T [d, 16], scores
                            S^T [N, 16] eight keys at a time, softmax per lane with a polynomial exp, values
                            32 channels x up to 10 queries at a time (d % 32 == 0) or 8 channels with the
                            queries in the lanes (any d). The heads are split over OpenMP threads.
     sdm_linear_panels      y [M, N] = x [M, K] W^T with W packed as panels [ceil(N / 32), K, 32]: 12 rows x 32
                            columns per pass in 24 accumulators, x transposed once per 12 rows so a step k
                            broadcasts from one cache line; panels split over OpenMP threads.

   Both prefetch into L2 far ahead of their one sequential pass over the cache / the weights (128 keys, 64
   panel rows): a decode step reads hundreds of MB that are never in cache, and without it the loops waited on
   DRAM (attention 9.1 -> 7.2 ms, products 12.4 -> 10.8 ms in a microbenchmark at GPT-2-small shape).

   A third, sdm_signature(), returns both functions' C signatures as the compiler sees their parameter types
   ("name(ptr,i64,...)->i32;..."): the loader refuses the library unless it equals the Python declaration its
   ctypes argument types are built from (cpu_kernels.SIGNATURES), so an edit to one side alone is one clear
   error at load instead of arguments read from the wrong registers. A parameter of a type the table below
   does not name does not compile. */
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
typedef float v16 __attribute__((vector_size(64)));
typedef int32_t i16 __attribute__((vector_size(64)));

static inline v16 vexp(v16 x) {
    const v16 zero = {};
    i16 dead = x < -87.33654f;
    x = dead ? zero : x;
    v16 fx = x * 1.44269504088896341f + 0.5f;
    v16 tf = __builtin_convertvector(__builtin_convertvector(fx, i16), v16);
    tf = (tf > fx) ? tf - 1.0f : tf;                        /* floor */
    x = x - tf * 0.693359375f + tf * 2.12194440e-4f;
    v16 z = x * x;
    v16 y = zero + 1.9875691500E-4f;
    y = y * x + 1.3981999507E-3f;
    y = y * x + 8.3334519073E-3f;
    y = y * x + 4.1665795894E-2f;
    y = y * x + 1.6666665459E-1f;
    y = y * x + 5.0000001201E-1f;
    y = y * z + x + 1.0f;
    i16 bits = (__builtin_convertvector(tf, i16) + 127) << 23;
    y = y * (v16)bits;
    return dead ? zero : y;
}

static inline v16 vload(const float* p) { v16 r; std::memcpy(&r, p, 64); return r; }
static inline void vstore(float* p, v16 r) { std::memcpy(p, &r, 64); }

/* scores S^T[s] = M^T[s] + sum_i K[s, i] Q^T[i], 8 keys at a time */
static void scores(const float* k, int64_t kn, const float* QT, const float* MT, float* ST, int N, int D) {
    int s = 0;
    for (; s + 8 <= N; s += 8) {
        v16 a[8];
        for (int j = 0; j < 8; ++j) a[j] = vload(MT + 16 * (s + j));
        const float* ks = k + s * kn;
        for (int j = 0; j < 8; ++j)           /* into L2, 16 blocks ahead (a prefetch never faults) */
            for (int i = 0; i < D; i += 16) __builtin_prefetch(ks + (128 + j) * kn + i, 0, 2);
        for (int i = 0; i < D; ++i) {
            v16 qi = vload(QT + 16 * i);
#pragma GCC unroll 8
            for (int j = 0; j < 8; ++j) a[j] += ks[j * kn + i] * qi;
        }
        for (int j = 0; j < 8; ++j) vstore(ST + 16 * (s + j), a[j]);
    }
    for (; s < N; ++s) {
        v16 a = vload(MT + 16 * s);
        const float* ks = k + s * kn;
        for (int i = 0; i < D; ++i) a += ks[i] * vload(QT + 16 * i);
        vstore(ST + 16 * s, a);
    }
}

/* P^T = exp(S^T - max) in place; returns l (the per-lane sums) */
static v16 softmax(float* ST, int N) {
    const float ninf = -__builtin_inff();
    v16 m = {}; m += ninf;
    for (int s = 0; s < N; ++s) { v16 x = vload(ST + 16 * s); m = x > m ? x : m; }
    const v16 zero = {};
    m = (m == ninf) ? zero : m;
    v16 l = {};
    for (int s = 0; s < N; ++s) { v16 e = vexp(vload(ST + 16 * s) - m); vstore(ST + 16 * s, e); l += e; }
    return l;
}

/* out[t, i] = sum_s V[s, i] P^T[s][t] / l[t], 8 channels at a time (w < 8: the last group of d % 8) */
template <int w>
static void values_group(const float* v, int64_t vn, const float* ST, int N, float* acc) {
    v16 a[w] = {};
    for (int s = 0; s < N; ++s) {
        v16 p = vload(ST + 16 * s);
        const float* vs = v + s * vn;
#pragma GCC unroll 8
        for (int j = 0; j < w; ++j) a[j] += vs[j] * p;
    }
    for (int j = 0; j < w; ++j) vstore(acc + 16 * j, a[j]);
}

typedef void (*group_fn)(const float*, int64_t, const float*, int, float*);
static const group_fn GROUPS[9] = {nullptr, values_group<1>, values_group<2>, values_group<3>, values_group<4>,
                                   values_group<5>, values_group<6>, values_group<7>, values_group<8>};

/* with d % 16 == 0: channels in the lanes, a group of n <= 10 queries x 32 channels in 2n accumulators */
template <int n>
static void values_rows(const float* v, int64_t vn, const float* ST, const float* inv, int t0, int N, int i0,
                        float* o, int64_t ot) {
    v16 a[n][2] = {};
    for (int s = 0; s < N; ++s) {
        const float* vs = v + s * vn + i0;
        __builtin_prefetch(vs + 128 * vn, 0, 2);
        __builtin_prefetch(vs + 128 * vn + 16, 0, 2);
        v16 v0 = vload(vs), v1 = vload(vs + 16);
        const float* p = ST + 16 * s + t0;
#pragma GCC unroll 10
        for (int t = 0; t < n; ++t) { a[t][0] += p[t] * v0; a[t][1] += p[t] * v1; }
    }
    for (int t = 0; t < n; ++t) {
        vstore(o + (t0 + t) * ot + i0, a[t][0] * inv[t0 + t]);
        vstore(o + (t0 + t) * ot + i0 + 16, a[t][1] * inv[t0 + t]);
    }
}

typedef void (*rows_fn)(const float*, int64_t, const float*, const float*, int, int, int, float*, int64_t);
static const rows_fn ROWS[11] = {nullptr, values_rows<1>, values_rows<2>, values_rows<3>, values_rows<4>,
                                 values_rows<5>, values_rows<6>, values_rows<7>, values_rows<8>, values_rows<9>,
                                 values_rows<10>};

static void values(const float* v, int64_t vn, const float* ST, v16 l, float* o, int64_t ot, int T, int N, int D) {
    float inv[16], acc[16 * 8];
    for (int t = 0; t < 16; ++t) inv[t] = l[t] > 0.f ? 1.f / l[t] : 0.f;
    if (D % 32 == 0) {
        const int groups = (T + 9) / 10;
        for (int i0 = 0; i0 < D; i0 += 32)
            for (int g = 0, t0 = 0; g < groups; ++g) {
                const int n = (T - t0) / (groups - g);
                ROWS[n](v, vn, ST, inv, t0, N, i0, o, ot);
                t0 += n;
            }
        return;
    }
    for (int i0 = 0; i0 < D; i0 += 8) {
        const int w = D - i0 < 8 ? D - i0 : 8;
        GROUPS[w](v + i0, vn, ST, N, acc);
        for (int j = 0; j < w; ++j)
            for (int t = 0; t < T; ++t) o[t * ot + i0 + j] = acc[16 * j + t] * inv[t];
    }
}

/* this thread's scratch of at least n floats (64-byte aligned), kept and grown across calls: a fresh
   allocation of this size per head is an mmap and its page faults */
static float* scratch(size_t n, int slot) {
    static thread_local float* buf[3] = {nullptr, nullptr, nullptr};
    static thread_local size_t size[3] = {0, 0, 0};
    if (n > size[slot]) {
        std::free(buf[slot]);
        size[slot] = (n + 4095) & ~(size_t)4095;
        buf[slot] = (float*)std::aligned_alloc(64, size[slot] * sizeof(float));
        if (!buf[slot]) size[slot] = 0;
    }
    return buf[slot];
}

/* the additive mask of (b, h) transposed: MT[s][t] = mask[t, s], lanes t >= T zero */
static void mask_t(const float* m, int64_t mt, int64_t mn, float* MT, int T, int N) {
    std::memset(MT, 0, (size_t)64 * N);
    for (int t = 0; t < T; ++t)
        for (int s = 0; s < N; ++s) MT[16 * s + t] = m[t * mt + s * mn];
}

/* ---- small-M linear: y [M, N] = x [M, K] W^T, W packed in panels of 32 output columns ----
   Wp[p][k][c] = W[32 p + c, k] (zero past N): one sequential stream of the whole matrix. Rows are
   taken 12 at a time (24 accumulators: 12 rows x 2 vectors of 16 columns); xT[k][m] = x[m, k] so a
   step k broadcasts its rows' values from one cache line. */
template <int MR>
static void panel(const float* xT, const float* wp, int64_t K, float* y, int64_t ldy, int nvalid) {
    v16 a[MR][2] = {};
    for (int64_t k = 0; k < K; ++k) {
        const float* w = wp + 32 * k;
        __builtin_prefetch(w + 32 * 64, 0, 2);
        __builtin_prefetch(w + 32 * 64 + 16, 0, 2);
        v16 w0 = vload(w), w1 = vload(w + 16);
        const float* xk = xT + 16 * k;
#pragma GCC unroll 12
        for (int m = 0; m < MR; ++m) { a[m][0] += xk[m] * w0; a[m][1] += xk[m] * w1; }
    }
    if (nvalid == 32) {
        for (int m = 0; m < MR; ++m) { vstore(y + m * ldy, a[m][0]); vstore(y + m * ldy + 16, a[m][1]); }
    } else {
        for (int m = 0; m < MR; ++m)
            for (int c = 0; c < nvalid; ++c) y[m * ldy + c] = c < 16 ? a[m][0][c] : a[m][1][c - 16];
    }
}

typedef void (*panel_fn)(const float*, const float*, int64_t, float*, int64_t, int);
static const panel_fn PANELS[13] = {nullptr, panel<1>, panel<2>, panel<3>, panel<4>, panel<5>, panel<6>,
                                    panel<7>, panel<8>, panel<9>, panel<10>, panel<11>, panel<12>};

extern "C" int sdm_linear_panels(const float* x, int64_t ldx, const float* wp, float* y, int64_t ldy,
                                 int64_t M, int64_t N, int64_t K, int threads) {
    if (M < 1 || N < 1 || K < 1) return 1;
    const int64_t P = (N + 31) / 32;
    for (int64_t m0 = 0; m0 < M; m0 += 12) {
        const int mr = M - m0 < 12 ? (int)(M - m0) : 12;
        float* xT = scratch((size_t)16 * K, 2);
        if (!xT) return 2;
        for (int m = 0; m < mr; ++m)
            for (int64_t k = 0; k < K; ++k) xT[16 * k + m] = x[(m0 + m) * ldx + k];
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
        for (int64_t p = 0; p < P; ++p) {
            const int nvalid = N - 32 * p < 32 ? (int)(N - 32 * p) : 32;
            PANELS[mr](xT, wp + p * 32 * K, K, y + m0 * ldy + 32 * p, ldy, nvalid);
        }
    }
    return 0;
}

extern "C" int sdm_decode_attention(
        const float* q, int64_t qb, int64_t qh, int64_t qt,
        const float* k, int64_t kb, int64_t kg, int64_t kn,
        const float* v, int64_t vb, int64_t vg, int64_t vn,
        const float* m, int64_t mb, int64_t mh, int64_t mt, int64_t mn,
        float* o, int64_t ob, int64_t oh, int64_t ot,
        int B, int H, int G, int T, int N, int D, float scale, int threads) {
    if (T < 1 || T > 16 || G < 1 || H % G || N < 1 || D < 1) return 1;
    const int per = H / G;
    /* a mask shared by the heads (mh == 0) is transposed once per batch row, before the heads */
    float* shared = (m && mh == 0) ? scratch((size_t)16 * N * B, 1) : nullptr;
    if (m && mh == 0 && !shared) return 2;
    if (shared)
        for (int b = 0; b < B; ++b) mask_t(m + b * mb, mt, mn, shared + (size_t)16 * N * b, T, N);
    int failed = 0;
#pragma omp parallel for collapse(2) schedule(static) num_threads(threads) if (threads > 1) reduction(|:failed)
    for (int b = 0; b < B; ++b) {
        for (int h = 0; h < H; ++h) {
            float* buf = scratch((size_t)16 * (2 * N + D), 0);
            if (!buf) { failed = 1; continue; }
            float *ST = buf, *MT = buf + 16 * N, *QT = buf + 32 * N;
            std::memset(QT, 0, (size_t)64 * D);
            const float* qh_ = q + b * qb + h * qh;
            for (int t = 0; t < T; ++t)
                for (int i = 0; i < D; ++i) QT[16 * i + t] = qh_[t * qt + i] * scale;
            if (shared)
                MT = shared + (size_t)16 * N * b;
            else if (m)
                mask_t(m + b * mb + h * mh, mt, mn, MT, T, N);
            else
                std::memset(MT, 0, (size_t)64 * N);
            const int g = h / per;
            scores(k + b * kb + g * kg, kn, QT, MT, ST, N, D);
            v16 l = softmax(ST, N);
            values(v + b * vb + g * vg, vn, ST, l, o + b * ob + h * oh, ot, T, N, D);
        }
    }
    return failed ? 2 : 0;
}

/* ---- the signatures, as the compiler sees the parameter types (the ctypes names of cpu_kernels.py) ---- */
template <class T> struct abi;                 /* no entry: a parameter ctypes is not told about does not compile */
template <> struct abi<const float*> { static const char* name() { return "ptr"; } };
template <> struct abi<float*> { static const char* name() { return "ptr"; } };
template <> struct abi<int64_t> { static const char* name() { return "i64"; } };
template <> struct abi<int32_t> { static const char* name() { return "i32"; } };
template <> struct abi<float> { static const char* name() { return "f32"; } };

template <class R, class... A>
static std::string declared(const char* name, R (*)(A...)) {
    const char* args[] = {abi<A>::name()..., nullptr};
    std::string s = std::string(name) + "(";
    for (int i = 0; args[i]; ++i) s += (i ? "," : "") + std::string(args[i]);
    return s + ")->" + abi<R>::name();
}
#define SDM_DECLARED(f) declared(#f, &f)

extern "C" const char* sdm_signature() {
    static const std::string s = SDM_DECLARED(sdm_decode_attention) + ";" + SDM_DECLARED(sdm_linear_panels);
    return s.c_str();
}
