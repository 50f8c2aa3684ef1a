/* The Python type BlockIndex and the module's functions: arguments, open and close,
 * what the store holds (stats, bloom, locate), settings. */
#include "kv.h"

int parse_keys(PyObject *seq, keyset_t *ks) {
    PyObject *fast = PySequence_Fast(seq, "keys must be a sequence of bytes");
    if (fast == NULL)
        return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    ks->n = n;
    ks->keys = PyMem_Malloc((size_t)(n ? n : 1) * (KEYMAX + 1));
    if (ks->keys == NULL) {
        Py_DECREF(fast);
        PyErr_NoMemory();
        return -1;
    }
    PyObject **items = PySequence_Fast_ITEMS(fast);
    for (Py_ssize_t i = 0; i < n; i++) {
        char *p;
        Py_ssize_t len;
        if (!PyBytes_Check(items[i]) || PyBytes_AsStringAndSize(items[i], &p, &len) < 0 ||
                len < 1 || len > KEYMAX) {
            PyErr_Format(PyExc_ValueError, "key %zd must be 1 to %d bytes", i, KEYMAX);
            PyMem_Free(ks->keys);
            Py_DECREF(fast);
            return -1;
        }
        ks->keys[i][0] = (uint8_t)len;
        memset(ks->keys[i] + 1, 0, KEYMAX);
        memcpy(ks->keys[i] + 1, p, (size_t)len);
    }
    Py_DECREF(fast);
    return 0;
}


int u64_buffer(PyObject *obj, Py_buffer *b, Py_ssize_t n, const char *what) {
    if (PyObject_GetBuffer(obj, b, PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    if (b->len != n * 8) {
        PyErr_Format(PyExc_ValueError, "%s must hold %zd uint64 values, not %zd bytes",
                     what, n, b->len);
        PyBuffer_Release(b);
        return -1;
    }
    return 0;
}

/* a batch's arguments: its keys, and a uint64 address and size per key */
int parse_batch(PyObject *keys_o, PyObject *addrs_o, PyObject *sizes_o,
                       keyset_t *ks, Py_buffer *ab, Py_buffer *sb) {
    if (parse_keys(keys_o, ks) < 0)
        return -1;
    if (u64_buffer(addrs_o, ab, ks->n, "addrs") < 0) {
        free_keys(ks);
        return -1;
    }
    if (u64_buffer(sizes_o, sb, ks->n, "sizes") < 0) {
        PyBuffer_Release(ab);
        free_keys(ks);
        return -1;
    }
    return 0;
}

int usable(Idx *s) {
    if (s->hdr == NULL) {
        PyErr_SetString(PyExc_ValueError, "the block index is closed");
        return 0;
    }
    return 1;
}

/* a step that failed: its damage, or its errno (never an OSError of errno 0) */
PyObject *lock_error(Idx *s) {
    if (s->dmg)
        return raise_damage(s);
    if (errno == 0)
        errno = EIO;
    return PyErr_SetFromErrno(PyExc_OSError);
}

/* ---------------------------------------------------------------------------------- */
/* open and close */

static void Idx_dealloc(Idx *s);

static int Idx_init(Idx *s, PyObject *args, PyObject *kw) {
    static char *names[] = {"root", "capacity", "slab_bytes", "eviction", "pid", "start",
                            NULL};
    const char *root;
    unsigned long long capacity, slab_bytes, start;
    int eviction, pid;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "sKKiiK", names, &root, &capacity,
                                     &slab_bytes, &eviction, &pid, &start))
        return -1;
    for (int i = 0; i < MAX_SLABS; i++)
        s->maps[i].fd = -1;
    s->slot = -1;
    if (!s->maplock_ok) {
        pthread_rwlockattr_t ra;
        pthread_rwlockattr_init(&ra);
#ifdef __GLIBC__ /* a remap waits for the lookups under way, not behind every new one */
        pthread_rwlockattr_setkind_np(&ra, PTHREAD_RWLOCK_PREFER_WRITER_NONRECURSIVE_NP);
#endif
        if (pthread_rwlock_init(&s->maplock, &ra) != 0) {
            pthread_rwlockattr_destroy(&ra);
            PyErr_NoMemory();
            return -1;
        }
        pthread_rwlockattr_destroy(&ra);
        s->maplock_ok = 1;
    }
    s->root = strdup(root);
    char path[4096];
    snprintf(path, sizeof path, "%s/index.kvx", root);
    int created = 0;
    int fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0 && errno == ENOENT) {
        /* made under a temporary name, then linked into place: the others never see a
         * header that is not ready */
        char tmp[4096];
        snprintf(tmp, sizeof tmp, "%s/index.%d.tmp", root, getpid());
        int tfd = create_file(tmp, sizeof(hdr_t));
        if (tfd < 0) {
            PyErr_SetFromErrnoWithFilename(PyExc_OSError, tmp);
            return -1;
        }
        hdr_t *h = mmap(NULL, sizeof(hdr_t), PROT_READ | PROT_WRITE, MAP_SHARED, tfd, 0);
        if (h == MAP_FAILED) {
            close(tfd);
            unlink(tmp);
            PyErr_SetFromErrno(PyExc_OSError);
            return -1;
        }
        memset(h, 0, sizeof *h);
        pthread_mutexattr_t a;
        pthread_mutexattr_init(&a);
        pthread_mutexattr_setpshared(&a, PTHREAD_PROCESS_SHARED);
        pthread_mutexattr_setrobust(&a, PTHREAD_MUTEX_ROBUST);
        pthread_mutex_init(&h->lock, &a);
        pthread_mutexattr_destroy(&a);
        uint64_t seeds[2] = {0, 0};
        int ufd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
        if (ufd >= 0) {
            if (read(ufd, seeds, sizeof seeds) != sizeof seeds)
                seeds[0] = (uint64_t)time(NULL) ^ ((uint64_t)getpid() << 32);
            close(ufd);
        }
        h->seed0 = seeds[0];
        h->seed1 = seeds[1];
        h->capacity = capacity;
        h->slab_bytes = slab_bytes;
        h->eviction = (uint32_t)eviction;
        /* the first table's generation is the creator's own (random, in [1, 2^30]):
         * creators racing on one namespace each make a file of their own name, and the
         * losers' unlink removes only theirs, never the winner's live table */
        uint32_t gen0 = 1 + (uint32_t)((seeds[0] ^ (seeds[1] >> 7) ^ (uint64_t)getpid()) &
                                       ((1u << 30) - 1));
        h->table_gen = gen0;
        h->rec_gen = gen0;
        char tpath[4096], rpath[4096];
        table_path(s, gen0, tpath, sizeof tpath);
        records_path(root, gen0, rpath, sizeof rpath);
        int t = create_table(tpath, gen0, INITIAL_RECS * 2, INITIAL_RECS);
        int rf = t < 0 ? -1 : create_file(rpath, INITIAL_RECS * sizeof(rec_t));
        if (rf < 0) {
            const char *bad = t < 0 ? tpath : rpath;
            int e = errno;
            if (t >= 0) {
                close(t);
                unlink(tpath);
            }
            munmap(h, sizeof *h);
            close(tfd);
            unlink(tmp);
            errno = e;
            PyErr_SetFromErrnoWithFilename(PyExc_OSError, bad);
            return -1;
        }
        close(t);
        close(rf);
        h->version = KV_VERSION;
        h->magic = KV_MAGIC;
        h->ready = 1;
        munmap(h, sizeof *h);
        if (link(tmp, path) == 0) {
            created = 1;
        } else { /* another process made it first: use theirs */
            unlink(tpath);
            unlink(rpath);
        }
        unlink(tmp);
        close(tfd);
        fd = open(path, O_RDWR | O_CLOEXEC);
    }
    if (fd < 0) {
        PyErr_SetFromErrnoWithFilename(PyExc_OSError, path);
        return -1;
    }
    struct stat st;
    if (fstat(fd, &st) < 0 || (size_t)st.st_size < sizeof(hdr_t)) {
        close(fd);
        PyErr_Format(PyExc_ValueError, "damaged: %s is %lld bytes, not an index", path,
                     (long long)st.st_size);
        return -1;
    }
    hdr_t *h = mmap(NULL, sizeof(hdr_t), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (h == MAP_FAILED) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    if (h->magic != KV_MAGIC || h->version != KV_VERSION || !h->ready ||
            h->nslabs > MAX_SLABS || h->eviction > EV_S3FIFO) {
        munmap(h, sizeof *h);
        PyErr_Format(PyExc_ValueError, "damaged: %s is not a block index of this version",
                     path);
        return -1;
    }
    s->hdr = h;
    (void)created;
    int r, slot = -1;
    /* never wait for the GIL while holding the lock: another thread of this process may
     * hold the GIL while it waits for the lock */
    Py_BEGIN_ALLOW_THREADS
    r = lock(s);
    if (r == 0) {
        /* a process slot: a free one, or a dead process's (whose leases go first) */
        for (int p = 0; p < MAX_PROCS && slot < 0; p++)
            if (!h->procs[p].used)
                slot = p;
        if (slot < 0 && reclaim_dead(s))
            for (int p = 0; p < MAX_PROCS && slot < 0; p++)
                if (!h->procs[p].used)
                    slot = p;
        if (slot >= 0) {
            /* a slot freed by a clean close has no bits left; one taken from the dead
             * was cleared by reclaim_dead */
            h->procs[slot].pid = pid;
            h->procs[slot].start = start;
            h->procs[slot].used = 1;
        }
        unlock(s);
    }
    Py_END_ALLOW_THREADS
    if (r < 0 || s->dmg) {
        lock_error(s);
        return -1;
    }
    if (slot < 0) {
        PyErr_Format(PyExc_OverflowError, "%d processes have this block store open: no "
                     "slot for another", MAX_PROCS);
        return -1;
    }
    s->slot = slot;
    return 0;
}

static void close_handle(Idx *s) {
    if (s->hdr == NULL)
        return;
    if (s->slot >= 0 && lock(s) == 0) {
        hdr_t *h = s->hdr;
        uint64_t bit = 1ULL << s->slot;
        for (uint64_t j = 0; j < h->bump; j++) {
            rec_t *r = R(s, (uint32_t)j);
            if (r->state == S_DISK && r->writer == (uint32_t)s->slot + 1)
                promote_abandon(s, (uint32_t)j);
            if (r->readers & bit) {
                r->readers &= ~bit;
                if (r->state == S_ZOMBIE && !r->readers) {
                    release_chunk(s, r->slab, r->chunk);
                    meta_free(s, r);
                    rec_free(s, (uint32_t)j);
                }
            }
        }
        h->procs[s->slot].used = 0;
        if (h->ev_pub == (uint32_t)s->slot + 1) {
            h->ev_pub = 0;
            h->ev_on = 0;
        }
        unlock(s);
    }
    if (s->ev_map != NULL)
        munmap(s->ev_map, s->ev_size);
    s->ev_map = NULL;
    for (int i = 0; i < MAX_SLABS; i++)
        unmap_slab(s, (uint32_t)i);
    unmap_tables(s); /* no lookup of this process reads them meanwhile */
    map_hold(s, 1);
    munmap(s->hdr, sizeof(hdr_t));
    s->hdr = NULL;
    map_let_go(s);
}

static PyObject *Idx_close(Idx *s, PyObject *unused) {
    (void)unused;
    Py_BEGIN_ALLOW_THREADS
    close_handle(s);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* keep_maps(): hand this handle's slab mappings to the process's kept mappings
 * (kept_t), for the slab files a destroy is about to pool: a slab that claims one of
 * them back (in any namespace of this process) takes its mapping as it is. Call it
 * just before close, on the last handle of a store nobody else has open. Returns how
 * many mappings were kept. */
static PyObject *Idx_keep_maps(Idx *s, PyObject *unused) {
    (void)unused;
    long n = 0;
    Py_BEGIN_ALLOW_THREADS
    if (s->hdr != NULL)
        for (int i = 0; i < MAX_SLABS; i++) {
            smap_t *m = &s->maps[i];
            if (m->base == NULL || m->fd < 0)
                continue;
            kept_add(m->base, m->size, m->fd);
            m->base = NULL;
            m->size = 0;
            m->fd = -1;
            n++;
        }
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(n);
}

/* after a fork: the child drops the parent's handle without touching the shared state */
static PyObject *Idx_abandon(Idx *s, PyObject *unused) {
    (void)unused;
    if (s->hdr != NULL) {
        if (s->ev_map != NULL)
            munmap(s->ev_map, s->ev_size);
        s->ev_map = NULL;
        for (int i = 0; i < MAX_SLABS; i++)
            unmap_slab(s, (uint32_t)i);
        unmap_tables(s);
        munmap(s->hdr, sizeof(hdr_t));
    }
    s->hdr = NULL;
    Py_RETURN_NONE;
}

static void Idx_dealloc(Idx *s) {
    Py_BEGIN_ALLOW_THREADS
    close_handle(s);
    Py_END_ALLOW_THREADS
    free(s->root);
    free(s->disk_root);
    free(s->pool_dir);
    free(s->left);
    if (s->maplock_ok)
        pthread_rwlock_destroy(&s->maplock);
    Py_TYPE(s)->tp_free((PyObject *)s);
}

static PyObject *Idx_set_spill(Idx *s, PyObject *args) {
    PyObject *root;
    unsigned long long cap;
    if (!PyArg_ParseTuple(args, "OK", &root, &cap))
        return NULL;
    free(s->disk_root);
    s->disk_root = NULL;
    if (root != Py_None) {
        const char *p = PyUnicode_AsUTF8(root);
        if (p == NULL)
            return NULL;
        s->disk_root = strdup(p);
    }
    s->disk_capacity = cap;
    Py_RETURN_NONE;
}

static PyObject *Idx_set_pool(Idx *s, PyObject *arg) {
    free(s->pool_dir);
    s->pool_dir = NULL;
    if (arg != Py_None) {
        const char *p = PyUnicode_AsUTF8(arg);
        if (p == NULL)
            return NULL;
        s->pool_dir = strdup(p);
    }
    Py_RETURN_NONE;
}

static PyObject *Idx_mark_gpu(Idx *s, PyObject *unused) {
    (void)unused;
    if (!usable(s))
        return NULL;
    s->hdr->gpu_seen = 1;
    Py_RETURN_NONE;
}

/* ---------------------------------------------------------------------------------- */
/* put */

/* the shared counters' names, in the order of layout.h's C_ enum */
static const char *COUNTER_NAMES[NCOUNTERS] = {
    "host_blocks", "host_bytes", "disk_blocks", "disk_bytes", "arena_bytes", "pinned",
    "hits", "misses", "evictions", "spills", "corrupt", "slab_drops", "reclaim_scans",
    "meta_bytes"};

static PyObject *Idx_stats(Idx *s, PyObject *unused) {
    (void)unused;
    if (!usable(s))
        return NULL;
    uint64_t c[NCOUNTERS], recs = 0, cap = 0, to_move = 0;
    int r;
    Py_BEGIN_ALLOW_THREADS
    r = lock(s);
    if (r == 0) {
        memcpy(c, s->hdr->count, sizeof c);
        recs = s->hdr->nrecs;
        cap = s->ncap;
        to_move = s->onb - s->hdr->rehash_at; /* hdr_check: rehash_at <= onb */
        /* the block counts size what callers build from them (a Bloom filter): never
         * more blocks than records in use */
        if (c[C_HOST_BLOCKS] > recs || c[C_DISK_BLOCKS] > recs - c[C_HOST_BLOCKS])
            damaged(s, "index.kvx", "its counters say %llu blocks in memory and %llu on "
                    "disk, of %llu records in use", (unsigned long long)c[C_HOST_BLOCKS],
                    (unsigned long long)c[C_DISK_BLOCKS], (unsigned long long)recs);
        unlock(s);
    }
    Py_END_ALLOW_THREADS
    if (r < 0 || s->dmg)
        return lock_error(s);
    PyObject *d = PyDict_New();
    for (int i = 0; d != NULL && i < NCOUNTERS; i++) {
        PyObject *v = PyLong_FromUnsignedLongLong(c[i]);
        if (v == NULL || PyDict_SetItemString(d, COUNTER_NAMES[i], v) < 0)
            Py_CLEAR(d);
        Py_XDECREF(v);
    }
    if (d != NULL) {
        PyObject *a = PyLong_FromUnsignedLongLong(recs), *b = PyLong_FromUnsignedLongLong(cap);
        PyDict_SetItemString(d, "records", a);
        PyDict_SetItemString(d, "record_capacity", b);
        Py_XDECREF(a);
        Py_XDECREF(b);
        /* a growth's move: the old table's buckets not yet moved into the new one */
        PyObject *m = PyLong_FromUnsignedLongLong(to_move);
        PyDict_SetItemString(d, "buckets_to_move", m);
        Py_XDECREF(m);
    }
    return d;
}

/* bloom(nbits, k) -> bytes: the Bloom filter of the readable keys, positions as
 * ``bloom_positions`` computes them (xxh3-128; h1 + i * h2 taken exactly, then mod) */
static PyObject *Idx_bloom(Idx *s, PyObject *args) {
    unsigned long long nbits;
    int k;
    if (!PyArg_ParseTuple(args, "Ki", &nbits, &k))
        return NULL;
    if (!usable(s))
        return NULL;
    if (xxh_oneshot128 == NULL || nbits == 0 || nbits % 8) {
        PyErr_SetString(PyExc_ValueError, "bloom: no XXH3_128, or nbits not a multiple of 8");
        return NULL;
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(nbits / 8));
    if (out == NULL)
        return NULL;
    uint8_t *bits = (uint8_t *)PyBytes_AS_STRING(out);
    memset(bits, 0, nbits / 8);
    int r;
    Py_BEGIN_ALLOW_THREADS
    r = lock(s);
    if (r == 0) {
        for (uint64_t j = 0; j < s->hdr->bump; j++) {
            rec_t *rr = R(s, (uint32_t)j);
            if (!readable(rr))
                continue;
            if (rr->klen == 0 || rr->klen > KEYMAX) {
                table_damaged(s, "record %u: a key of %u bytes", (unsigned)j, rr->klen);
                break;
            }
            xxh128_t hh = xxh_oneshot128(rr->key, rr->klen);
            unsigned __int128 h1 = hh.low64, h2 = hh.high64 | 1;
            for (int i = 0; i < k; i++) {
                uint64_t p = (uint64_t)((h1 + (unsigned __int128)i * h2) % nbits);
                bits[p >> 3] |= (uint8_t)(1 << (p & 7));
            }
        }
        unlock(s);
    }
    Py_END_ALLOW_THREADS
    if (r < 0 || s->dmg) {
        Py_DECREF(out);
        return lock_error(s);
    }
    return out;
}

/* locate(key) -> None or (tier, slab, slab_gen, offset, nbytes, spill_file, meta) */
static PyObject *Idx_locate(Idx *s, PyObject *key) {
    if (!usable(s))
        return NULL;
    PyObject *one = PyTuple_Pack(1, key);
    if (one == NULL)
        return NULL;
    keyset_t ks;
    int pr = parse_keys(one, &ks);
    Py_DECREF(one);
    if (pr < 0)
        return NULL;
    int r, state = S_FREE;
    uint32_t slab = 0, gen = 0;
    uint64_t offset = 0, nbytes = 0;
    char path[4096];
    char *meta = NULL;
    size_t meta_len = 0;
    path[0] = 0;
    Py_BEGIN_ALLOW_THREADS
    r = lock(s);
    if (r == 0) {
        int64_t f = h_find(s, ks.keys[0] + 1, ks.keys[0][0]);
        if (f >= 0 && readable(R(s, (uint32_t)f)) && rec_check(s, (uint32_t)f) == 0) {
            rec_t *rr = R(s, (uint32_t)f);
            state = rr->state;
            nbytes = rr->nbytes;
            uint8_t *owned;
            uint32_t mlen;
            const uint8_t *mp = rec_meta(s, rr, &mlen, &owned);
            meta = mp != NULL ? malloc(mlen + 1) : NULL;
            if (meta != NULL) {
                memcpy(meta, mp, mlen);
                meta_len = mlen;
            }
            free(owned);
            if (state == S_HOST) {
                slab_t *sl = &s->hdr->slabs[rr->slab];
                slab = rr->slab;
                gen = sl->gen;
                offset = (uint64_t)rr->chunk * sl->csize;
            } else if (s->disk_root != NULL) {
                spill_path(s, rr, path, sizeof path);
            }
        }
        unlock(s);
    }
    Py_END_ALLOW_THREADS
    free_keys(&ks);
    PyObject *out = NULL;
    if (r < 0 || s->dmg)
        out = lock_error(s);
    else if (state == S_HOST)
        out = Py_BuildValue("(sIIKKOy#)", "host", slab, gen, (unsigned long long)offset,
                            (unsigned long long)nbytes, Py_None, meta ? meta : "",
                            (Py_ssize_t)meta_len);
    else if (state == S_DISK)
        out = Py_BuildValue("(sIIKKsy#)", "disk", 0u, 0u, 0ULL, (unsigned long long)nbytes,
                            path, meta ? meta : "", (Py_ssize_t)meta_len);
    else {
        Py_INCREF(Py_None);
        out = Py_None;
    }
    free(meta);
    return out;
}

/* quiescent() -> bool: no other live process has the store open and no view of a block
 * is held (its slab files may be recycled once it is closed) */
static PyObject *Idx_quiescent(Idx *s, PyObject *unused) {
    (void)unused;
    if (!usable(s))
        return NULL;
    int r, quiet = 1;
    Py_BEGIN_ALLOW_THREADS
    r = lock(s);
    if (r == 0) {
        hdr_t *h = s->hdr;
        for (int p = 0; p < MAX_PROCS && quiet; p++)
            if (p != s->slot && h->procs[p].used && proc_alive(&h->procs[p]))
                quiet = 0;
        for (uint64_t j = 0; j < h->bump && quiet; j++)
            if (R(s, (uint32_t)j)->readers)
                quiet = 0;
        unlock(s);
    }
    Py_END_ALLOW_THREADS
    if (r < 0 || s->dmg)
        return lock_error(s);
    return PyBool_FromLong(quiet);
}

/* settings() -> (capacity, slab_bytes, eviction, gpu_seen): the first process's, and
 * whether any process gave the store a GPU tier */
static PyObject *Idx_settings(Idx *s, PyObject *unused) {
    (void)unused;
    if (!usable(s))
        return NULL;
    return Py_BuildValue("(KKII)", (unsigned long long)s->hdr->capacity,
                         (unsigned long long)s->hdr->slab_bytes, s->hdr->eviction,
                         s->hdr->gpu_seen);
}

/* take_left() -> list of keys that left the store since the last call (GPU copies) */
static PyObject *Idx_take_left(Idx *s, PyObject *unused) {
    (void)unused;
    PyObject *out = PyList_New((Py_ssize_t)s->nleft);
    for (size_t i = 0; out != NULL && i < s->nleft; i++) {
        uint8_t *e = s->left + i * (KEYMAX + 1);
        PyObject *k = PyBytes_FromStringAndSize((const char *)e + 1, e[0]);
        if (k == NULL) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, (Py_ssize_t)i, k);
    }
    s->nleft = 0;
    return out;
}

/* files of the store that no record names (their creator died before publishing them):
 * slab files of other generations, tables of old generations, spill files of no record */
static PyObject *Idx_reclaim_orphans(Idx *s, PyObject *unused) {
    (void)unused;
    if (!usable(s))
        return NULL;
    int r;
    Py_ssize_t removed = 0;
    Py_BEGIN_ALLOW_THREADS
    r = lock(s);
    if (r == 0) {
        hdr_t *h = s->hdr;
        char dir[4096], path[8192];
        snprintf(dir, sizeof dir, "%s/slabs", s->root);
        DIR *d = opendir(dir);
        struct dirent *e;
        while (d != NULL && (e = readdir(d)) != NULL) {
            unsigned slot, gen;
            char tail[8];
            if (sscanf(e->d_name, "%x-%u.%7s", &slot, &gen, tail) != 3 ||
                    strcmp(tail, "slab") != 0)
                continue;
            if (slot < h->nslabs && h->slabs[slot].live && h->slabs[slot].gen == gen)
                continue;
            snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
            removed += unlink(path) == 0;
        }
        if (d != NULL)
            closedir(d);
        d = opendir(s->root);
        while (d != NULL && (e = readdir(d)) != NULL) {
            unsigned gen;
            if ((sscanf(e->d_name, "table-%u.kvx", &gen) == 1 && gen != h->table_gen &&
                    gen != h->old_gen) ||
                    (sscanf(e->d_name, "records-%u.kvx", &gen) == 1 && gen != h->rec_gen)) {
                snprintf(path, sizeof path, "%s/%s", s->root, e->d_name);
                removed += unlink(path) == 0;
            }
        }
        if (d != NULL)
            closedir(d);
        if (s->disk_root != NULL && (d = opendir(s->disk_root)) != NULL) {
            while ((e = readdir(d)) != NULL) {
                size_t len = strlen(e->d_name);
                char *dash = strrchr(e->d_name, '-');
                if (len < 5 || strcmp(e->d_name + len - 4, ".blk") != 0 || dash == NULL)
                    continue;
                uint8_t key[KEYMAX];
                size_t klen = (size_t)(dash - e->d_name) / 2;
                int ok = klen >= 1 && klen <= KEYMAX && (size_t)(dash - e->d_name) == 2 * klen;
                for (size_t b = 0; ok && b < klen; b++) {
                    unsigned v;
                    ok = sscanf(e->d_name + 2 * b, "%2x", &v) == 1;
                    key[b] = (uint8_t)v;
                }
                unsigned long long seq = strtoull(dash + 1, NULL, 16);
                int64_t f = ok ? h_find(s, key, klen) : -1;
                if (f >= 0 && R(s, (uint32_t)f)->state == S_DISK &&
                        (((uint64_t)R(s, (uint32_t)f)->slab << 32) | R(s, (uint32_t)f)->chunk) == seq)
                    continue;
                snprintf(path, sizeof path, "%s/%s", s->disk_root, e->d_name);
                removed += unlink(path) == 0;
            }
            closedir(d);
        }
        unlock(s);
    }
    Py_END_ALLOW_THREADS
    if (r < 0 || s->dmg)
        return lock_error(s);
    return PyLong_FromSsize_t(removed);
}

static PyObject *Idx_slab_file(Idx *s, PyObject *args) {
    unsigned slot, gen;
    if (!PyArg_ParseTuple(args, "II", &slot, &gen))
        return NULL;
    char path[4096];
    slab_path(s, slot, gen, path, sizeof path);
    return PyUnicode_FromString(path);
}

static PyObject *Idx_get_slot(Idx *s, void *closure) {
    (void)closure;
    return PyLong_FromLong(s->slot);
}

static PyObject *py_size_class(PyObject *self, PyObject *arg) {
    (void)self;
    unsigned long long n = PyLong_AsUnsignedLongLong(arg);
    if (PyErr_Occurred())
        return NULL;
    return PyLong_FromUnsignedLongLong(size_class(n));
}

static PyMethodDef Idx_methods[] = {
    {"check", (PyCFunction)Idx_check, METH_NOARGS,
     "check() -> the inconsistencies of the index with its records (empty: none)"},
    {"put", (PyCFunction)Idx_put, METH_VARARGS, NULL},
    {"match", (PyCFunction)Idx_match, METH_O, NULL},
    {"contains", (PyCFunction)Idx_contains, METH_O, NULL},
    {"read_into", (PyCFunction)Idx_read_into, METH_VARARGS, NULL},
    {"lease", (PyCFunction)Idx_lease, METH_O, NULL},
    {"release", (PyCFunction)Idx_release, METH_VARARGS, NULL},
    {"drop_corrupt", (PyCFunction)Idx_drop_corrupt, METH_VARARGS, NULL},
    {"pin", (PyCFunction)Idx_pin, METH_VARARGS, NULL},
    {"delete", (PyCFunction)Idx_delete, METH_O, NULL},
    {"stats", (PyCFunction)Idx_stats, METH_NOARGS, NULL},
    {"bloom", (PyCFunction)Idx_bloom, METH_VARARGS, NULL},
    {"locate", (PyCFunction)Idx_locate, METH_O, NULL},
    {"settings", (PyCFunction)Idx_settings, METH_NOARGS, NULL},
    {"take_left", (PyCFunction)Idx_take_left, METH_NOARGS, NULL},
    {"reclaim_orphans", (PyCFunction)Idx_reclaim_orphans, METH_NOARGS, NULL},
    {"slab_file", (PyCFunction)Idx_slab_file, METH_VARARGS, NULL},
    {"set_spill", (PyCFunction)Idx_set_spill, METH_VARARGS, NULL},
    {"set_pool", (PyCFunction)Idx_set_pool, METH_O, NULL},
    {"quiescent", (PyCFunction)Idx_quiescent, METH_NOARGS, NULL},
    {"mark_gpu", (PyCFunction)Idx_mark_gpu, METH_NOARGS, NULL},
    {"events_claim", (PyCFunction)Idx_events_claim, METH_NOARGS, NULL},
    {"events_read", (PyCFunction)Idx_events_read, METH_VARARGS, NULL},
    {"events_take", (PyCFunction)Idx_events_take, METH_VARARGS, NULL},
    {"events_release", (PyCFunction)Idx_events_release, METH_NOARGS, NULL},
    {"close", (PyCFunction)Idx_close, METH_NOARGS, NULL},
    {"abandon", (PyCFunction)Idx_abandon, METH_NOARGS, NULL},
    {"keep_maps", (PyCFunction)Idx_keep_maps, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Idx_getset[] = {
    {"slot", (getter)Idx_get_slot, NULL, NULL, NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject IdxType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "storage_engine._stream.BlockIndex",
    .tp_basicsize = sizeof(Idx),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The shared-memory index and arena of a KV block store (see storage_engine/kv/).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Idx_init,
    .tp_dealloc = (destructor)Idx_dealloc,
    .tp_methods = Idx_methods,
    .tp_getset = Idx_getset,
};

/* chain_keys(prev, tokens, block_tokens) -> list of bytes: for each full block of the
 * int64 tokens, the xxh3-128 (canonical, big-endian) of the previous key followed by
 * the block's tokens: KeyChain.keys in one call (a Python hash per block was a quarter
 * of a small block's put) */
static PyObject *py_chain_keys(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer prev, tok;
    Py_ssize_t bt;
    if (!PyArg_ParseTuple(args, "y*y*n", &prev, &tok, &bt))
        return NULL;
    PyObject *out = NULL;
    if (xxh_oneshot128 == NULL || prev.len != 16 || bt < 1 || tok.len % 8) {
        PyErr_SetString(PyExc_ValueError, "chain_keys: a 16-byte key, int64 tokens and a "
                                          "positive block size (and bound xxhash)");
        goto done;
    }
    Py_ssize_t n = tok.len / 8 / bt;
    out = PyList_New(n);
    size_t len = 16 + (size_t)bt * 8;
    uint8_t *buf = PyMem_Malloc(len);
    if (out == NULL || buf == NULL) {
        Py_XDECREF(out);
        out = PyErr_NoMemory();
        PyMem_Free(buf);
        goto done;
    }
    memcpy(buf, prev.buf, 16);
    for (Py_ssize_t i = 0; i < n; i++) {
        memcpy(buf + 16, (const char *)tok.buf + (size_t)i * bt * 8, (size_t)bt * 8);
        xxh128_t h = xxh_oneshot128(buf, len);
        for (int b = 0; b < 8; b++) {
            buf[b] = (uint8_t)(h.high64 >> (56 - 8 * b));
            buf[8 + b] = (uint8_t)(h.low64 >> (56 - 8 * b));
        }
        PyObject *k = PyBytes_FromStringAndSize((const char *)buf, 16);
        if (k == NULL) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, i, k);
    }
    PyMem_Free(buf);
done:
    PyBuffer_Release(&prev);
    PyBuffer_Release(&tok);
    return out;
}

/* keys_fit(keys) -> bool: keys is a list of bytes objects of 1 to KEYMAX bytes each,
 * which the index takes as they are (the client's check of a batch's keys, a Python
 * loop, was 5 % of an 8 KiB block's read) */
static PyObject *py_keys_fit(PyObject *self, PyObject *keys) {
    (void)self;
    if (!PyList_CheckExact(keys))
        Py_RETURN_FALSE;
    Py_ssize_t n = PyList_GET_SIZE(keys);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *k = PyList_GET_ITEM(keys, i);
        if (!PyBytes_CheckExact(k) || PyBytes_GET_SIZE(k) < 1 || PyBytes_GET_SIZE(k) > KEYMAX)
            Py_RETURN_FALSE;
    }
    Py_RETURN_TRUE;
}

/* set_damage_error(cls): what a damaged namespace raises, cls(path, reason) (the store's
 * KVIndexDamaged; until it is set, RuntimeError) */
static PyObject *py_set_damage_error(PyObject *self, PyObject *cls) {
    (void)self;
    if (!PyType_Check(cls) || !PyType_IsSubtype((PyTypeObject *)cls,
                                                (PyTypeObject *)PyExc_Exception)) {
        PyErr_SetString(PyExc_TypeError, "set_damage_error takes an exception class");
        return NULL;
    }
    Py_XSETREF(damage_type, Py_NewRef(cls));
    Py_RETURN_NONE;
}

static PyMethodDef kv_functions[] = {
    {"set_fault", py_set_fault, METH_VARARGS,
     "set_fault(point, action, arg=0, after=1): arm a fault point (tests): action off, "
     "kill (SIGKILL) or sleep (arg microseconds), at the after-th hit"},
    {"fault_points", py_fault_points, METH_NOARGS, "fault_points() -> the points' names"},
    {"set_damage_error", py_set_damage_error, METH_O,
     "set_damage_error(cls) -> what a damaged namespace raises: cls(path, reason)"},
    {"keys_fit", py_keys_fit, METH_O,
     "keys_fit(keys) -> whether keys is a list of bytes of 1 to KEYMAX bytes each"},
    {"kept_maps", py_kept_maps, METH_VARARGS,
     "kept_maps(prune=True) -> (mappings, bytes, kept, reused) of pooled slab files"},
    {"size_class", py_size_class, METH_O, "size_class(nbytes) -> the chunk size of a block"},
    {"chain_keys", py_chain_keys, METH_VARARGS,
     "chain_keys(prev, tokens, block_tokens) -> the chained xxh3-128 key of each block"},
    {NULL, NULL, 0, NULL},
};

HIDDEN int kvindex_add_type(void *module) {
    PyObject *m = (PyObject *)module;
    if (PyType_Ready(&IdxType) < 0)
        return -1;
    Py_INCREF(&IdxType);
    if (PyModule_AddObject(m, "BlockIndex", (PyObject *)&IdxType) < 0) {
        Py_DECREF(&IdxType);
        return -1;
    }
    if (PyModule_AddFunctions(m, kv_functions) < 0)
        return -1;
    kept_pid = getpid();
    ncpus = sysconf(_SC_NPROCESSORS_ONLN);
    pthread_atfork(NULL, NULL, kv_atfork_child);
    PyModule_AddIntConstant(m, "E_OK", E_OK);
    PyModule_AddIntConstant(m, "E_FULL", E_FULL);
    PyModule_AddIntConstant(m, "E_TOO_BIG", E_TOO_BIG);
    PyModule_AddIntConstant(m, "E_NOSPACE", E_NOSPACE);
    PyModule_AddIntConstant(m, "KEYMAX", KEYMAX);
    PyModule_AddIntConstant(m, "MAX_PROCS", MAX_PROCS);
    return 0;
}
