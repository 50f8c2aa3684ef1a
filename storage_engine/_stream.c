/* Streaming (non-temporal) copies for the store's write paths.
 *
 * A store write copies bytes that no one reads soon after: a commit's extents, a KV
 * block. Ordinary stores first read every destination line into cache (read for
 * ownership) and evict useful lines for it; non-temporal stores write around the cache.
 * glibc's memcpy switches to them only above a threshold derived from the cache size,
 * which on some hosts lies above any extent we write in one call, so the store calls
 * this instead for copies of its own (measured on a 2-core host: 1 MiB pieces at
 * 9 GB/s with memcpy, 16 GB/s streamed).
 *
 * stream_copy(dst, src): dst a writable contiguous buffer, src a contiguous buffer of
 * the same length; the GIL is released during the copy. On CPUs other than x86-64 it
 * is memcpy.
 *
 * stream_copy_hash(dst, src): the same, returning the xxh3-64 of src, computed in the
 * same pass: each small piece is hashed (which brings it into L1) and then streamed
 * from there, so the bytes cross the memory bus once. The hash is XXH3 of the
 * vendored xxHash (storage_engine/xxhash), the release the xxhash package ships.
 *
 * copy_hash_many(dst, addrs, sizes, offsets, digests): stream_copy_hash of many
 * sources in one call, for commits of many small tensors (a Python call per tensor
 * was most of a 100,000-tensor commit): source i is the sizes[i] bytes at the raw
 * address addrs[i], copied to dst + offsets[i]; its xxh3-64 goes to digests[i]. addrs,
 * sizes, offsets and digests are uint64 buffers of one length. The caller keeps every
 * source alive and unchanged during the call; each destination range is checked
 * against dst's length before anything is copied. The GIL is released.
 *
 * pwrite_hash_many(fd, limit, addrs, sizes, offsets, digests): copy_hash_many into the
 * file open as fd instead of a mapping of it, with pwrite: for a fresh shared-memory
 * file the kernel then allocates each page as it is written, where a mapping would
 * first fault it in and zero it (and a page fault per page costs more than the
 * write). Each piece of a source is hashed, then written while it is in cache; small
 * sources are gathered into a piece-sized staging buffer first, so that a commit of
 * many small tensors costs a system call per piece, not per tensor. Sources are
 * written in the order given (ascending offsets gather best); every destination range
 * is checked against limit first. OSError with the errno of a failed write.
 *
 * pread_pwrite_hash(src_fd, dst_fd, limit, src_offsets, sizes, offsets, digests): the
 * same for sources that are byte ranges of the file open as src_fd (an import): each
 * piece is read into a staging buffer with pread, hashed there and written with pwrite,
 * both kernel copies from cache. Returns -1, or the index of the first source the file
 * ended inside (it shrank): nothing after it is written.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "_stream.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#define STREAMS 1
#else
#define STREAMS 0
#endif

/* whole 64-byte lines streamed, the rest copied; no fence: the caller fences once */
static void stream_lines(char *d, const char *s, size_t n) {
#if STREAMS
    if (n >= 128) {
        size_t head = (64 - ((uintptr_t)d & 63)) & 63;
        memcpy(d, s, head);
        d += head; s += head; n -= head;
        for (size_t blocks = n / 64; blocks; blocks--) {
            __m128i a = _mm_loadu_si128((const __m128i *)s);
            __m128i b = _mm_loadu_si128((const __m128i *)(s + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(s + 32));
            __m128i e = _mm_loadu_si128((const __m128i *)(s + 48));
            _mm_stream_si128((__m128i *)d, a);
            _mm_stream_si128((__m128i *)(d + 16), b);
            _mm_stream_si128((__m128i *)(d + 32), c);
            _mm_stream_si128((__m128i *)(d + 48), e);
            s += 64; d += 64;
        }
        n %= 64;
    }
#endif
    memcpy(d, s, n);
}

HIDDEN void fence(void) {
#if STREAMS
    _mm_sfence(); /* the streamed lines are visible before the caller publishes */
#endif
}

HIDDEN void stream_copy(char *d, const char *s, size_t n, size_t stream_min) {
    if (n < stream_min) {
        memcpy(d, s, n);
        return;
    }
    stream_lines(d, s, n);
    fence();
}

/* XXH3 from the vendored xxHash (storage_engine/xxhash, BSD-2, the release the xxhash
 * package ships, so the digests are its digests): inlined here, and its dispatching
 * entry points (xxh_x86dispatch.c), which pick the widest vector unit the CPU has
 * (AVX2, AVX-512; the plain entry points are the SSE2 build, a third of the speed) */
#define XXH_INLINE_ALL
#include "xxhash/xxhash.h"
#include "xxhash/xxh_x86dispatch.h"

static xxh128_t hash128(const void *p, size_t n) {
    XXH128_hash_t h = XXH3_128bits_dispatch(p, n);
    xxh128_t out = {h.low64, h.high64};
    return out;
}
HIDDEN oneshot128_fn xxh_oneshot128 = hash128; /* XXH3_128bits: the KV keys' Bloom filters */

HIDDEN int xxh_bound(void) { return 1; }
HIDDEN void *xxh_state_new(void) { return XXH3_createState(); }
HIDDEN void xxh_state_free(void *state) { XXH3_freeState((XXH3_state_t *)state); }
#define xxh_oneshot XXH3_64bits_dispatch /* small inputs hash faster without a state */
#define xxh_reset(st) XXH3_64bits_reset((XXH3_state_t *)(st))
#define xxh_update(st, p, n) XXH3_64bits_update_dispatch((XXH3_state_t *)(st), p, n)
#define xxh_digest(st) XXH3_64bits_digest((XXH3_state_t *)(st))
#define xxh_create() xxh_state_new()
#define xxh_free(st) xxh_state_free(st)

/* piece hashed then streamed while it is in L1 (4 KiB measured best, 16 KiB 6% slower) */
#define HASH_PIECE (4 * 1024)

static int same_length(Py_buffer *dst, Py_buffer *src, const char *what) {
    if (dst->len == src->len)
        return 1;
    PyErr_Format(PyExc_ValueError, "%s: dst holds %zd bytes, src %zd", what, dst->len,
                 src->len);
    PyBuffer_Release(dst);
    PyBuffer_Release(src);
    return 0;
}

/* one source: hashed piece by piece, each piece streamed (or copied, below stream_min)
 * while it is in L1; a small one hashed in one call */
HIDDEN uint64_t copy_hash_one(void *state, char *d, const char *s, size_t n,
                              size_t stream_min) {
    int streamed = n >= stream_min;
    /* up to STREAM_MIN the source stays in L2 between the hash and the copy: one call of
     * the one-shot hash (the streaming state's bookkeeping cost a quarter of an 8 KiB
     * block's read) */
    if (n < STREAM_MIN) {
        uint64_t h = xxh_oneshot(s, n);
        if (streamed)
            stream_lines(d, s, n);
        else
            memcpy(d, s, n);
        return h;
    }
    xxh_reset(state);
    for (size_t lo = 0; lo < n; lo += HASH_PIECE) {
        size_t m = n - lo < HASH_PIECE ? n - lo : HASH_PIECE;
        xxh_update(state, s + lo, m);
        if (streamed)
            stream_lines(d + lo, s + lo, m);
        else
            memcpy(d + lo, s + lo, m);
    }
    return xxh_digest(state);
}

HIDDEN uint64_t hash_only(void *state, const char *s, size_t n) {
    (void)state;
    return xxh_oneshot(s, n);
}

static PyObject *py_stream_copy_hash(PyObject *self, PyObject *args) {
    Py_buffer dst, src;
    (void)self;
    if (!PyArg_ParseTuple(args, "w*y*:stream_copy_hash", &dst, &src))
        return NULL;
    if (!same_length(&dst, &src, "stream_copy_hash"))
        return NULL;
    void *state = xxh_create();
    if (state == NULL) {
        PyBuffer_Release(&dst);
        PyBuffer_Release(&src);
        return PyErr_NoMemory();
    }
    uint64_t digest;
    Py_BEGIN_ALLOW_THREADS
    digest = copy_hash_one(state, (char *)dst.buf, (const char *)src.buf, (size_t)src.len,
                           STREAM_MIN);
    fence();
    xxh_free(state);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    return PyLong_FromUnsignedLongLong(digest);
}

static PyObject *py_copy_hash_many(PyObject *self, PyObject *args) {
    Py_buffer dst, addrs, sizes, offsets, digests;
    (void)self;
    if (!PyArg_ParseTuple(args, "w*y*y*y*w*:copy_hash_many", &dst, &addrs, &sizes,
                          &offsets, &digests))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t count = addrs.len / 8;
    if (addrs.len % 8 || sizes.len != addrs.len || offsets.len != addrs.len
            || digests.len != addrs.len) {
        PyErr_SetString(PyExc_ValueError,
                        "copy_hash_many: addrs, sizes, offsets and digests must be uint64 "
                        "buffers of one length");
        goto done;
    }
    const uint64_t *a = (const uint64_t *)addrs.buf;
    const uint64_t *z = (const uint64_t *)sizes.buf;
    const uint64_t *o = (const uint64_t *)offsets.buf;
    uint64_t *out = (uint64_t *)digests.buf;
    uint64_t limit = (uint64_t)dst.len;
    for (Py_ssize_t i = 0; i < count; i++) {
        if (o[i] > limit || z[i] > limit - o[i]) {
            PyErr_Format(PyExc_ValueError, "copy_hash_many: source %zd (%llu bytes at %llu) "
                         "does not fit the destination of %llu bytes", i,
                         (unsigned long long)z[i], (unsigned long long)o[i],
                         (unsigned long long)limit);
            goto done;
        }
    }
    void *state = xxh_create();
    if (state == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    char *d = (char *)dst.buf;
    for (Py_ssize_t i = 0; i < count; i++)
        out[i] = copy_hash_one(state, d + o[i], (const char *)(uintptr_t)a[i], (size_t)z[i],
                               STREAM_MIN);
    fence();
    Py_END_ALLOW_THREADS
    xxh_free(state);
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&dst);
    PyBuffer_Release(&addrs);
    PyBuffer_Release(&sizes);
    PyBuffer_Release(&offsets);
    PyBuffer_Release(&digests);
    return result;
}

/* bytes a piece of pwrite_hash_many / pread_pwrite_hash: hashed, then written while it
 * is in L2; a source below a quarter of it is gathered with others */
#define WRITE_PIECE (256 * 1024)

/* pwrite all n bytes at off: 0, or an errno */
static int pwrite_all(int fd, const char *s, size_t n, uint64_t off) {
    while (n) {
        ssize_t w = pwrite(fd, s, n, (off_t)off);
        if (w < 0) {
            if (errno == EINTR)
                continue;
            return errno;
        }
        if (w == 0)
            return ENOSPC;
        s += w; n -= (size_t)w; off += (uint64_t)w;
    }
    return 0;
}

/* a window of the destination file gathered in memory before one pwrite */
typedef struct {
    char *buf;
    uint64_t start; /* file offset of buf[0] */
    size_t len;     /* bytes of buf in use */
} window_t;

static int window_flush(int fd, window_t *w) {
    int err = w->len ? pwrite_all(fd, w->buf, w->len, w->start) : 0;
    w->len = 0;
    return err;
}

/* the widest gap a window pads with zeros between two sources: less than the extent
 * alignment (storage_engine._io.ALIGN), so the gap holds no other extent's bytes, which
 * another call (another I/O thread) may be writing */
#define GATHER_GAP 64

/* room in the window for n bytes at off (flushing it first if they do not fit, or lie
 * further than GATHER_GAP past its end): the address to write them to; the gap before
 * them is zeroed */
static char *window_place(int fd, window_t *w, uint64_t off, size_t n, int *err) {
    if (w->len && (off < w->start + w->len || off - (w->start + w->len) >= GATHER_GAP
                   || off + n > w->start + WRITE_PIECE)) {
        if ((*err = window_flush(fd, w)) != 0)
            return NULL;
    }
    if (!w->len)
        w->start = off;
    size_t at = (size_t)(off - w->start);
    memset(w->buf + w->len, 0, at - w->len);
    w->len = at + n;
    return w->buf + at;
}

static int check_ranges(const uint64_t *z, const uint64_t *o, Py_ssize_t count,
                        uint64_t limit, const char *what) {
    for (Py_ssize_t i = 0; i < count; i++) {
        if (o[i] > limit || z[i] > limit - o[i]) {
            PyErr_Format(PyExc_ValueError, "%s: source %zd (%llu bytes at %llu) does not "
                         "fit the destination of %llu bytes", what, i,
                         (unsigned long long)z[i], (unsigned long long)o[i],
                         (unsigned long long)limit);
            return 0;
        }
    }
    return 1;
}

static PyObject *py_pwrite_hash_many(PyObject *self, PyObject *args) {
    Py_buffer addrs, sizes, offsets, digests;
    int fd;
    unsigned long long limit;
    (void)self;
    if (!PyArg_ParseTuple(args, "iKy*y*y*w*:pwrite_hash_many", &fd, &limit, &addrs, &sizes,
                          &offsets, &digests))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t count = addrs.len / 8;
    if (addrs.len % 8 || sizes.len != addrs.len || offsets.len != addrs.len
            || digests.len != addrs.len) {
        PyErr_SetString(PyExc_ValueError,
                        "pwrite_hash_many: addrs, sizes, offsets and digests must be uint64 "
                        "buffers of one length");
        goto done;
    }
    const uint64_t *a = (const uint64_t *)addrs.buf;
    const uint64_t *z = (const uint64_t *)sizes.buf;
    const uint64_t *o = (const uint64_t *)offsets.buf;
    uint64_t *out = (uint64_t *)digests.buf;
    if (!check_ranges(z, o, count, (uint64_t)limit, "pwrite_hash_many"))
        goto done;
    void *state = xxh_create();
    window_t w = {malloc(WRITE_PIECE), 0, 0};
    if (state == NULL || w.buf == NULL) {
        if (state != NULL)
            xxh_free(state);
        free(w.buf);
        PyErr_NoMemory();
        goto done;
    }
    int err = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < count && !err; i++) {
        const char *s = (const char *)(uintptr_t)a[i];
        size_t n = (size_t)z[i];
        if (n < WRITE_PIECE / 4) { /* gathered: copied and hashed into the window */
            char *d = window_place(fd, &w, o[i], n, &err);
            if (d != NULL)
                out[i] = copy_hash_one(state, d, s, n, (size_t)-1);
            continue;
        }
        if ((err = window_flush(fd, &w)) != 0)
            break;
        xxh_reset(state);
        for (size_t lo = 0; lo < n && !err; lo += WRITE_PIECE) {
            size_t m = n - lo < WRITE_PIECE ? n - lo : WRITE_PIECE;
            xxh_update(state, s + lo, m); /* brings the piece into cache for the write */
            err = pwrite_all(fd, s + lo, m, o[i] + lo);
        }
        out[i] = xxh_digest(state);
    }
    if (!err)
        err = window_flush(fd, &w);
    Py_END_ALLOW_THREADS
    xxh_free(state);
    free(w.buf);
    if (err) {
        errno = err;
        PyErr_SetFromErrno(PyExc_OSError);
        goto done;
    }
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&addrs);
    PyBuffer_Release(&sizes);
    PyBuffer_Release(&offsets);
    PyBuffer_Release(&digests);
    return result;
}

/* pread n bytes at off into d: the bytes read (fewer at the end of the file), or
 * -errno */
static ssize_t pread_full(int fd, char *d, size_t n, uint64_t off) {
    size_t got = 0;
    while (got < n) {
        ssize_t r = pread(fd, d + got, n - got, (off_t)(off + got));
        if (r < 0) {
            if (errno == EINTR)
                continue;
            return -errno;
        }
        if (r == 0)
            break;
        got += (size_t)r;
    }
    return (ssize_t)got;
}

static PyObject *py_pread_pwrite_hash(PyObject *self, PyObject *args) {
    Py_buffer srcs, sizes, offsets, digests;
    int src_fd, fd;
    unsigned long long limit;
    (void)self;
    if (!PyArg_ParseTuple(args, "iiKy*y*y*w*:pread_pwrite_hash", &src_fd, &fd, &limit,
                          &srcs, &sizes, &offsets, &digests))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t count = srcs.len / 8;
    if (srcs.len % 8 || sizes.len != srcs.len || offsets.len != srcs.len
            || digests.len != srcs.len) {
        PyErr_SetString(PyExc_ValueError,
                        "pread_pwrite_hash: src_offsets, sizes, offsets and digests must be "
                        "uint64 buffers of one length");
        goto done;
    }
    const uint64_t *f = (const uint64_t *)srcs.buf;
    const uint64_t *z = (const uint64_t *)sizes.buf;
    const uint64_t *o = (const uint64_t *)offsets.buf;
    uint64_t *out = (uint64_t *)digests.buf;
    if (!check_ranges(z, o, count, (uint64_t)limit, "pread_pwrite_hash"))
        goto done;
    void *state = xxh_create();
    char *stage = malloc(WRITE_PIECE);
    window_t w = {malloc(WRITE_PIECE), 0, 0};
    if (state == NULL || stage == NULL || w.buf == NULL) {
        if (state != NULL)
            xxh_free(state);
        free(stage);
        free(w.buf);
        PyErr_NoMemory();
        goto done;
    }
    int err = 0;
    Py_ssize_t shrank = -1;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < count && !err && shrank < 0; i++) {
        size_t n = (size_t)z[i];
        if (n < WRITE_PIECE / 4) { /* read straight into the window */
            char *d = window_place(fd, &w, o[i], n, &err);
            if (d == NULL)
                break;
            ssize_t got = pread_full(src_fd, d, n, f[i]);
            if (got < 0)
                err = (int)-got;
            else if ((size_t)got < n)
                shrank = i;
            else
                out[i] = hash_only(state, d, n);
            continue;
        }
        if ((err = window_flush(fd, &w)) != 0)
            break;
        xxh_reset(state);
        for (size_t lo = 0; lo < n && !err; lo += WRITE_PIECE) {
            size_t m = n - lo < WRITE_PIECE ? n - lo : WRITE_PIECE;
            ssize_t got = pread_full(src_fd, stage, m, f[i] + lo);
            if (got < 0) {
                err = (int)-got;
                break;
            }
            if ((size_t)got < m) {
                shrank = i;
                break;
            }
            xxh_update(state, stage, m);
            err = pwrite_all(fd, stage, m, o[i] + lo);
        }
        out[i] = xxh_digest(state);
    }
    if (!err && shrank < 0)
        err = window_flush(fd, &w);
    Py_END_ALLOW_THREADS
    xxh_free(state);
    free(stage);
    free(w.buf);
    if (err) {
        errno = err;
        PyErr_SetFromErrno(PyExc_OSError);
        goto done;
    }
    result = PyLong_FromSsize_t(shrank);
done:
    PyBuffer_Release(&srcs);
    PyBuffer_Release(&sizes);
    PyBuffer_Release(&offsets);
    PyBuffer_Release(&digests);
    return result;
}

static PyObject *py_stream_copy(PyObject *self, PyObject *args) {
    Py_buffer dst, src;
    (void)self;
    if (!PyArg_ParseTuple(args, "w*y*:stream_copy", &dst, &src))
        return NULL;
    if (!same_length(&dst, &src, "stream_copy"))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    stream_copy((char *)dst.buf, (const char *)src.buf, (size_t)src.len, STREAM_MIN);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"stream_copy", py_stream_copy, METH_VARARGS,
     "stream_copy(dst, src): copy src into dst (same length) around the cache."},
    {"stream_copy_hash", py_stream_copy_hash, METH_VARARGS,
     "stream_copy_hash(dst, src) -> int: stream_copy, returning the xxh3-64 of src."},
    {"copy_hash_many", py_copy_hash_many, METH_VARARGS,
     "copy_hash_many(dst, addrs, sizes, offsets, digests): many stream_copy_hash calls."},
    {"pwrite_hash_many", py_pwrite_hash_many, METH_VARARGS,
     "pwrite_hash_many(fd, limit, addrs, sizes, offsets, digests): copy_hash_many with pwrite."},
    {"pread_pwrite_hash", py_pread_pwrite_hash, METH_VARARGS,
     "pread_pwrite_hash(src_fd, fd, limit, src_offsets, sizes, offsets, digests) -> int."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "storage_engine._stream", NULL, -1, methods, NULL, NULL, NULL,
    NULL,
};

PyMODINIT_FUNC PyInit__stream(void) {
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && kvindex_add_type(m) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
