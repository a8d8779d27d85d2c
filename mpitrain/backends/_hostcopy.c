/* Gather and scatter between one flat host buffer and many host arrays, in one call.
 *
 * A fusion bucket of many small arrays is copied into and out of flat buffers (the
 * shared-memory allreduce's stages, a packed fusion buffer). numpy needs one call per
 * array for the scatter and spends about half a microsecond per array inside
 * concatenate for the gather, which for 10 KiB arrays costs more than the copy
 * itself. These functions take the whole list and copy each array's bytes with one
 * memmove (the GPU path does the same with one kernel: kernels/pack.cu).
 *
 *   gather(flat, parts)  -> flat's bytes = parts' bytes, one part after the other
 *   scatter(flat, parts) -> each part's bytes = its range of flat's bytes
 *
 * Both return True after copying, or False without copying anything if they cannot
 * copy bytes for bytes: a buffer that is not C-contiguous or whose item format is not
 * flat's (or that has none, such as ml_dtypes' bfloat16), a destination that is
 * read-only, or parts whose sizes do not add up to flat's. The caller (the numpy
 * backend, mpitrain/backends/hostcopy.py) then copies with numpy.
 *
 * The GIL is released for the copies when they move at least RELEASE_BYTES, as numpy
 * does for large copies, so that other threads run meanwhile.
 *
 * It also reduces and scales 16-bit floats (float16, bfloat16) at memory speed, which
 * numpy does not: its float16 arithmetic converts one element at a time, ten times
 * slower than its float32 arithmetic, and ml_dtypes' bfloat16 is slower still.
 *
 *   reduce16(dst, a, b, kind, op, factor) -> dst = (a <op> b) * factor
 *   scale16(dst, src, kind, factor)       -> dst = src * factor
 *   convert16(dst, src, kind)             -> dst = src, float32 <-> 16-bit float
 *
 * kind is KIND_FLOAT16 or KIND_BFLOAT16 and op one of the OP_* constants; the arrays
 * are passed as uint16 views of the same length, and dst may be a or b (or src). Each
 * block of BLOCK elements is converted to float32, combined in float32 and rounded back
 * to nearest even: float16 and bfloat16 arithmetic in numpy and ml_dtypes is defined the
 * same way (float32, then one rounding), so the results are bit for bit theirs. With a
 * factor (which the caller rounds as numpy does), the reduced
 * block is rounded, multiplied in float32 and rounded again: numpy's reduce then
 * multiply. MIN and MAX pick the operands' bits as numpy's minimum and maximum do.
 * float16 converts with the F16C instructions where the processor has them (checked
 * once at import), else with portable bit manipulation that the compiler vectorizes.
 * Sums, products and scalings run in one pass where the processor allows (F16C for
 * float16, AVX2 for bfloat16): eight elements widened, combined, scaled and narrowed
 * in registers, with the same instructions and roundings as the blocks, so with the
 * same bits; MIN, MAX and the last few elements go through the blocks.
 * They return False without writing when the buffers are not C-contiguous arrays of
 * 2-byte items (4-byte float32 on one side of convert16) of equal length, or dst is
 * read-only.
 *
 * And it reads other processes' memory for the single-copy collectives
 * (mpitrain/algorithms/single_copy.py), with Linux's cross-memory attach:
 *
 *   vm_read(pid, local, address) -> local's bytes = process pid's bytes at address
 *   allow_peers()                -> let any process of this user read ours (Yama)
 *
 * vm_read loops until every byte is read and raises OSError (EPERM where the kernel
 * forbids it, ENOSYS off Linux) otherwise.
 *
 * And it passes the shared-memory barrier of the small calls (mpitrain/comm/shm.py)
 * without the interpreter: Counters(words, rank, size).agree(t, fingerprint, polls)
 * publishes the fingerprint, arrives and spins a bounded number of tests, in one call
 * (see the type below).
 *
 * And it holds the doorbell on which the async engine's progress thread sleeps
 * (mpitrain/engine/engine.py): Doorbell().ring(settle), .taken(), .sleep(timeout,
 * settle_s), which keeps the sleeper off the GIL until it knows it has work (see the type).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <stdint.h>
#include <string.h>
#ifdef __linux__
#include <sys/prctl.h>
#include <sys/uio.h>
#include <pthread.h>
#include <time.h>
#define HAVE_DOORBELL 1
#endif
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#include <immintrin.h>
#define HAVE_X86 1
#endif

#ifndef SOURCE_SHA256
#define SOURCE_SHA256 ""
#endif

#define STACK_PARTS 128
#define RELEASE_BYTES (1 << 16)

static int same_format(const Py_buffer *a, const Py_buffer *b) {
    return a->itemsize == b->itemsize && a->format != NULL && b->format != NULL &&
           strcmp(a->format, b->format) == 0;
}

/* 1 after copying, 0 if it cannot copy (nothing copied, no exception), -1 on error. */
static int copy_parts(PyObject *flat, PyObject *parts, int gather) {
    PyObject *seq = PySequence_Fast(parts, "parts must be a sequence of arrays");
    if (seq == NULL)
        return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), held = 0, total = 0, i;
    PyObject **items = PySequence_Fast_ITEMS(seq);
    Py_buffer whole, stack[STACK_PARTS];
    Py_buffer *views = n <= STACK_PARTS ? stack : PyMem_New(Py_buffer, n);
    int flat_flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (gather ? PyBUF_WRITABLE : 0);
    int part_flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (gather ? 0 : PyBUF_WRITABLE);
    int result = 0;
    if (views == NULL) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return -1;
    }
    if (PyObject_GetBuffer(flat, &whole, flat_flags) < 0) {
        PyErr_Clear();
        goto done;
    }
    for (held = 0; held < n; held++) {
        if (PyObject_GetBuffer(items[held], &views[held], part_flags) < 0) {
            PyErr_Clear();
            goto release;
        }
        if (!same_format(&views[held], &whole)) {
            held++;
            goto release;
        }
        total += views[held].len;
    }
    if (total == whole.len) {
        char *at = whole.buf;
        PyThreadState *saved = total >= RELEASE_BYTES ? PyEval_SaveThread() : NULL;
        for (i = 0; i < n; i++) {
            if (gather)
                memmove(at, views[i].buf, (size_t)views[i].len);
            else
                memmove(views[i].buf, at, (size_t)views[i].len);
            at += views[i].len;
        }
        if (saved != NULL)
            PyEval_RestoreThread(saved);
        result = 1;
    }
release:
    for (i = 0; i < held; i++)
        PyBuffer_Release(&views[i]);
    PyBuffer_Release(&whole);
done:
    if (views != stack)
        PyMem_Free(views);
    Py_DECREF(seq);
    return result;
}

static PyObject *call(PyObject *args, int gather) {
    PyObject *flat, *parts;
    if (!PyArg_ParseTuple(args, gather ? "OO:gather" : "OO:scatter", &flat, &parts))
        return NULL;
    int done = copy_parts(flat, parts, gather);
    if (done < 0)
        return NULL;
    return PyBool_FromLong(done);
}

static PyObject *gather(PyObject *self, PyObject *args) {
    (void)self;
    return call(args, 1);
}

static PyObject *scatter(PyObject *self, PyObject *args) {
    (void)self;
    return call(args, 0);
}

/* ---- 16-bit floats ---------------------------------------------------------------- */

enum { KIND_FLOAT16 = 0, KIND_BFLOAT16 = 1 };
enum { OP_SUM = 0, OP_PRODUCT = 1, OP_MIN = 2, OP_MAX = 3 };
#define BLOCK 2048 /* elements: two float32 blocks of 8 KiB stay in L1 */

typedef void (*widen_fn)(float *out, const uint16_t *in, Py_ssize_t n);
typedef void (*narrow_fn)(uint16_t *out, const float *in, Py_ssize_t n);

static inline float from_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint32_t to_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

/* float16 -> float32, exact: the exponent is rebased by a multiplication by 2^112,
 * which also turns float16's subnormals into float32 normals; inf and NaN keep their
 * mantissa (a NaN stays a NaN with its payload). */
static inline float half_to_float(uint16_t h) {
    uint32_t magnitude = (uint32_t)(h & 0x7fffu) << 13;
    uint32_t finite = to_bits(from_bits(magnitude) * 0x1p112f);
    uint32_t special = 0u - (uint32_t)((h & 0x7c00u) == 0x7c00u); /* all ones: inf, NaN */
    uint32_t u = (finite & ~special) | ((0x7f800000u | magnitude) & special);
    return from_bits(u | ((uint32_t)(h & 0x8000u) << 16));
}

/* float32 -> float16, rounded to nearest even; overflow gives inf, NaN a quiet NaN
 * with the top of the payload. */
static inline uint16_t float_to_half(float f) {
    uint32_t u = to_bits(f) & 0x7fffffffu, sign = (to_bits(f) >> 16) & 0x8000u;
    /* >= 65536: inf, or NaN */
    uint32_t huge = u > 0x7f800000u ? 0x7e00u | ((u >> 13) & 0x3ffu) : 0x7c00u;
    /* below float16's smallest normal: the float add rounds the mantissa into place,
     * to nearest even */
    uint32_t tiny = to_bits(from_bits(u) + 0.5f) - 0x3f000000u;
    /* normal: rebase the exponent, round the 13 dropped bits to nearest even */
    uint32_t normal = (u + 0xc8000fffu + ((u >> 13) & 1u)) >> 13;
    /* all three computed, one chosen by masks: no branch, so the loops vectorize */
    uint32_t is_huge = 0u - (uint32_t)(u >= 0x47800000u);
    uint32_t is_tiny = 0u - (uint32_t)(u < 0x38800000u);
    uint32_t out = (huge & is_huge) | (tiny & is_tiny) | (normal & ~(is_huge | is_tiny));
    return (uint16_t)(out | sign);
}

/* bfloat16 <-> float32: the top half of float32's bits; rounding to nearest even; a NaN
 * stays a quiet NaN of the same sign. */
static inline float bfloat_to_float(uint16_t b) { return from_bits((uint32_t)b << 16); }

static inline uint16_t float_to_bfloat(float f) {
    uint32_t u = to_bits(f);
    uint32_t is_nan = 0u - (uint32_t)((u & 0x7fffffffu) > 0x7f800000u);
    uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (uint16_t)((((u >> 16) | 0x40u) & is_nan) | (rounded & ~is_nan));
}

#ifdef HAVE_X86
/* Compiled twice, for AVX2 and for any x86-64; the loader picks one (GCC's ifunc). */
#define VECTOR_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define VECTOR_CLONES
#endif

VECTOR_CLONES static void widen_half(float *out, const uint16_t *in, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++)
        out[i] = half_to_float(in[i]);
}

VECTOR_CLONES static void narrow_half(uint16_t *out, const float *in, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++)
        out[i] = float_to_half(in[i]);
}

VECTOR_CLONES static void widen_bfloat(float *out, const uint16_t *in, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++)
        out[i] = bfloat_to_float(in[i]);
}

VECTOR_CLONES static void narrow_bfloat(uint16_t *out, const float *in, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++)
        out[i] = float_to_bfloat(in[i]);
}

#ifdef HAVE_X86
/* The same conversions with F16C, eight elements per instruction; the tail goes
 * through the portable ones (they round alike). */
__attribute__((target("avx,f16c"))) static void widen_half_f16c(float *out,
                                                                 const uint16_t *in,
                                                                 Py_ssize_t n) {
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(in + i))));
    widen_half(out + i, in + i, n - i);
}

__attribute__((target("avx,f16c"))) static void narrow_half_f16c(uint16_t *out,
                                                                 const float *in,
                                                                 Py_ssize_t n) {
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(out + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(in + i), _MM_FROUND_TO_NEAREST_INT));
    narrow_half(out + i, in + i, n - i);
}
#endif

static widen_fn widen_of[2] = {widen_half, widen_bfloat};
static narrow_fn narrow_of[2] = {narrow_half, narrow_bfloat};

/* One pass over the arrays, eight elements in registers at a time: dst = (a <op> b) *
 * factor for SUM and PRODUCT, or dst = a * factor when b is NULL. Each group of eight is
 * loaded before it is stored, so dst may be a or b. The rounding steps are those of
 * reduce_blocks, with the same instructions, so the results are its bits. Returns how
 * many leading elements it wrote (a multiple of eight, or 0 for MIN and MAX); the
 * caller finishes the rest. NULL where the processor lacks the instructions. */
typedef Py_ssize_t (*fused_fn)(uint16_t *dst, const uint16_t *a, const uint16_t *b,
                               Py_ssize_t n, int op, float factor);
static fused_fn fused_of[2] = {NULL, NULL};

#ifdef HAVE_X86
#define LOAD8(p) _mm_loadu_si128((const __m128i *)(p))
#define STORE8(p, v) _mm_storeu_si128((__m128i *)(p), (v))

/* The loops of a fused_fn, for a type whose eight elements WIDEN from an __m128i to an
 * __m256 of float32 and NARROW back. */
#define FUSED_LOOPS(WIDEN, NARROW)                                                        \
    Py_ssize_t i = 0;                                                                     \
    const __m256 f = _mm256_set1_ps(factor);                                              \
    if (b == NULL) {                                                                      \
        for (; i + 8 <= n; i += 8)                                                        \
            STORE8(dst + i, NARROW(_mm256_mul_ps(WIDEN(LOAD8(a + i)), f)));                \
    } else if (op == OP_SUM && factor == 1.0f) {                                          \
        for (; i + 8 <= n; i += 8)                                                        \
            STORE8(dst + i, NARROW(_mm256_add_ps(WIDEN(LOAD8(a + i)),                      \
                                                 WIDEN(LOAD8(b + i)))));                   \
    } else if (op == OP_PRODUCT && factor == 1.0f) {                                      \
        for (; i + 8 <= n; i += 8)                                                        \
            STORE8(dst + i, NARROW(_mm256_mul_ps(WIDEN(LOAD8(a + i)),                      \
                                                 WIDEN(LOAD8(b + i)))));                   \
    } else if (op == OP_SUM) { /* round the reduction, then scale */                      \
        for (; i + 8 <= n; i += 8) {                                                      \
            __m256 x = _mm256_add_ps(WIDEN(LOAD8(a + i)), WIDEN(LOAD8(b + i)));           \
            STORE8(dst + i, NARROW(_mm256_mul_ps(WIDEN(NARROW(x)), f)));                  \
        }                                                                                 \
    } else if (op == OP_PRODUCT) {                                                        \
        for (; i + 8 <= n; i += 8) {                                                      \
            __m256 x = _mm256_mul_ps(WIDEN(LOAD8(a + i)), WIDEN(LOAD8(b + i)));           \
            STORE8(dst + i, NARROW(_mm256_mul_ps(WIDEN(NARROW(x)), f)));                  \
        }                                                                                 \
    }                                                                                     \
    return i;

#define F16C_TARGET __attribute__((target("avx,f16c")))
#define AVX2_TARGET __attribute__((target("avx2")))

static inline F16C_TARGET __m256 widen8_half(__m128i h) { return _mm256_cvtph_ps(h); }

static inline F16C_TARGET __m128i narrow8_half(__m256 x) {
    return _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT);
}

static F16C_TARGET Py_ssize_t fused_half_f16c(uint16_t *dst, const uint16_t *a,
                                              const uint16_t *b, Py_ssize_t n, int op,
                                              float factor) {
    FUSED_LOOPS(widen8_half, narrow8_half)
}

static inline AVX2_TARGET __m256 widen8_bfloat(__m128i h) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* float_to_bfloat on eight lanes, then the low halves of the lanes packed in order. */
static inline AVX2_TARGET __m128i narrow8_bfloat(__m256 x) {
    __m256i u = _mm256_castps_si256(x);
    __m256i high = _mm256_srli_epi32(u, 16);
    __m256i is_nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                        _mm256_set1_epi32(0x7f800000));
    __m256i odd = _mm256_and_si256(high, _mm256_set1_epi32(1));
    __m256i rounded = _mm256_srli_epi32(
        _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), odd), 16);
    __m256i quiet = _mm256_or_si256(high, _mm256_set1_epi32(0x40));
    __m256i r = _mm256_blendv_epi8(rounded, quiet, is_nan);
    /* packus works per 128-bit lane: lane 0 holds elements 0-3 twice, lane 1 4-7 twice */
    __m256i packed = _mm256_packus_epi32(r, r);
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));
}

static AVX2_TARGET Py_ssize_t fused_bfloat_avx2(uint16_t *dst, const uint16_t *a,
                                                const uint16_t *b, Py_ssize_t n, int op,
                                                float factor) {
    FUSED_LOOPS(widen8_bfloat, narrow8_bfloat)
}

/* The conversions and fused loops this processor can run (simd 0: the portable ones). */
static void choose_simd(int simd) {
    int f16c = simd && __builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c");
    widen_of[KIND_FLOAT16] = f16c ? widen_half_f16c : widen_half;
    narrow_of[KIND_FLOAT16] = f16c ? narrow_half_f16c : narrow_half;
    fused_of[KIND_FLOAT16] = f16c ? fused_half_f16c : NULL;
    fused_of[KIND_BFLOAT16] = simd && __builtin_cpu_supports("avx2") ? fused_bfloat_avx2
                                                                      : NULL;
}
#endif

/* x = x <op> y; NaN wins in MIN and MAX (numpy's minimum and maximum). */
VECTOR_CLONES static void combine(float *restrict x, const float *restrict y, Py_ssize_t n, int op) {
    Py_ssize_t i;
    switch (op) {
    case OP_SUM:
        for (i = 0; i < n; i++)
            x[i] = x[i] + y[i];
        break;
    case OP_PRODUCT:
        for (i = 0; i < n; i++)
            x[i] = x[i] * y[i];
        break;
    case OP_MIN:
        for (i = 0; i < n; i++)
            x[i] = (x[i] <= y[i] || x[i] != x[i]) ? x[i] : y[i];
        break;
    default:
        for (i = 0; i < n; i++)
            x[i] = (x[i] >= y[i] || x[i] != x[i]) ? x[i] : y[i];
        break;
    }
}

VECTOR_CLONES static void scale_block(float *x, Py_ssize_t n, float factor) {
    for (Py_ssize_t i = 0; i < n; i++)
        x[i] *= factor;
}

/* dst = the chosen element of a or b, bit for bit (a signaling NaN stays one): MIN and
 * MAX without a factor. x and y are a and b widened. */
VECTOR_CLONES static void pick(uint16_t *dst, const uint16_t *a, const uint16_t *b,
                               const float *x, const float *y, Py_ssize_t n, int op) {
    Py_ssize_t i;
    if (op == OP_MIN) {
        for (i = 0; i < n; i++)
            dst[i] = (x[i] <= y[i] || x[i] != x[i]) ? a[i] : b[i];
    } else {
        for (i = 0; i < n; i++)
            dst[i] = (x[i] >= y[i] || x[i] != x[i]) ? a[i] : b[i];
    }
}

/* dst = (a <op> b) * factor, or dst = a * factor when b is NULL; block by block, each
 * element read before it is written, so dst may be a or b. */
static void reduce_blocks(uint16_t *dst, const uint16_t *a, const uint16_t *b,
                          Py_ssize_t n, int kind, int op, float factor) {
    float x[BLOCK], y[BLOCK];
    widen_fn widen = widen_of[kind];
    narrow_fn narrow = narrow_of[kind];
    int picks = b != NULL && factor == 1.0f && (op == OP_MIN || op == OP_MAX);
    Py_ssize_t start = 0;
    if (fused_of[kind] != NULL)
        start = fused_of[kind](dst, a, b, n, op, factor);
    for (; start < n; start += BLOCK) {
        Py_ssize_t m = n - start < BLOCK ? n - start : BLOCK;
        widen(x, a + start, m);
        if (picks) {
            widen(y, b + start, m);
            pick(dst + start, a + start, b + start, x, y, m, op);
            continue;
        }
        if (b != NULL) {
            widen(y, b + start, m);
            combine(x, y, m, op);
            if (factor != 1.0f) { /* round the reduction first, as numpy does */
                narrow(dst + start, x, m);
                widen(x, dst + start, m);
            }
        }
        if (factor != 1.0f)
            scale_block(x, m, factor);
        narrow(dst + start, x, m);
    }
}

/* Borrow 2-byte-item C-contiguous buffers of equal length (dst writable); 1 on
 * success, 0 if they do not qualify (nothing held, no exception). */
static int borrow16(PyObject *objs[3], Py_buffer views[3], int count) {
    int held;
    for (held = 0; held < count; held++) {
        int flags = PyBUF_C_CONTIGUOUS | (held == 0 ? PyBUF_WRITABLE : 0);
        if (PyObject_GetBuffer(objs[held], &views[held], flags) < 0) {
            PyErr_Clear();
            break;
        }
        if (views[held].itemsize != 2 || views[held].len != views[0].len) {
            held++;
            break;
        }
    }
    if (held == count && views[count - 1].itemsize == 2 &&
        views[count - 1].len == views[0].len)
        return 1;
    while (held > 0)
        PyBuffer_Release(&views[--held]);
    return 0;
}

static PyObject *run16(PyObject *objs[3], int count, int kind, int op, double factor) {
    Py_buffer views[3];
    if (kind != KIND_FLOAT16 && kind != KIND_BFLOAT16) {
        PyErr_Format(PyExc_ValueError, "kind must be %d (float16) or %d (bfloat16), got %d",
                     KIND_FLOAT16, KIND_BFLOAT16, kind);
        return NULL;
    }
    if (op < OP_SUM || op > OP_MAX) {
        PyErr_Format(PyExc_ValueError, "op must be one of %d..%d, got %d", OP_SUM, OP_MAX, op);
        return NULL;
    }
    if (!borrow16(objs, views, count))
        Py_RETURN_FALSE;
    Py_ssize_t n = views[0].len / 2;
    PyThreadState *saved = views[0].len >= RELEASE_BYTES ? PyEval_SaveThread() : NULL;
    reduce_blocks(views[0].buf, views[1].buf, count == 3 ? views[2].buf : NULL, n, kind,
                  op, (float)factor);
    if (saved != NULL)
        PyEval_RestoreThread(saved);
    for (int i = 0; i < count; i++)
        PyBuffer_Release(&views[i]);
    Py_RETURN_TRUE;
}

static PyObject *reduce16(PyObject *self, PyObject *args) {
    PyObject *objs[3];
    int kind, op;
    double factor;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOOiid:reduce16", &objs[0], &objs[1], &objs[2], &kind, &op,
                          &factor))
        return NULL;
    return run16(objs, 3, kind, op, factor);
}

static PyObject *scale16(PyObject *self, PyObject *args) {
    PyObject *objs[3] = {NULL, NULL, NULL};
    int kind;
    double factor;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOid:scale16", &objs[0], &objs[1], &kind, &factor))
        return NULL;
    return run16(objs, 2, kind, OP_SUM, factor);
}

static PyObject *convert16(PyObject *self, PyObject *args) {
    PyObject *dst, *src;
    Py_buffer to, from;
    int kind;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOi:convert16", &dst, &src, &kind))
        return NULL;
    if (kind != KIND_FLOAT16 && kind != KIND_BFLOAT16) {
        PyErr_Format(PyExc_ValueError, "kind must be %d (float16) or %d (bfloat16), got %d",
                     KIND_FLOAT16, KIND_BFLOAT16, kind);
        return NULL;
    }
    if (PyObject_GetBuffer(dst, &to, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) {
        PyErr_Clear();
        Py_RETURN_FALSE;
    }
    if (PyObject_GetBuffer(src, &from, PyBUF_C_CONTIGUOUS) < 0) {
        PyErr_Clear();
        PyBuffer_Release(&to);
        Py_RETURN_FALSE;
    }
    int widens = to.itemsize == 4 && from.itemsize == 2;
    int narrows = to.itemsize == 2 && from.itemsize == 4;
    Py_ssize_t n = to.len / (to.itemsize ? to.itemsize : 1);
    int ok = (widens || narrows) && from.len / from.itemsize == n;
    if (ok) {
        PyThreadState *saved = to.len >= RELEASE_BYTES ? PyEval_SaveThread() : NULL;
        if (widens)
            widen_of[kind](to.buf, from.buf, n);
        else
            narrow_of[kind](to.buf, from.buf, n);
        if (saved != NULL)
            PyEval_RestoreThread(saved);
    }
    PyBuffer_Release(&from);
    PyBuffer_Release(&to);
    return PyBool_FromLong(ok);
}

/* ---- reading peers' memory ------------------------------------------------------ */

static PyObject *vm_read(PyObject *self, PyObject *args) {
    int pid;
    PyObject *local;
    unsigned long long address;
    Py_buffer view;
    int err = 0;
    (void)self;
    if (!PyArg_ParseTuple(args, "iOK:vm_read", &pid, &local, &address))
        return NULL;
    if (PyObject_GetBuffer(local, &view, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0)
        return NULL;
#ifdef __linux__
    char *at = view.buf;
    size_t left = (size_t)view.len;
    uintptr_t from = (uintptr_t)address;
    PyThreadState *saved = view.len >= RELEASE_BYTES ? PyEval_SaveThread() : NULL;
    while (left > 0) {
        struct iovec mine = {at, left}, theirs = {(void *)from, left};
        ssize_t got = process_vm_readv(pid, &mine, 1, &theirs, 1, 0);
        if (got <= 0) {
            err = got < 0 ? errno : EFAULT;
            break;
        }
        at += got;
        from += (uintptr_t)got;
        left -= (size_t)got;
    }
    if (saved != NULL)
        PyEval_RestoreThread(saved);
#else
    (void)pid;
    (void)address;
    err = view.len > 0 ? ENOSYS : 0;
#endif
    PyBuffer_Release(&view);
    if (err) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_RETURN_NONE;
}

static PyObject *allow_peers(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
#if defined(__linux__) && defined(PR_SET_PTRACER)
    return PyBool_FromLong(prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0) == 0);
#else
    Py_RETURN_FALSE;
#endif
}

/* ---- the shared-memory barrier -------------------------------------------------- */

/* Counters(words, rank, size): this rank's view of the counters and fingerprints at the
 * head of the shared window (mpitrain/comm/shm.py): int64 words, the size counters,
 * then the size fingerprints of parity 0 and the size of parity 1.
 *
 *   agree(t, fingerprint, polls) -> 1, 0 or -1
 *
 * stores fingerprint in this rank's word of parity t % 2, arrives at barrier t (its
 * counter = t, a release store: whatever this process stored before is visible to a
 * rank that sees the counter) and tests up to 1 + polls times whether every counter is
 * at least t (acquire loads: whatever a rank stored before arriving is visible after).
 * It returns 1 when every rank has arrived and published this fingerprint, 0 when some
 * fingerprint differs, -1 when some rank has not arrived yet (the caller waits for it,
 * then compares). It keeps the GIL: polls bounds how long it spins. */
typedef struct {
    PyObject_HEAD
    Py_buffer view;
    int64_t *words;
    Py_ssize_t rank, size;
} Counters;

static int counters_init(Counters *self, PyObject *args, PyObject *kwds) {
    static char *names[] = {"words", "rank", "size", NULL};
    PyObject *words;
    Py_ssize_t rank, size;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "Onn:Counters", names, &words, &rank, &size))
        return -1;
    if (self->words != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "Counters is already initialized");
        return -1;
    }
    if (PyObject_GetBuffer(words, &self->view, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0)
        return -1;
    if (size < 1 || rank < 0 || rank >= size || self->view.len < 3 * size * 8 ||
        (uintptr_t)self->view.buf % 8 != 0) {
        PyErr_Format(PyExc_ValueError,
                     "Counters needs 3 * size aligned int64 words and 0 <= rank < size; got "
                     "%zd bytes, rank %zd, size %zd", self->view.len, rank, size);
        PyBuffer_Release(&self->view);
        return -1;
    }
    self->words = self->view.buf;
    self->rank = rank;
    self->size = size;
    return 0;
}

static void counters_dealloc(Counters *self) {
    if (self->words != NULL)
        PyBuffer_Release(&self->view);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static inline void cpu_relax(void) {
#ifdef HAVE_X86
    _mm_pause();
#endif
}

static PyObject *counters_agree(Counters *self, PyObject *const *args, Py_ssize_t nargs) {
    if (self->words == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "Counters is not initialized");
        return NULL;
    }
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError, "agree(t, fingerprint, polls) takes 3 arguments, %zd given",
                     nargs);
        return NULL;
    }
    long long t = PyLong_AsLongLong(args[0]);
    if (t == -1 && PyErr_Occurred())
        return NULL;
    long long fingerprint = PyLong_AsLongLong(args[1]);
    if (fingerprint == -1 && PyErr_Occurred())
        return NULL;
    Py_ssize_t polls = PyLong_AsSsize_t(args[2]);
    if (polls == -1 && PyErr_Occurred())
        return NULL;
    int64_t *counters = self->words, n = self->size;
    int64_t *fingerprints = counters + n + (t & 1) * n;
    fingerprints[self->rank] = fingerprint;
    __atomic_store_n(&counters[self->rank], (int64_t)t, __ATOMIC_RELEASE);
    for (Py_ssize_t poll = 0;; poll++) {
        Py_ssize_t q = 0;
        while (q < n && __atomic_load_n(&counters[q], __ATOMIC_ACQUIRE) >= t)
            q++;
        if (q == n)
            break;
        if (poll >= polls)
            return PyLong_FromLong(-1);
        cpu_relax();
    }
    for (Py_ssize_t q = 0; q < n; q++)
        if (fingerprints[q] != fingerprint)
            return PyLong_FromLong(0);
    return PyLong_FromLong(1);
}

static PyMethodDef counters_methods[] = {
    {"agree", (PyCFunction)(void (*)(void))counters_agree, METH_FASTCALL,
     "agree(t, fingerprint, polls) -> int: publish fingerprint for barrier t, arrive at "
     "it and test up to 1 + polls times whether every rank has: 1 if all have and agree, "
     "0 if all have and some fingerprint differs, -1 if some rank has not arrived."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject CountersType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "mpitrain.backends._hostcopy.Counters",
    .tp_basicsize = sizeof(Counters),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Counters(words, rank, size): the shared-memory barrier's counters and "
              "fingerprints (a writable buffer of 3 * size int64 words), seen by rank.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)counters_init,
    .tp_dealloc = (destructor)counters_dealloc,
    .tp_methods = counters_methods,
};

/* Test hook: reduce and convert 16-bit floats with the processor's SIMD instructions
 * (1: F16C and AVX2 where it has them) or with the portable code (0); returns whether
 * any SIMD path was in use. */
static PyObject *use_simd(PyObject *self, PyObject *arg) {
    (void)self;
    int want = PyObject_IsTrue(arg);
    if (want < 0)
        return NULL;
    int was = widen_of[KIND_FLOAT16] != widen_half || fused_of[KIND_BFLOAT16] != NULL;
#ifdef HAVE_X86
    choose_simd(want);
#endif
    return PyBool_FromLong(was);
}

#ifdef HAVE_DOORBELL
/* ---- the async engine's doorbell ------------------------------------------------ */

/* Doorbell(): where the async engine's progress thread sleeps (mpitrain/engine/engine.py),
 * with the GIL released from the moment it sleeps until it knows it has work.
 *
 *   ring(settle)             wake the sleeper, or make its next sleep return at once;
 *                            settle: a submission, which its caller may run itself
 *   taken()                  a caller took all the work rung for so far
 *   sleep(timeout, settle_s) -> bool: wait for a ring (timeout < 0: for ever); False if
 *                            the timeout passed without one
 *
 * Woken by rings that all asked to settle, the sleeper waits settle_s more (still
 * without the GIL) and, if a caller has taken all the work rung for by then, sleeps on
 * instead of coming back; a ring without settle wakes it for good. A condition
 * variable's waiter takes the GIL the moment it is woken: woken by a submission whose
 * caller then waits for it, running the engine's cycle on its own thread, the progress
 * thread would take the GIL from that caller in mid-cycle (at every call that releases
 * it) only to find the work gone. */
typedef struct {
    PyObject_HEAD
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int ready;
    int rung;    /* a ring since the sleeper last looked */
    int urgent;  /* a ring without settle since then */
    int taken;   /* a caller took all the work rung for */
} Doorbell;

static int doorbell_init(Doorbell *self, PyObject *args, PyObject *kwds) {
    static char *names[] = {NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, ":Doorbell", names))
        return -1;
    if (self->ready) {
        PyErr_SetString(PyExc_RuntimeError, "Doorbell is already initialized");
        return -1;
    }
    pthread_condattr_t attr;
    if (pthread_condattr_init(&attr) != 0) {
        PyErr_SetString(PyExc_OSError, "Doorbell: cannot make a condition variable");
        return -1;
    }
    int made = pthread_condattr_setclock(&attr, CLOCK_MONOTONIC) == 0 &&
               pthread_cond_init(&self->cv, &attr) == 0;
    pthread_condattr_destroy(&attr);
    if (!made) {
        PyErr_SetString(PyExc_OSError, "Doorbell: cannot make a condition variable");
        return -1;
    }
    if (pthread_mutex_init(&self->mu, NULL) != 0) {
        pthread_cond_destroy(&self->cv);
        PyErr_SetString(PyExc_OSError, "Doorbell: cannot make a mutex");
        return -1;
    }
    self->ready = 1;
    return 0;
}

static void doorbell_dealloc(Doorbell *self) {
    if (self->ready) {
        pthread_cond_destroy(&self->cv);
        pthread_mutex_destroy(&self->mu);
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int doorbell_check(Doorbell *self) {
    if (!self->ready)
        PyErr_SetString(PyExc_RuntimeError, "Doorbell is not initialized");
    return self->ready;
}

static PyObject *doorbell_ring(Doorbell *self, PyObject *settle) {
    if (!doorbell_check(self))
        return NULL;
    int want = PyObject_IsTrue(settle);
    if (want < 0)
        return NULL;
    pthread_mutex_lock(&self->mu);
    self->rung = 1;
    if (!want)
        self->urgent = 1;
    self->taken = 0;
    pthread_cond_signal(&self->cv);
    pthread_mutex_unlock(&self->mu);
    Py_RETURN_NONE;
}

static PyObject *doorbell_taken(Doorbell *self, PyObject *unused) {
    (void)unused;
    if (!doorbell_check(self))
        return NULL;
    pthread_mutex_lock(&self->mu);
    self->taken = 1;
    pthread_mutex_unlock(&self->mu);
    Py_RETURN_NONE;
}

static struct timespec after(const struct timespec *from, double seconds) {
    struct timespec t = *from;
    double whole = (double)(int64_t)seconds;
    t.tv_sec += (time_t)whole;
    t.tv_nsec += (long)((seconds - whole) * 1e9);
    if (t.tv_nsec >= 1000000000L) {
        t.tv_sec++;
        t.tv_nsec -= 1000000000L;
    }
    return t;
}

static PyObject *doorbell_sleep(Doorbell *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "sleep(timeout, settle_s) takes 2 arguments");
        return NULL;
    }
    if (!doorbell_check(self))
        return NULL;
    double timeout = PyFloat_AsDouble(args[0]);
    if (timeout == -1.0 && PyErr_Occurred())
        return NULL;
    double settle_s = PyFloat_AsDouble(args[1]);
    if (settle_s == -1.0 && PyErr_Occurred())
        return NULL;
    int rung = 1;
    Py_BEGIN_ALLOW_THREADS
    struct timespec now, end;
    clock_gettime(CLOCK_MONOTONIC, &now);
    end = after(&now, timeout < 0 ? 0 : timeout);
    pthread_mutex_lock(&self->mu);
    for (;;) {
        while (!self->rung) {
            if (timeout < 0) {
                pthread_cond_wait(&self->cv, &self->mu);
            } else if (pthread_cond_timedwait(&self->cv, &self->mu, &end) == ETIMEDOUT &&
                       !self->rung) {
                rung = 0;
                break;
            }
        }
        if (!rung)
            break;
        self->rung = 0;
        if (self->urgent || settle_s <= 0)
            break;
        pthread_mutex_unlock(&self->mu);
        clock_gettime(CLOCK_MONOTONIC, &now);
        struct timespec pause = after(&now, settle_s);
        while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &pause, NULL) == EINTR)
            ;
        pthread_mutex_lock(&self->mu);
        if (self->urgent || !self->taken)
            break;  /* work nobody took, or a ring that asks for the thread: go and look */
    }
    self->urgent = 0;
    pthread_mutex_unlock(&self->mu);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(rung);
}

static PyMethodDef doorbell_methods[] = {
    {"ring", (PyCFunction)doorbell_ring, METH_O,
     "ring(settle): wake the sleeper, or make its next sleep return at once; settle: the "
     "ring is a submission that its caller may run itself."},
    {"taken", (PyCFunction)doorbell_taken, METH_NOARGS,
     "taken(): a caller took all the work rung for so far."},
    {"sleep", (PyCFunction)(void (*)(void))doorbell_sleep, METH_FASTCALL,
     "sleep(timeout, settle_s) -> bool: without the GIL, wait for a ring (timeout < 0: for "
     "ever; False on a timeout); after rings that all asked to settle, wait settle_s more "
     "and sleep on if a caller took all the work meanwhile."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject DoorbellType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "mpitrain.backends._hostcopy.Doorbell",
    .tp_basicsize = sizeof(Doorbell),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Doorbell(): where the async engine's progress thread sleeps without the GIL.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)doorbell_init,
    .tp_dealloc = (destructor)doorbell_dealloc,
    .tp_methods = doorbell_methods,
};

#endif

static PyMethodDef methods[] = {
    {"gather", gather, METH_VARARGS,
     "gather(flat, parts) -> bool: copy the parts' bytes one after the other into flat "
     "(False, copying nothing, if they cannot be copied byte for byte)."},
    {"scatter", scatter, METH_VARARGS,
     "scatter(flat, parts) -> bool: copy consecutive ranges of flat's bytes into the "
     "parts (False, copying nothing, if they cannot be copied byte for byte)."},
    {"reduce16", reduce16, METH_VARARGS,
     "reduce16(dst, a, b, kind, op, factor) -> bool: dst = (a <op> b) * factor for "
     "float16 or bfloat16 held in uint16 arrays (False, writing nothing, if the buffers "
     "do not qualify)."},
    {"scale16", scale16, METH_VARARGS,
     "scale16(dst, src, kind, factor) -> bool: dst = src * factor for float16 or "
     "bfloat16 held in uint16 arrays (False, writing nothing, if the buffers do not "
     "qualify)."},
    {"convert16", convert16, METH_VARARGS,
     "convert16(dst, src, kind) -> bool: dst = src between float32 and float16 or "
     "bfloat16 held in uint16 arrays, rounded to nearest even (False, writing nothing, if "
     "the buffers do not qualify)."},
    {"vm_read", vm_read, METH_VARARGS,
     "vm_read(pid, local, address): read len(local) bytes of process pid at address into "
     "the writable buffer local (process_vm_readv; OSError if the kernel refuses)."},
    {"allow_peers", allow_peers, METH_NOARGS,
     "allow_peers() -> bool: prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY), which lets the "
     "user's other processes read this one's memory under Yama's ptrace_scope 1."},
    {"use_simd", use_simd, METH_O,
     "use_simd(flag) -> bool: reduce and convert 16-bit floats with F16C/AVX2 where the "
     "processor has them, or with the portable code (a test hook); returns whether a "
     "SIMD path was in use."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_hostcopy",
    "Host gather/scatter and 16-bit float reductions (see hostcopy.py).",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__hostcopy(void) {
#ifdef HAVE_X86
    __builtin_cpu_init();
    choose_simd(1);
#endif
    if (PyType_Ready(&CountersType) < 0)
        return NULL;
#ifdef HAVE_DOORBELL
    if (PyType_Ready(&DoorbellType) < 0)
        return NULL;
#endif
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&CountersType);
    if (PyModule_AddObject(m, "Counters", (PyObject *)&CountersType) < 0) {
        Py_DECREF(&CountersType);
        Py_DECREF(m);
        return NULL;
    }
#ifdef HAVE_DOORBELL
    Py_INCREF(&DoorbellType);
    if (PyModule_AddObject(m, "Doorbell", (PyObject *)&DoorbellType) < 0) {
        Py_DECREF(&DoorbellType);
        Py_DECREF(m);
        return NULL;
    }
#endif
    if (PyModule_AddStringConstant(m, "SOURCE_SHA256", SOURCE_SHA256) < 0 ||
        PyModule_AddIntConstant(m, "KIND_FLOAT16", KIND_FLOAT16) < 0 ||
        PyModule_AddIntConstant(m, "KIND_BFLOAT16", KIND_BFLOAT16) < 0 ||
        PyModule_AddIntConstant(m, "OP_SUM", OP_SUM) < 0 ||
        PyModule_AddIntConstant(m, "OP_PRODUCT", OP_PRODUCT) < 0 ||
        PyModule_AddIntConstant(m, "OP_MIN", OP_MIN) < 0 ||
        PyModule_AddIntConstant(m, "OP_MAX", OP_MAX) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
