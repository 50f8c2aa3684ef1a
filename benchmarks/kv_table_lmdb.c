/* An LMDB-indexed KV block store, for benchmarks/kv_table.py only: the alternative to
 * the native table of storage_engine/kv, measured against it.
 *
 * The values stay in slab files on tmpfs (fixed chunks of one size class a slab, the
 * size classes of storage_engine/kv/arena.c, files posix_fallocate'd and mapped
 * MAP_SHARED | MAP_POPULATE, as the real arena maps slabs whose pages exist); LMDB, in
 * the same directory, holds key (1 to 32 bytes) -> val_t (slab, chunk, the chunk's
 * generation, nbytes, xxh3-64). The copies hash as the real ones do (XXH3_64bits of the
 * source in one call, then memcpy, for blocks under 64 KiB), with the vendored xxHash's
 * dispatching entry points.
 *
 *   LmdbStore(root, capacity_bytes, slab_bytes, map_size, writemap)
 *   put_batch(keys, addrs, sizes) -> bytes (1 stored, 0 present: first writer wins)
 *       one write transaction: mdb_put(MDB_NOOVERWRITE | MDB_RESERVE) per key (one
 *       descent: present -> skipped; new -> a chunk, the copy + hash, the record), the
 *       touched slabs' allocator state (bump, free count) put in the same transaction,
 *       then the commit.
 *   read_into(keys, addrs, sizes, verify) -> (status bytes: 0 absent, 1 copied,
 *       2 corrupt, 3 moved while copied; index of a block of another size or -1)
 *       one read transaction (a handle kept and renewed): mdb_get, the chunk's
 *       generation checked before and after the copy (a seqlock on the chunk: LMDB's MVCC
 *       covers the index, not the slabs), the hash verified.
 *   match(keys) -> how many leading keys are present (one read transaction)
 *   delete(keys) -> how many were present (one write transaction; freed chunks get a new
 *       generation and go on their slab's free list)
 *   stats() -> dict: time in put_batch and in its commits, commits, LMDB pages
 *   close()
 *
 * The allocator's free lists live in this process (one writer process in the benchmark);
 * the writer lock that guards them is LMDB's (every change happens inside a write
 * transaction). The GIL is released around the work.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "lmdb.h"

#define XXH_INLINE_ALL
#include "xxhash/xxhash.h"
#include "xxhash/xxh_x86dispatch.h"

#include "kv/layout.h" /* KEYMAX, MIN_CHUNK, PAGE and the size classes: the store's own */
#undef MAX_SLABS
#define MAX_SLABS 4096

typedef struct {
    uint32_t slab, chunk, gen, pad;
    uint64_t nbytes, csum;
} val_t;

typedef struct {
    uint64_t bump, used; /* the allocator state LMDB holds for the slab */
} slabrec_t;

typedef struct {
    char *base;          /* the mapping: gens (uint32 a chunk, rounded to pages), chunks */
    uint32_t *gens;
    char *chunks;
    uint64_t csize, nchunks, bump, used;
    uint32_t *free_list; /* a stack of free chunks */
    uint64_t nfree;
    int touched;
} lslab_t;

typedef struct {
    PyObject_HEAD
    MDB_env *env;
    MDB_dbi dbi, sdbi;
    char root[3072];
    uint64_t capacity, slab_bytes, arena;
    lslab_t *slabs;
    uint32_t nslabs;
    MDB_txn *rtxn; /* a read transaction kept reset between calls (NULL: in use) */
    uint64_t put_ns, commit_ns, commits, puts;
} Store;

static uint64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec;
}

static PyObject *lmdb_error(int rc, const char *what) {
    PyErr_Format(PyExc_OSError, "%s: %s", what, mdb_strerror(rc));
    return NULL;
}

/* ---------------------------------------------------------------------------------- */
/* keys and arrays */

typedef struct {
    uint8_t (*k)[KEYMAX + 1]; /* [0]: the length */
    Py_ssize_t n;
} keys_t;

static int parse_keys(PyObject *o, keys_t *ks) {
    PyObject *fast = PySequence_Fast(o, "keys must be a sequence of bytes");
    if (fast == NULL)
        return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    if (n < 0 || n > (1 << 28)) {
        Py_DECREF(fast);
        PyErr_SetString(PyExc_ValueError, "too many keys");
        return -1;
    }
    ks->n = n;
    ks->k = PyMem_Malloc((size_t)(n ? n : 1) * sizeof *ks->k);
    if (ks->k == NULL) {
        Py_DECREF(fast);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *b = PySequence_Fast_GET_ITEM(fast, i);
        if (!PyBytes_Check(b) || PyBytes_GET_SIZE(b) < 1 || PyBytes_GET_SIZE(b) > KEYMAX) {
            PyErr_Format(PyExc_ValueError, "key %zd must be 1 to %d bytes", i, KEYMAX);
            PyMem_Free(ks->k);
            Py_DECREF(fast);
            return -1;
        }
        ks->k[i][0] = (uint8_t)PyBytes_GET_SIZE(b);
        memcpy(ks->k[i] + 1, PyBytes_AS_STRING(b), ks->k[i][0]);
    }
    Py_DECREF(fast);
    return 0;
}

static int u64_array(PyObject *o, Py_buffer *b, Py_ssize_t n, const char *what) {
    if (PyObject_GetBuffer(o, b, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return -1;
    if (b->itemsize != 8 || b->len != n * 8) {
        PyErr_Format(PyExc_ValueError, "%s: %zd uint64 wanted", what, n);
        PyBuffer_Release(b);
        return -1;
    }
    return 0;
}

static int parse_batch(PyObject *ko, PyObject *ao, PyObject *so, keys_t *ks, Py_buffer *ab,
                       Py_buffer *sb) {
    if (parse_keys(ko, ks) < 0)
        return -1;
    if (u64_array(ao, ab, ks->n, "addrs") < 0) {
        PyMem_Free(ks->k);
        return -1;
    }
    if (u64_array(so, sb, ks->n, "sizes") < 0) {
        PyBuffer_Release(ab);
        PyMem_Free(ks->k);
        return -1;
    }
    return 0;
}

static void release_batch(keys_t *ks, Py_buffer *ab, Py_buffer *sb) {
    PyBuffer_Release(ab);
    PyBuffer_Release(sb);
    PyMem_Free(ks->k);
}

/* ---------------------------------------------------------------------------------- */
/* the arena */

/* (in a write transaction) a new slab of chunks of csize; -1 and errno on failure */
static int slab_new(Store *s, uint64_t csize, uint32_t *out) {
    if (s->nslabs >= MAX_SLABS || s->arena + s->slab_bytes > s->capacity) {
        errno = ENOSPC;
        return -1;
    }
    uint64_t per = s->slab_bytes < csize ? csize : s->slab_bytes;
    /* gens first (4 bytes a chunk, whole pages), then the chunks */
    uint64_t n = per / csize;
    while (n > 1 && (n * 4 + PAGE - 1) / PAGE * PAGE + n * csize > per)
        n--;
    uint64_t head = (n * 4 + PAGE - 1) / PAGE * PAGE;
    uint64_t bytes = head + n * csize;
    char path[3200];
    snprintf(path, sizeof path, "%s/slabs/%04u.slab", s->root, s->nslabs);
    int fd = open(path, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0)
        return -1;
    int e = posix_fallocate(fd, 0, (off_t)bytes);
    if (e != 0) {
        close(fd);
        unlink(path);
        errno = e;
        return -1;
    }
    char *base = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (base == MAP_FAILED)
        return -1;
    /* the page tables in one call, as the real arena makes a fresh slab's pages (no
     * fault per page in the copies); MAP_POPULATE measured 20 % slower here */
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif
    (void)madvise(base, bytes, MADV_POPULATE_WRITE);
    lslab_t *sl = &s->slabs[s->nslabs];
    memset(sl, 0, sizeof *sl);
    sl->free_list = malloc(sizeof(uint32_t) * n);
    if (sl->free_list == NULL) {
        munmap(base, bytes);
        errno = ENOMEM;
        return -1;
    }
    sl->base = base;
    sl->gens = (uint32_t *)base;
    sl->chunks = base + head;
    sl->csize = csize;
    sl->nchunks = n;
    *out = s->nslabs++;
    s->arena += s->slab_bytes;
    return 0;
}

static uint64_t slab_map_bytes(const lslab_t *sl) {
    return (sl->nchunks * 4 + PAGE - 1) / PAGE * PAGE + sl->nchunks * sl->csize;
}

/* (in a write transaction) a chunk of csize: from a free list, a slab's untouched end, or
 * a new slab. hint: the slab the last allocation used. -1: no room */
static int chunk_alloc(Store *s, uint64_t csize, uint32_t *hint, uint32_t *slab,
                       uint32_t *chunk) {
    for (uint32_t t = 0; t <= s->nslabs; t++) {
        uint32_t i = t == 0 ? *hint : t - 1;
        if (i >= s->nslabs)
            continue;
        lslab_t *sl = &s->slabs[i];
        if (sl->csize != csize)
            continue;
        if (sl->nfree) {
            *chunk = sl->free_list[--sl->nfree];
        } else if (sl->bump < sl->nchunks) {
            *chunk = (uint32_t)sl->bump++;
        } else {
            continue;
        }
        sl->used++;
        sl->touched = 1;
        *slab = *hint = i;
        return 0;
    }
    uint32_t i;
    if (slab_new(s, csize, &i) < 0)
        return -1;
    lslab_t *sl = &s->slabs[i];
    *chunk = (uint32_t)sl->bump++;
    sl->used++;
    sl->touched = 1;
    *slab = *hint = i;
    return 0;
}

static void chunk_free(Store *s, uint32_t slab, uint32_t chunk) {
    lslab_t *sl = &s->slabs[slab];
    /* a new generation first: a reader that copied it meanwhile sees it moved */
    __atomic_store_n(&sl->gens[chunk], sl->gens[chunk] + 1, __ATOMIC_RELEASE);
    sl->free_list[sl->nfree++] = chunk;
    sl->used--;
    sl->touched = 1;
}

/* (in a write transaction) the touched slabs' allocator state, into LMDB */
static int put_slab_state(Store *s, MDB_txn *txn) {
    for (uint32_t i = 0; i < s->nslabs; i++) {
        lslab_t *sl = &s->slabs[i];
        if (!sl->touched)
            continue;
        sl->touched = 0;
        slabrec_t rec = {sl->bump, sl->used};
        MDB_val k = {sizeof i, &i}, v = {sizeof rec, &rec};
        int rc = mdb_put(txn, s->sdbi, &k, &v, 0);
        if (rc != 0)
            return rc;
    }
    return 0;
}

/* ---------------------------------------------------------------------------------- */
/* read transactions: one kept, reset between calls, renewed (a second concurrent caller
 * begins one of its own) */

static int rtxn_take(Store *s, MDB_txn **out) {
    MDB_txn *t = __atomic_exchange_n(&s->rtxn, NULL, __ATOMIC_ACQ_REL);
    if (t != NULL) {
        int rc = mdb_txn_renew(t);
        if (rc == 0) {
            *out = t;
            return 0;
        }
        mdb_txn_abort(t);
    }
    return mdb_txn_begin(s->env, NULL, MDB_RDONLY, out);
}

static void rtxn_give(Store *s, MDB_txn *t) {
    mdb_txn_reset(t);
    MDB_txn *none = NULL;
    if (!__atomic_compare_exchange_n(&s->rtxn, &none, t, 0, __ATOMIC_ACQ_REL,
                                     __ATOMIC_ACQUIRE))
        mdb_txn_abort(t);
}

/* ---------------------------------------------------------------------------------- */

static int Store_init(Store *s, PyObject *args, PyObject *kw) {
    static char *names[] = {"root", "capacity_bytes", "slab_bytes", "map_size", "writemap",
                            NULL};
    const char *root;
    unsigned long long cap, slab, map;
    int writemap = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "sKKK|p", names, &root, &cap, &slab, &map,
                                     &writemap))
        return -1;
    if (strlen(root) > sizeof s->root - 64 || slab < PAGE || cap < slab) {
        PyErr_SetString(PyExc_ValueError, "bad root, capacity or slab size");
        return -1;
    }
    snprintf(s->root, sizeof s->root, "%s", root);
    s->capacity = cap;
    s->slab_bytes = slab;
    s->slabs = calloc(MAX_SLABS, sizeof(lslab_t));
    if (s->slabs == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    char path[3200];
    snprintf(path, sizeof path, "%s/slabs", root);
    if (mkdir(path, 0700) < 0 && errno != EEXIST) {
        PyErr_SetFromErrnoWithFilename(PyExc_OSError, path);
        return -1;
    }
    int rc = mdb_env_create(&s->env);
    if (rc == 0)
        rc = mdb_env_set_mapsize(s->env, (size_t)map);
    if (rc == 0)
        rc = mdb_env_set_maxdbs(s->env, 2);
    if (rc == 0)
        rc = mdb_env_set_maxreaders(s->env, 126);
    /* a cache on tmpfs: no syncs (tmpfs has nothing to sync to), one file and its
     * lock file (NOSUBDIR), no thread-local reader slots (the kept read transaction
     * moves between threads) */
    unsigned flags = MDB_NOSUBDIR | MDB_NOSYNC | MDB_NOMETASYNC | MDB_NOTLS | MDB_NORDAHEAD |
                     (writemap ? MDB_WRITEMAP : 0);
    snprintf(path, sizeof path, "%s/index.mdb", root);
    if (rc == 0)
        rc = mdb_env_open(s->env, path, flags, 0600);
    MDB_txn *txn = NULL;
    if (rc == 0)
        rc = mdb_txn_begin(s->env, NULL, 0, &txn);
    if (rc == 0)
        rc = mdb_dbi_open(txn, "blocks", MDB_CREATE, &s->dbi);
    if (rc == 0)
        rc = mdb_dbi_open(txn, "slabs", MDB_CREATE | MDB_INTEGERKEY, &s->sdbi);
    if (rc == 0) {
        rc = mdb_txn_commit(txn);
        txn = NULL;
    }
    if (txn != NULL)
        mdb_txn_abort(txn);
    if (rc != 0) {
        lmdb_error(rc, "opening the LMDB index");
        return -1;
    }
    return 0;
}

static void Store_close_all(Store *s) {
    if (s->rtxn != NULL) {
        mdb_txn_abort(s->rtxn);
        s->rtxn = NULL;
    }
    if (s->env != NULL) {
        mdb_env_close(s->env);
        s->env = NULL;
    }
    if (s->slabs != NULL) {
        for (uint32_t i = 0; i < s->nslabs; i++) {
            munmap(s->slabs[i].base, slab_map_bytes(&s->slabs[i]));
            free(s->slabs[i].free_list);
        }
        free(s->slabs);
        s->slabs = NULL;
        s->nslabs = 0;
    }
}

static void Store_dealloc(Store *s) {
    Store_close_all(s);
    Py_TYPE(s)->tp_free((PyObject *)s);
}

static PyObject *Store_close(Store *s, PyObject *unused) {
    (void)unused;
    Store_close_all(s);
    Py_RETURN_NONE;
}

static int usable(Store *s) {
    if (s->env == NULL) {
        PyErr_SetString(PyExc_ValueError, "the store is closed");
        return 0;
    }
    return 1;
}

static PyObject *Store_put_batch(Store *s, PyObject *args) {
    PyObject *ko, *ao, *so;
    if (!PyArg_ParseTuple(args, "OOO", &ko, &ao, &so) || !usable(s))
        return NULL;
    keys_t ks;
    Py_buffer ab, sb;
    if (parse_batch(ko, ao, so, &ks, &ab, &sb) < 0)
        return NULL;
    Py_ssize_t n = ks.n;
    const uint64_t *addrs = ab.buf, *sizes = sb.buf;
    for (Py_ssize_t i = 0; i < n; i++)
        if (sizes[i] == 0 || sizes[i] > s->slab_bytes) {
            release_batch(&ks, &ab, &sb);
            PyErr_Format(PyExc_ValueError, "block %zd: %llu bytes", i,
                         (unsigned long long)sizes[i]);
            return NULL;
        }
    PyObject *out = PyBytes_FromStringAndSize(NULL, n);
    if (out == NULL) {
        release_batch(&ks, &ab, &sb);
        return NULL;
    }
    uint8_t *stored = (uint8_t *)PyBytes_AS_STRING(out);
    memset(stored, 0, (size_t)n & 0x3fffffff);
    uint32_t (*took)[2] = PyMem_Malloc(sizeof *took * (size_t)(n ? n : 1));
    if (took == NULL) {
        Py_DECREF(out);
        release_batch(&ks, &ab, &sb);
        return PyErr_NoMemory();
    }
    Py_ssize_t ntook = 0;
    int rc = 0, nospace = 0;
    const char *where = "mdb_txn_begin";
    Py_BEGIN_ALLOW_THREADS
    uint64_t t0 = now_ns();
    MDB_txn *txn;
    rc = mdb_txn_begin(s->env, NULL, 0, &txn);
    if (rc == 0) {
        uint32_t hint = 0;
        for (Py_ssize_t i = 0; i < n && rc == 0; i++) {
            MDB_val k = {ks.k[i][0], ks.k[i] + 1}, v = {sizeof(val_t), NULL};
            /* one descent: present -> MDB_KEYEXIST (first writer wins), else room for
             * the record, filled below */
            rc = mdb_put(txn, s->dbi, &k, &v, MDB_NOOVERWRITE | MDB_RESERVE);
            if (rc == MDB_KEYEXIST) {
                rc = 0;
                continue;
            }
            if (rc != 0) {
                where = "mdb_put";
                break;
            }
            val_t val = {0, 0, 0, 0, sizes[i], 0};
            if (chunk_alloc(s, size_class(sizes[i]), &hint, &val.slab, &val.chunk) < 0) {
                nospace = errno == ENOSPC ? 1 : 2;
                rc = -1;
                break;
            }
            took[ntook][0] = val.slab;
            took[ntook++][1] = val.chunk;
            lslab_t *sl = &s->slabs[val.slab];
            val.gen = sl->gens[val.chunk];
            const char *src = (const char *)(uintptr_t)addrs[i];
            val.csum = XXH3_64bits_dispatch(src, sizes[i]);
            memcpy(sl->chunks + (size_t)val.chunk * sl->csize, src, sizes[i]);
            memcpy(v.mv_data, &val, sizeof val);
            stored[i] = 1;
        }
        if (rc == 0) {
            rc = put_slab_state(s, txn);
            where = "mdb_put (slabs)";
        }
        if (rc == 0) {
            uint64_t c0 = now_ns();
            rc = mdb_txn_commit(txn);
            s->commit_ns += now_ns() - c0;
            s->commits++;
            where = "mdb_txn_commit";
        } else {
            mdb_txn_abort(txn);
            /* the chunks this batch took go back (the allocator lives here, not in
             * LMDB, so an abort does not roll it back) */
            for (Py_ssize_t j = 0; j < ntook; j++)
                chunk_free(s, took[j][0], took[j][1]);
        }
    }
    s->put_ns += now_ns() - t0;
    s->puts += (uint64_t)n;
    Py_END_ALLOW_THREADS
    PyMem_Free(took);
    release_batch(&ks, &ab, &sb);
    if (rc != 0) {
        Py_DECREF(out);
        if (nospace == 1) {
            PyErr_SetString(PyExc_MemoryError, "the arena is full");
            return NULL;
        }
        if (nospace == 2)
            return PyErr_SetFromErrno(PyExc_OSError);
        return lmdb_error(rc, where);
    }
    return out;
}

static PyObject *Store_read_into(Store *s, PyObject *args) {
    PyObject *ko, *ao, *so;
    int verify = 1;
    if (!PyArg_ParseTuple(args, "OOO|p", &ko, &ao, &so, &verify) || !usable(s))
        return NULL;
    keys_t ks;
    Py_buffer ab, sb;
    if (parse_batch(ko, ao, so, &ks, &ab, &sb) < 0)
        return NULL;
    Py_ssize_t n = ks.n, bad_size = -1;
    const uint64_t *addrs = ab.buf, *sizes = sb.buf;
    PyObject *out = PyBytes_FromStringAndSize(NULL, n);
    if (out == NULL) {
        release_batch(&ks, &ab, &sb);
        return NULL;
    }
    uint8_t *st = (uint8_t *)PyBytes_AS_STRING(out);
    memset(st, 0, (size_t)n & 0x3fffffff);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    MDB_txn *txn;
    rc = rtxn_take(s, &txn);
    if (rc == 0) {
        for (Py_ssize_t i = 0; i < n; i++) {
            MDB_val k = {ks.k[i][0], ks.k[i] + 1}, v;
            int g = mdb_get(txn, s->dbi, &k, &v);
            if (g == MDB_NOTFOUND)
                continue;
            if (g != 0 || v.mv_size != sizeof(val_t)) {
                rc = g ? g : MDB_CORRUPTED;
                break;
            }
            val_t val;
            memcpy(&val, v.mv_data, sizeof val);
            if (val.nbytes != sizes[i]) {
                bad_size = i;
                break;
            }
            if (val.slab >= s->nslabs || val.chunk >= s->slabs[val.slab].nchunks) {
                rc = MDB_CORRUPTED;
                break;
            }
            lslab_t *sl = &s->slabs[val.slab];
            uint32_t g0 = __atomic_load_n(&sl->gens[val.chunk], __ATOMIC_ACQUIRE);
            if (g0 != val.gen) {
                st[i] = 3; /* freed since this snapshot */
                continue;
            }
            const char *src = sl->chunks + (size_t)val.chunk * sl->csize;
            char *dst = (char *)(uintptr_t)addrs[i];
            uint64_t sum = verify ? XXH3_64bits_dispatch(src, val.nbytes) : val.csum;
            memcpy(dst, src, val.nbytes);
            __atomic_thread_fence(__ATOMIC_ACQUIRE);
            if (__atomic_load_n(&sl->gens[val.chunk], __ATOMIC_RELAXED) != g0)
                st[i] = 3;
            else
                st[i] = sum == val.csum ? 1 : 2;
        }
        rtxn_give(s, txn);
    }
    Py_END_ALLOW_THREADS
    release_batch(&ks, &ab, &sb);
    if (rc != 0) {
        Py_DECREF(out);
        return lmdb_error(rc, "read_into");
    }
    PyObject *r = Py_BuildValue("(Nn)", out, bad_size);
    return r;
}

static PyObject *Store_match(Store *s, PyObject *ko) {
    if (!usable(s))
        return NULL;
    keys_t ks;
    if (parse_keys(ko, &ks) < 0)
        return NULL;
    Py_ssize_t n = 0;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    MDB_txn *txn;
    rc = rtxn_take(s, &txn);
    if (rc == 0) {
        for (; n < ks.n; n++) {
            MDB_val k = {ks.k[n][0], ks.k[n] + 1}, v;
            int g = mdb_get(txn, s->dbi, &k, &v);
            if (g != 0) {
                if (g != MDB_NOTFOUND)
                    rc = g;
                break;
            }
        }
        rtxn_give(s, txn);
    }
    Py_END_ALLOW_THREADS
    PyMem_Free(ks.k);
    if (rc != 0)
        return lmdb_error(rc, "match");
    return PyLong_FromSsize_t(n);
}

static PyObject *Store_delete(Store *s, PyObject *ko) {
    if (!usable(s))
        return NULL;
    keys_t ks;
    if (parse_keys(ko, &ks) < 0)
        return NULL;
    Py_ssize_t found = 0;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    MDB_txn *txn;
    rc = mdb_txn_begin(s->env, NULL, 0, &txn);
    if (rc == 0) {
        for (Py_ssize_t i = 0; i < ks.n && rc == 0; i++) {
            MDB_val k = {ks.k[i][0], ks.k[i] + 1}, v;
            int g = mdb_get(txn, s->dbi, &k, &v);
            if (g == MDB_NOTFOUND)
                continue;
            if (g != 0 || v.mv_size != sizeof(val_t)) {
                rc = g ? g : MDB_CORRUPTED;
                break;
            }
            val_t val;
            memcpy(&val, v.mv_data, sizeof val);
            rc = mdb_del(txn, s->dbi, &k, NULL);
            if (rc == 0 && val.slab < s->nslabs && val.chunk < s->slabs[val.slab].nchunks) {
                chunk_free(s, val.slab, val.chunk);
                found++;
            }
        }
        if (rc == 0)
            rc = put_slab_state(s, txn);
        if (rc == 0)
            rc = mdb_txn_commit(txn);
        else
            mdb_txn_abort(txn);
    }
    Py_END_ALLOW_THREADS
    PyMem_Free(ks.k);
    if (rc != 0)
        return lmdb_error(rc, "delete");
    return PyLong_FromSsize_t(found);
}

static PyObject *Store_stats(Store *s, PyObject *unused) {
    (void)unused;
    if (!usable(s))
        return NULL;
    MDB_envinfo info;
    MDB_stat st;
    mdb_env_info(s->env, &info);
    mdb_env_stat(s->env, &st);
    MDB_txn *txn;
    MDB_stat bst;
    memset(&bst, 0, sizeof bst);
    if (mdb_txn_begin(s->env, NULL, MDB_RDONLY, &txn) == 0) {
        mdb_stat(txn, s->dbi, &bst);
        mdb_txn_abort(txn);
    }
    return Py_BuildValue(
        "{s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K}", "put_ns", (unsigned long long)s->put_ns,
        "commit_ns", (unsigned long long)s->commit_ns, "commits",
        (unsigned long long)s->commits, "puts", (unsigned long long)s->puts, "entries",
        (unsigned long long)bst.ms_entries, "depth", (unsigned long long)bst.ms_depth,
        "pages_used", (unsigned long long)(info.me_last_pgno + 1), "page_size",
        (unsigned long long)st.ms_psize, "slabs", (unsigned long long)s->nslabs);
}

static PyObject *Store_reset_stats(Store *s, PyObject *unused) {
    (void)unused;
    s->put_ns = s->commit_ns = s->commits = s->puts = 0;
    Py_RETURN_NONE;
}

static PyMethodDef Store_methods[] = {
    {"put_batch", (PyCFunction)Store_put_batch, METH_VARARGS, NULL},
    {"read_into", (PyCFunction)Store_read_into, METH_VARARGS, NULL},
    {"match", (PyCFunction)Store_match, METH_O, NULL},
    {"delete", (PyCFunction)Store_delete, METH_O, NULL},
    {"stats", (PyCFunction)Store_stats, METH_NOARGS, NULL},
    {"reset_stats", (PyCFunction)Store_reset_stats, METH_NOARGS, NULL},
    {"close", (PyCFunction)Store_close, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject StoreType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kv_table_lmdb.LmdbStore",
    .tp_basicsize = sizeof(Store),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Store_init,
    .tp_dealloc = (destructor)Store_dealloc,
    .tp_methods = Store_methods,
};

static PyObject *py_size_class(PyObject *self, PyObject *arg) {
    (void)self;
    unsigned long long n = PyLong_AsUnsignedLongLong(arg);
    if (n == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    return PyLong_FromUnsignedLongLong(size_class(n));
}

static PyObject *py_version(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return PyUnicode_FromString(mdb_version(NULL, NULL, NULL));
}

static PyMethodDef module_methods[] = {
    {"size_class", py_size_class, METH_O, NULL},
    {"version", py_version, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kv_table_lmdb", NULL, -1,
                                    module_methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit_kv_table_lmdb(void) {
    if (PyType_Ready(&StoreType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&StoreType);
    if (PyModule_AddObject(m, "LmdbStore", (PyObject *)&StoreType) < 0) {
        Py_DECREF(&StoreType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
