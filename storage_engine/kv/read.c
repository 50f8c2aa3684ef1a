/* Reads: match and contains (the index only, without the lock), read_into (copies
 * checked by the records' generations, a seqlock), lease / release of zero-copy views,
 * promotion of spilled blocks back into the arena. */
#include "kv.h"

/* ---------------------------------------------------------------------------------- */
/* lookups without the lock
 *
 * match and contains read the table with no mutex, so that a lookup never waits for
 * another process's hold (a batch's commit, an allocation, a rebuild), let alone for
 * one that is descheduled while it holds it. The buckets change only under the lock
 * and inside a window of the header's seqlock (hdr_t.tseq odd: an insert, a delete's
 * backward shift, a rebuild). A lookup takes tseq before it probes and again after it
 * read the record's key and state, and believes what it read only where both are the
 * same even number and the table it probed is the one the header names. A record is
 * freed only after its bucket is deleted (a window), so the key read in a quiet window
 * is its record's own; its state is read once, a point in time. Every value is bounded
 * before it is used (a bucket's record by this process's mapping, the probe by the
 * table's size): a torn read is retried, never followed. A lookup that finds no quiet
 * window in LF_TRIES, or a table that grew, or a namespace not ready, takes the lock
 * (which remaps, and judges damage). Threads of this process hold the mapping
 * (maplock, read) while they probe it. */

#define LF_TRIES 64

void map_hold(Idx *s, int write) {
    if (s->maplock_ok)
        (void)(write ? pthread_rwlock_wrlock(&s->maplock)
                     : pthread_rwlock_rdlock(&s->maplock));
}

void map_let_go(Idx *s) {
    if (s->maplock_ok)
        pthread_rwlock_unlock(&s->maplock);
}

static inline void spin_pause(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* (under map_hold) the record of a key in one table read without the lock: its index,
 * -1 (absent), or -2 (a value out of bounds: torn, or damage for the lock to judge) */
static int64_t lf_find(Idx *s, const uint64_t *bk, uint64_t nb, uint64_t hash, uint64_t made,
                       const uint8_t *key, size_t klen) {
    uint64_t tag = hash & 0xffffffffu, mask = nb - 1, b = hash & mask;
    for (uint64_t probes = 0;; probes++) {
        uint64_t v = __atomic_load_n(&bk[b], __ATOMIC_RELAXED);
        if (!v)
            return -1;
        if (probes >= nb)
            return -2;
        if ((v >> 32) == tag) {
            uint64_t i = (v & 0xffffffffu) - 1;
            if (i >= s->ncap || i >= made)
                return -2;
            rec_t *r = &s->recs[i];
            uint8_t rk[KEYMAX];
            size_t rl = __atomic_load_n(&r->klen, __ATOMIC_RELAXED);
            memcpy(rk, r->key, KEYMAX);
            if (rl == klen && memcmp(rk, key, klen) == 0)
                return (int64_t)i;
        }
        b = (b + 1) & mask;
    }
}

/* (under map_hold) 1: the key's block is readable (host or disk), 0: it is not,
 * -1: no answer without the lock. During a growth's move the key is in the new table
 * or the old one (a move is one window of the seqlock: never in neither). */
int lf_present(Idx *s, const uint8_t *key, size_t klen) {
    hdr_t *h = s->hdr;
    if (s->table == NULL || __atomic_load_n(&h->ready, __ATOMIC_ACQUIRE) != 1)
        return -1;
    uint64_t hash = khash(h, key, klen);
    for (int t = 0; t < LF_TRIES; t++) {
        uint64_t q = __atomic_load_n(&h->tseq, __ATOMIC_ACQUIRE);
        if (q & 1) {
            spin_pause();
            continue;
        }
        if (__atomic_load_n(&h->tables, __ATOMIC_ACQUIRE) != s->tables)
            return -1; /* it grew, or a move ended: the lock remaps */
        /* records made: a bucket naming another is damage, the lock's to judge */
        uint64_t made = __atomic_load_n(&h->bump, __ATOMIC_RELAXED);
        int64_t f = lf_find(s, s->buckets, s->nb, hash, made, key, klen);
        if (f == -1 && s->onb != 0)
            f = lf_find(s, s->obuckets, s->onb, hash, made, key, klen);
        int found = 0;
        if (f >= 0) {
            uint8_t st = __atomic_load_n(&s->recs[f].state, __ATOMIC_RELAXED);
            found = st == S_HOST || st == S_DISK;
        }
        __atomic_thread_fence(__ATOMIC_ACQUIRE);
        if (__atomic_load_n(&h->tseq, __ATOMIC_RELAXED) != q)
            continue; /* the buckets changed while we read them */
        if (f == -2)
            return -1; /* in a quiet window: the lock's checks judge it */
        return found;
    }
    return -1;
}

PyObject *Idx_match(Idx *s, PyObject *keys_o) {
    if (!usable(s))
        return NULL;
    keyset_t ks;
    if (parse_keys(keys_o, &ks) < 0)
        return NULL;
    Py_ssize_t n = 0;
    int r = 0, rest = 0;
    Py_BEGIN_ALLOW_THREADS
    map_hold(s, 0);
    for (; n < ks.n; n++) {
        int p = lf_present(s, ks.keys[n] + 1, ks.keys[n][0]);
        if (p <= 0) {
            rest = p < 0; /* the rest with the lock */
            break;
        }
    }
    map_let_go(s);
    if (rest) {
        r = lock(s);
        if (r == 0) {
            for (; n < ks.n; n++) {
                int64_t f = h_find(s, ks.keys[n] + 1, ks.keys[n][0]);
                if (f < 0 || !readable(R(s, (uint32_t)f)))
                    break;
            }
            unlock(s);
        }
    }
    Py_END_ALLOW_THREADS
    free_keys(&ks);
    if (r < 0 || s->dmg)
        return lock_error(s);
    return PyLong_FromSsize_t(n);
}

PyObject *Idx_contains(Idx *s, PyObject *keys_o) {
    if (!usable(s))
        return NULL;
    keyset_t ks;
    if (parse_keys(keys_o, &ks) < 0)
        return NULL;
    PyObject *out = PyBytes_FromStringAndSize(NULL, ks.n);
    if (out == NULL) {
        free_keys(&ks);
        return NULL;
    }
    uint8_t *o = (uint8_t *)PyBytes_AS_STRING(out);
    int r = 0;
    Py_ssize_t i = 0;
    Py_BEGIN_ALLOW_THREADS
    map_hold(s, 0);
    for (; i < ks.n; i++) {
        int p = lf_present(s, ks.keys[i] + 1, ks.keys[i][0]);
        if (p < 0)
            break; /* the rest with the lock */
        o[i] = (uint8_t)p;
    }
    map_let_go(s);
    if (i < ks.n) {
        r = lock(s);
        if (r == 0) {
            for (; i < ks.n; i++) {
                int64_t f = h_find(s, ks.keys[i] + 1, ks.keys[i][0]);
                o[i] = f >= 0 && readable(R(s, (uint32_t)f));
            }
            unlock(s);
        }
    }
    Py_END_ALLOW_THREADS
    free_keys(&ks);
    if (r < 0 || s->dmg) {
        Py_DECREF(out);
        return lock_error(s);
    }
    return out;
}

/* ---------------------------------------------------------------------------------- */
/* promotion: a spilled block back into the arena, its file read outside the lock
 *
 * Under the lock a promotion takes a chunk for the block (an allocation, which may
 * evict others, never this block: it is not HOST) and names itself in the record
 * (writer: its process slot + 1, pslab:pchunk its chunk), which leaves the disk queue so
 * that no trim drops it; the record stays DISK, readable as before (read_into reads
 * its file). The file is read into the chunk and checked with the lock let go. Under
 * the lock again the record becomes HOST in that chunk. A delete or a drop meanwhile
 * makes the record a ZOMBIE holding the chunk for the promoter's reader bit, which the
 * promoter (or the reclaim of a dead one) ends; a promoter that died leaves its chunk
 * to the dead-process reclaim, which puts the record back on the disk queue. A get's
 * promotion and a pin's both run so (a pin of a promoted block pins it once HOST). */

/* (under the lock) a promotion of DISK record i given up, by whoever finds its promoter
 * gone: its chunk freed, the record back on the disk queue */
void promote_abandon(Idx *s, uint32_t i) {
    rec_t *r = R(s, i);
    if (chunk_ok(s->hdr, r->pslab, r->pchunk, 0))
        release_chunk(s, r->pslab, r->pchunk);
    r->writer = 0;
    if (!r->queue)
        q_push(s, Q_DISK, i);
}

/* (under the lock) begin promoting DISK record i: 1 begun, 0 no spill directory or
 * another process promotes it, -2 no room in the arena (it stays on disk) */
int promote_begin(Idx *s, uint32_t i, promo_t *p, int *reclaimed) {
    hdr_t *h = s->hdr;
    rec_t *r = R(s, i);
    if (s->disk_root == NULL || r->state != S_DISK || r->writer != 0)
        return 0;
    uint32_t slot, chunk;
    q_remove(s, i);
    if (allocate(s, size_class(r->nbytes), &slot, &chunk, reclaimed, NULL) != E_OK) {
        q_push(s, Q_DISK, i);
        return -2;
    }
    char *base = slab_base(s, slot);
    if (base == NULL) {
        release_chunk(s, slot, chunk);
        q_push(s, Q_DISK, i);
        return -2;
    }
    r = R(s, i);
    r->writer = (uint32_t)s->slot + 1;
    r->pslab = slot;
    r->pchunk = chunk;
    p->idx = i;
    p->gen = r->gen;
    p->slot = slot;
    p->chunk = chunk;
    p->dst = base + (size_t)chunk * h->slabs[slot].csize;
    p->nbytes = r->nbytes;
    p->csum = r->csum;
    p->seq = ((uint64_t)r->slab << 32) | r->chunk;
    p->meta_len = r->meta_len > INLINE_META ? r->meta_len : 0;
    p->klen = r->klen;
    memcpy(p->key, r->key, KEYMAX);
    p->meta = NULL;
    p->ok = 0;
    return 1;
}

/* (outside the lock) the promotion's reads: the file, of the length its record gives,
 * into the chunk, checked against the block's checksum; its metadata into memory */
void promote_io(Idx *s, promo_t *p, void *state) {
    char path[4096];
    spill_file(s, p->key, p->klen, p->seq, path, sizeof path);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return;
    struct stat st;
    if (fstat(fd, &st) != 0 || (uint64_t)st.st_size != p->nbytes + p->meta_len) {
        close(fd);
        return;
    }
    uint64_t got = 0;
    while (got < p->nbytes) {
        ssize_t m = pread(fd, p->dst + got, p->nbytes - got, (off_t)got);
        if (m <= 0)
            break;
        got += (uint64_t)m;
    }
    int ok = got == p->nbytes;
    if (ok && p->meta_len) {
        p->meta = malloc(p->meta_len);
        ok = p->meta != NULL &&
             pread(fd, p->meta, p->meta_len, (off_t)p->nbytes) == (ssize_t)p->meta_len;
    }
    close(fd);
    p->ok = ok && hash_only(state, p->dst, p->nbytes) == p->csum;
    FAULT("promote.read");
}

/* (under the lock) the promotion's end: 1 the block is HOST in its chunk, -2 back on
 * disk (no room for its metadata), -1 corrupt or missing (dropped), 0 gone meanwhile
 * (deleted or dropped: the ZOMBIE that held our chunk ended here) */
int promote_finish(Idx *s, promo_t *p) {
    hdr_t *h = s->hdr;
    uint32_t i = p->idx;
    rec_t *r = R(s, i);
    uint64_t bit = 1ULL << s->slot;
    if (r->state == S_ZOMBIE && (r->readers & bit) && r->slab == p->slot &&
            r->chunk == p->chunk) {
        r->readers &= ~bit;
        if (!r->readers) {
            release_chunk(s, r->slab, r->chunk);
            meta_free(s, r);
            rec_free(s, i);
        }
        return 0;
    }
    if (r->state != S_DISK || r->writer != (uint32_t)s->slot + 1 || r->pslab != p->slot ||
            r->pchunk != p->chunk || r->gen != p->gen)
        return 0; /* not ours any more: only a repair of damage does that */
    r->writer = 0;
    if (!p->ok) {
        release_chunk(s, p->slot, p->chunk);
        drop_disk(s, i, 1);
        h->count[C_CORRUPT]++;
        return -1;
    }
    uint32_t ms = 0, mc = 0;
    if (p->meta_len) { /* its metadata back into the arena */
        char *mb = NULL;
        if (allocate_meta(s, size_class(p->meta_len), &ms, &mc) == E_OK &&
                (mb = slab_base(s, ms)) == NULL)
            release_chunk(s, ms, mc);
        if (mb == NULL) {
            release_chunk(s, p->slot, p->chunk);
            q_push(s, Q_DISK, i);
            return -2;
        }
        memcpy(mb + (size_t)mc * h->slabs[ms].csize, p->meta, p->meta_len);
        r = R(s, i);
    }
    ev_rec(s, EVT_REMOVED, MED_STORAGE, i); /* first: its metadata is in its file */
    char path[4096];
    spill_path(s, r, path, sizeof path);
    unlink(path);
    h->count[C_DISK_BLOCKS]--;
    h->count[C_DISK_BYTES] -= r->nbytes;
    /* the record names its chunks with the state that says so (see spill) */
    if (p->meta_len) {
        r->mslab = ms;
        r->mchunk = mc;
    }
    r->slab = p->slot;
    r->chunk = p->chunk;
    r->state = S_HOST;
    r->gen++;
    ev_rec(s, EVT_STORED, MED_CPU, i);
    on_insert(s, i, 0);
    h->count[C_HOST_BLOCKS]++;
    h->count[C_HOST_BYTES] += r->nbytes;
    return 1;
}

/* whether a readable record's size is not that of its bytes (under the lock, on the
 * path of a buffer of another size only): a host block whose checksum fails over the
 * bytes its record gives, a spilled block whose file is of another length */
static int size_lies(Idx *s, uint32_t i) {
    rec_t *r = R(s, i);
    if (r->state == S_DISK) {
        if (s->disk_root == NULL)
            return 0;
        char path[4096];
        struct stat st;
        spill_path(s, r, path, sizeof path);
        uint64_t want = r->nbytes + (r->meta_len > INLINE_META ? r->meta_len : 0);
        return stat(path, &st) == 0 && (uint64_t)st.st_size != want;
    }
    char *base = slab_base(s, r->slab);
    void *state = base != NULL ? xxh_state_new() : NULL;
    if (state == NULL)
        return 0;
    uint64_t sum = hash_only(state, base + (size_t)r->chunk * s->hdr->slabs[r->slab].csize,
                             r->nbytes);
    xxh_state_free(state);
    return sum != r->csum;
}

/* read_into(keys, addrs, sizes, verify) -> (status: bytes, error_index)
 * status per key: 0 absent, 1 copied, 2 corrupt (dropped). error_index >= 0: that
 * key's block has another size than its buffer; nothing was copied. */
enum { RD_ABSENT = 0, RD_OK = 1, RD_CORRUPT = 2, RD_COPY = 3 };

PyObject *Idx_read_into(Idx *s, PyObject *args) {
    PyObject *keys_o, *addrs_o, *sizes_o;
    int verify;
    if (!PyArg_ParseTuple(args, "OOOp", &keys_o, &addrs_o, &sizes_o, &verify))
        return NULL;
    if (!usable(s))
        return NULL;
    keyset_t ks;
    Py_buffer ab, sb;
    if (parse_batch(keys_o, addrs_o, sizes_o, &ks, &ab, &sb) < 0)
        return NULL;
    Py_ssize_t n = ks.n;
    const uint64_t *addrs = ab.buf, *sizes = sb.buf;
    PyObject *result = NULL;
    PyObject *status_o = PyBytes_FromStringAndSize(NULL, n);
    res_t *res = PyMem_Malloc(sizeof(res_t) * (size_t)(n ? n : 1));
    uint64_t *sums = PyMem_Malloc(8 * (size_t)(n ? n : 1));
    uint64_t *want = PyMem_Malloc(8 * (size_t)(n ? n : 1));
    if (status_o == NULL || res == NULL || sums == NULL || want == NULL) {
        PyErr_NoMemory();
        goto out;
    }
    uint8_t *st = (uint8_t *)PyBytes_AS_STRING(status_o);
    memset(st, RD_ABSENT, (size_t)n);
    Py_ssize_t bad_size = -1;
    int ioerr = 0;
    Py_BEGIN_ALLOW_THREADS
    hdr_t *h = s->hdr;
    /* round 0 reads every key; later rounds only those whose record moved meanwhile */
    for (int round = 0; round < 4 && !ioerr && bad_size < 0; round++) {
        if (lock(s) < 0) {
            ioerr = 1;
            break;
        }
        Py_ssize_t nres = 0, hits = 0, asked = 0;
        uint32_t checked = UINT32_MAX;
        for (Py_ssize_t i = 0; i < n; i++) {
            if (round > 0 && st[i] != RD_COPY)
                continue;
            st[i] = RD_ABSENT;
            asked++;
            int64_t f = h_find(s, ks.keys[i] + 1, ks.keys[i][0]);
            if (f >= 0 && readable(R(s, (uint32_t)f)) && rec_check(s, (uint32_t)f) < 0)
                f = -2;
            if (s->dmg) {
                ioerr = 1;
                break;
            }
            if (f < 0)
                continue;
            rec_t *r = R(s, (uint32_t)f);
            if (r->nbytes != sizes[i] && readable(r) && size_lies(s, (uint32_t)f)) {
                /* its record's size is not its bytes': damaged, dropped (not the
                 * caller's buffer at fault) */
                if (r->state == S_DISK)
                    drop_disk(s, (uint32_t)f, 1);
                else
                    remove_host(s, (uint32_t)f);
                h->count[C_CORRUPT]++;
                st[i] = RD_CORRUPT;
                continue;
            }
            if (r->state == S_DISK && s->disk_root != NULL) {
                /* straight from its file into the caller's buffer: a read never evicts
                 * (a batch larger than the arena reads whole) */
                if (r->nbytes != sizes[i]) {
                    bad_size = i;
                    break;
                }
                res[nres].idx = (uint32_t)f;
                res[nres].gen = r->gen;
                res[nres].slab = r->slab;
                res[nres].chunk = r->chunk;
                res[nres].i = i;
                res[nres].untouched = 2; /* on disk */
                want[nres] = r->csum;
                nres++;
                hits++;
                st[i] = RD_COPY;
                continue;
            }
            if (r->state != S_HOST)
                continue;
            if (r->nbytes != sizes[i]) {
                bad_size = i;
                break;
            }
            if (round == 0)
                on_access(s, (uint32_t)f);
            res[nres].idx = (uint32_t)f;
            res[nres].gen = r->gen;
            res[nres].slab = r->slab;
            res[nres].chunk = r->chunk;
            res[nres].i = i;
            res[nres].untouched = 0;
            want[nres] = r->csum;
            /* a batch's blocks sit in a few slabs: one fstat each, not one a block */
            if ((r->slab != checked && slab_check(s, r->slab) < 0) ||
                    res_at(s, &res[nres], r->nbytes) < 0) {
                ioerr = 1;
                break;
            }
            checked = r->slab;
            nres++;
            hits++;
            st[i] = RD_COPY;
        }
        if (bad_size >= 0 || ioerr || s->dmg) {
            for (Py_ssize_t i = 0; i < n; i++)
                st[i] = RD_ABSENT;
            unlock(s);
            break;
        }
        if (round == 0) {
            h->count[C_HITS] += (uint64_t)hits;
            h->count[C_MISSES] += (uint64_t)(asked - hits);
        }
        unlock(s);
        if (nres)
            FAULT("read.copy");
        copy_job_t job = {s, res, sums, addrs, sizes, want, ks.keys,
                          verify ? CP_READ : CP_READ_NOVERIFY, 0, 0, 0};
        copy_all(job, nres);
        if (nres == 0)
            break;
        if (lock(s) < 0) {
            ioerr = 1;
            break;
        }
        int again = 0;
        for (Py_ssize_t j = 0; j < nres; j++) {
            rec_t *r = R(s, res[j].idx);
            Py_ssize_t i = res[j].i;
            int on_disk = res[j].untouched == 2;
            if (r->state != (on_disk ? S_DISK : S_HOST) || r->gen != res[j].gen) {
                again = 1; /* it moved while we copied: read it again */
                continue;
            }
            if ((verify || on_disk) && sums[j] != want[j]) {
                if (on_disk)
                    drop_disk(s, res[j].idx, 1);
                else
                    remove_host(s, res[j].idx);
                h->count[C_CORRUPT]++;
                st[i] = RD_CORRUPT;
                continue;
            }
            st[i] = RD_OK;
        }
        unlock(s);
        if (!again)
            break;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        if (st[i] == RD_COPY)
            st[i] = RD_ABSENT; /* moved four times while we read it: a miss */
    Py_END_ALLOW_THREADS
    if (ioerr || s->dmg) {
        lock_error(s);
        goto out;
    }
    result = Py_BuildValue("(On)", status_o, bad_size);
out:
    Py_XDECREF(status_o);
    PyMem_Free(res);
    PyMem_Free(sums);
    PyMem_Free(want);
    PyBuffer_Release(&ab);
    PyBuffer_Release(&sb);
    free_keys(&ks);
    return result;
}

/* lease(keys) -> list of None (absent), -1 (corrupt: dropped), -2 (spilled, and the arena
 * has no room to bring it back now: every block in it is pinned or being read, or
 * another process is bringing it back; the caller reads a copy from disk) or
 * (idx, gen, slab, slab_gen, offset, nbytes, csum, meta): a read lease on each present
 * block (this process's bit in its record) for a zero-copy view, given back by release.
 * Spilled blocks come back into the arena with their files read outside the lock. */
typedef struct {
    uint32_t idx, gen, slab, slab_gen;
    uint64_t offset, nbytes, csum;
    size_t meta_at, meta_len;
    int status; /* 1 leased, 0 absent, -1 corrupt, -2 spilled (a copy), 2 promoting */
} leased_t;

typedef struct {
    char *metas; /* every leased block's metadata, one after another */
    size_t used, cap;
    int oom;
} metabuf_t;

/* (under the lock) a read lease on HOST record f for this process: 1, or 0 (its slab's
 * file cannot be checked) */
static int lease_host(Idx *s, uint32_t f, leased_t *l, metabuf_t *mb, uint32_t *checked) {
    hdr_t *h = s->hdr;
    rec_t *rr = R(s, f);
    if (rr->state != S_HOST || (rr->slab != *checked && slab_check(s, rr->slab) < 0))
        return 0;
    *checked = rr->slab;
    const char *mp = (const char *)rr->meta;
    if (rr->meta_len > INLINE_META)
        mp = s->maps[rr->mslab].base != NULL || slab_base(s, rr->mslab) != NULL
                 ? s->maps[rr->mslab].base + (size_t)rr->mchunk * h->slabs[rr->mslab].csize
                 : NULL;
    if (mb->used + rr->meta_len > mb->cap) {
        size_t cap = (mb->cap + rr->meta_len) * 2 + 256;
        char *m = realloc(mb->metas, cap);
        if (m == NULL) {
            mb->oom = 1;
            return 0;
        }
        mb->metas = m;
        mb->cap = cap;
    }
    l->meta_at = mb->used;
    l->meta_len = mp != NULL ? rr->meta_len : 0;
    if (mp != NULL && rr->meta_len) /* metas is NULL until the first meta */
        memcpy(mb->metas + mb->used, mp, rr->meta_len);
    mb->used += l->meta_len;
    slab_t *sl = &h->slabs[rr->slab];
    l->idx = f;
    l->gen = rr->gen;
    l->slab = rr->slab;
    l->slab_gen = sl->gen;
    l->offset = (uint64_t)rr->chunk * sl->csize;
    l->nbytes = rr->nbytes;
    l->csum = rr->csum;
    l->status = 1;
    rr->readers |= 1ULL << s->slot;
    on_access(s, f);
    return 1;
}

PyObject *Idx_lease(Idx *s, PyObject *keys_o) {
    if (!usable(s))
        return NULL;
    keyset_t ks;
    if (parse_keys(keys_o, &ks) < 0)
        return NULL;
    Py_ssize_t n = ks.n;
    leased_t *ls = PyMem_Calloc((size_t)(n ? n : 1), sizeof(leased_t));
    promo_t *ps = NULL;
    Py_ssize_t *pat = NULL; /* the key of each promotion */
    void *state = xxh_state_new();
    PyObject *out = NULL;
    metabuf_t mb = {NULL, 0, 0, 0};
    int r = 0;
    if (ls == NULL || state == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    r = lock(s);
    if (r == 0) {
        hdr_t *h = s->hdr;
        int reclaimed = 0;
        Py_ssize_t hits = 0, np = 0;
        uint64_t bit = 1ULL << s->slot;
        uint32_t checked = UINT32_MAX;
        for (Py_ssize_t i = 0; i < n && !mb.oom && !s->dmg; i++) {
            int64_t f = h_find(s, ks.keys[i] + 1, ks.keys[i][0]);
            if (f < 0 || !readable(R(s, (uint32_t)f)) || rec_check(s, (uint32_t)f) < 0)
                continue;
            if (R(s, (uint32_t)f)->state == S_DISK) {
                if (s->disk_root == NULL)
                    continue;
                if (ps == NULL && ((ps = malloc(sizeof *ps * (size_t)n)) == NULL ||
                                   (pat = malloc(sizeof *pat * (size_t)n)) == NULL)) {
                    mb.oom = 1;
                    break;
                }
                int p = promote_begin(s, (uint32_t)f, &ps[np], &reclaimed);
                if (p == 1) {
                    pat[np++] = i;
                    ls[i].status = 2;
                } else {
                    ls[i].status = -2; /* no room, or another process brings it back */
                }
                continue;
            }
            hits += lease_host(s, (uint32_t)f, &ls[i], &mb, &checked);
        }
        if (np > 0 && !mb.oom && !s->dmg) {
            unlock(s); /* the spill files' reads, with the lock let go */
            for (Py_ssize_t k = 0; k < np; k++)
                promote_io(s, &ps[k], state);
            r = lock(s);
        }
        if (r == 0) {
            for (Py_ssize_t k = 0; k < np; k++) {
                leased_t *l = &ls[pat[k]];
                int p = 0;
                if (mb.oom || s->dmg) { /* given back: it stays on disk */
                    rec_t *rr = R(s, ps[k].idx);
                    if (rr->state == S_DISK && rr->writer == (uint32_t)s->slot + 1)
                        promote_abandon(s, ps[k].idx);
                } else {
                    p = promote_finish(s, &ps[k]);
                }
                free(ps[k].meta);
                l->status = p < 0 ? p : 0;
                if (p == 1)
                    hits += lease_host(s, ps[k].idx, l, &mb, &checked);
            }
            if (mb.oom || s->dmg) /* give the leases back */
                for (Py_ssize_t i = 0; i < n; i++)
                    if (ls[i].status == 1)
                        R(s, ls[i].idx)->readers &= ~bit;
            h->count[C_HITS] += (uint64_t)hits;
            h->count[C_MISSES] += (uint64_t)(n - hits);
            unlock(s);
        } else {
            for (Py_ssize_t k = 0; k < np; k++)
                free(ps[k].meta); /* their chunks: the dead-process reclaim's, or damage */
        }
    }
    Py_END_ALLOW_THREADS
    if (r < 0 || s->dmg) {
        lock_error(s);
        goto done;
    }
    if (mb.oom) {
        PyErr_NoMemory();
        goto done;
    }
    out = PyList_New(n);
    for (Py_ssize_t i = 0; out != NULL && i < n; i++) {
        leased_t *l = &ls[i];
        PyObject *item;
        if (l->status == 0) {
            Py_INCREF(Py_None);
            item = Py_None;
        } else if (l->status < 0) {
            item = PyLong_FromLong(l->status);
        } else {
            item = Py_BuildValue("(IIIIKKKy#)", l->idx, l->gen, l->slab, l->slab_gen,
                                 (unsigned long long)l->offset,
                                 (unsigned long long)l->nbytes,
                                 (unsigned long long)l->csum,
                                 mb.metas != NULL ? mb.metas + l->meta_at : "",
                                 (Py_ssize_t)l->meta_len);
        }
        if (item == NULL) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, i, item);
    }
    /* on an error here the leases stay until this handle closes: no view was made */
done:
    PyMem_Free(ls);
    free(ps);
    free(pat);
    free(mb.metas);
    if (state != NULL)
        xxh_state_free(state);
    free_keys(&ks);
    return out;
}

/* release(idxs, gens): this process lets go of its leases (its last view of each) */
PyObject *Idx_release(Idx *s, PyObject *args) {
    PyObject *io, *go;
    if (!PyArg_ParseTuple(args, "OO", &io, &go))
        return NULL;
    if (!usable(s))
        return NULL;
    Py_buffer ib, gb;
    if (PyObject_GetBuffer(io, &ib, PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    Py_ssize_t n = ib.len / 8;
    if (u64_buffer(go, &gb, n, "gens") < 0) {
        PyBuffer_Release(&ib);
        return NULL;
    }
    const uint64_t *idx = ib.buf, *gen = gb.buf;
    int r;
    Py_BEGIN_ALLOW_THREADS
    r = lock(s);
    if (r == 0) {
        uint64_t bit = 1ULL << s->slot;
        for (Py_ssize_t j = 0; j < n; j++) {
            if (idx[j] >= s->hdr->bump)
                continue;
            rec_t *rr = R(s, (uint32_t)idx[j]);
            if (rr->gen != (uint32_t)gen[j] || !(rr->readers & bit))
                continue;
            rr->readers &= ~bit;
            if (rr->state == S_ZOMBIE && !rr->readers) {
                release_chunk(s, rr->slab, rr->chunk);
                meta_free(s, rr);
                rec_free(s, (uint32_t)idx[j]);
            }
        }
        unlock(s);
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&ib);
    PyBuffer_Release(&gb);
    if (r < 0 || s->dmg)
        return lock_error(s);
    Py_RETURN_NONE;
}

/* drop_corrupt(idx, gen) -> bool: a leased block whose bytes failed their checksum */
PyObject *Idx_drop_corrupt(Idx *s, PyObject *args) {
    unsigned idx, gen;
    if (!PyArg_ParseTuple(args, "II", &idx, &gen))
        return NULL;
    if (!usable(s))
        return NULL;
    int r, dropped = 0;
    Py_BEGIN_ALLOW_THREADS
    r = lock(s);
    if (r == 0) {
        if (idx < s->hdr->bump) {
            rec_t *rr = R(s, idx);
            if (rr->gen == gen && rr->state == S_HOST) {
                remove_host(s, idx);
                s->hdr->count[C_CORRUPT]++;
                dropped = 1;
            }
        }
        unlock(s);
    }
    Py_END_ALLOW_THREADS
    if (r < 0 || s->dmg)
        return lock_error(s);
    return PyBool_FromLong(dropped);
}

/* ---------------------------------------------------------------------------------- */
/* pins and deletes */
