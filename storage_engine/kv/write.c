/* Writes: put (reserve under the lock, copy outside it, publish under it), pin, delete. */
#include "kv.h"

static void set_meta(Idx *s, rec_t *r, const char *meta, size_t len, uint32_t mslab,
                     uint32_t mchunk) {
    r->meta_len = (uint32_t)len;
    if (len <= INLINE_META) {
        memcpy(r->meta, meta, len);
    } else {
        r->mslab = mslab;
        r->mchunk = mchunk;
        char *base = slab_base(s, mslab);
        if (base != NULL)
            memcpy(base + (size_t)mchunk * s->hdr->slabs[mslab].csize, meta, len);
    }
}

/* put(keys, addrs, sizes, metas, after_reserve=None) -> (stored: bytes, error, needed)
 * metas: one bytes for every block, or a sequence of bytes, one per key. The sources
 * are sizes[i] bytes at the raw addresses addrs[i]; the caller keeps them alive. On an
 * error nothing of the batch is stored. after_reserve, when given, is called between
 * the reservation and the copies (a test's way to stop a writer there). */
/* what a batch's new keys will take of the arena (under the lock, before its
 * reservations): the chunks of each of its first NEED_CLASSES size classes (the rest
 * are left to the reservations), and the bytes of all of them */
#define NEED_CLASSES 8
typedef struct {
    uint64_t cls[NEED_CLASSES], chunks[NEED_CLASSES], bytes;
    int ncls;
} needs_t;

static void batch_needs(Idx *s, const keyset_t *ks, const uint64_t *sizes, needs_t *nd) {
    nd->ncls = 0;
    nd->bytes = 0;
    for (Py_ssize_t i = 0; i < ks->n; i++) {
        int64_t f = h_find(s, ks->keys[i] + 1, ks->keys[i][0]);
        if (f >= 0 && R(s, (uint32_t)f)->state != S_GHOST)
            continue; /* present, or being written: no room taken */
        uint64_t c = size_class(sizes[i]);
        nd->bytes += c;
        int k = 0;
        while (k < nd->ncls && nd->cls[k] != c)
            k++;
        if (k == nd->ncls) {
            if (nd->ncls == NEED_CLASSES)
                continue;
            nd->cls[nd->ncls] = c;
            nd->chunks[nd->ncls++] = 0;
        }
        nd->chunks[k]++;
    }
}

/* under the lock, before a batch's reservations: the spills the batch will cause,
 * written outside the lock (see pspill_t), in rounds of PRESPILL_ROUND victims. 0, or
 * -1 (the lock could not be taken again: damage, unlocked) */
#define PRESPILL_ROUND 64
static int prespill(Idx *s, const needs_t *nd) {
    const uint64_t *cls = nd->cls, want = nd->bytes;
    int ncls = nd->ncls;
    pspill_t *ps = NULL;
    uint8_t ok[PRESPILL_ROUND];
    uint64_t last = 0;
    for (int rounds = 0; rounds < 1024 && !s->dmg; rounds++) {
        uint64_t room = room_for(s, cls, ncls);
        if (want <= room || (rounds > 0 && room <= last))
            break; /* room enough, or the last round made none (its victims were of other
                    * sizes): the reservations evict as before */
        last = room;
        if (ps == NULL && (ps = malloc(sizeof *ps * PRESPILL_ROUND)) == NULL)
            break; /* the reservations evict as before */
        Py_ssize_t m = prespill_pick(s, want - room, ps, PRESPILL_ROUND);
        if (m == 0)
            break;
        unlock(s);
        for (Py_ssize_t j = 0; j < m; j++)
            ok[j] = spill_write(ps[j].path, ps[j].src, ps[j].nbytes, ps[j].meta, ps[j].mlen,
                                ps[j].want_meta) == 0;
        if (lock(s) < 0) {
            for (Py_ssize_t j = 0; j < m; j++) {
                if (ok[j])
                    unlink(ps[j].path);
                free(ps[j].meta);
            }
            free(ps);
            return -1;
        }
        prespill_commit(s, ps, m, ok);
    }
    free(ps);
    return 0;
}

/* under the lock, before a batch's reservations (and its spills): the new slabs the
 * batch will need, their files made with the lock let go (make_slab), at most
 * PREMAKE_MAX a batch. 0, or -1 (the lock could not be taken again: damage, unlocked) */
#define PREMAKE_MAX 64
static int premake(Idx *s, const needs_t *nd) {
    hdr_t *h = s->hdr;
    for (int k = 0, made = 0; k < nd->ncls && made < PREMAKE_MAX; k++) {
        for (;;) {
            uint64_t free_chunks = 0;
            for (uint32_t j = 0; j < h->nslabs; j++) {
                const slab_t *sl = &h->slabs[j];
                if (sl->live == SLAB_LIVE && !sl->meta && sl->csize == nd->cls[k] &&
                        sl->used <= sl->nchunks)
                    free_chunks += sl->nchunks - sl->used;
            }
            if (free_chunks >= nd->chunks[k] || made >= PREMAKE_MAX)
                break;
            if (nd->cls[k] > h->capacity)
                break; /* refused by its reservation */
            int r = make_slab(s, nd->cls[k]);
            if (r < 0)
                return -1;
            if (r == 0)
                break; /* no room for a slab: the reservations evict */
            made++;
        }
    }
    return 0;
}

PyObject *Idx_put(Idx *s, PyObject *args) {
    PyObject *keys_o, *addrs_o, *sizes_o, *metas_o, *after = Py_None;
    if (!PyArg_ParseTuple(args, "OOOO|O", &keys_o, &addrs_o, &sizes_o, &metas_o, &after))
        return NULL;
    if (!usable(s))
        return NULL;
    if (!xxh_bound()) {
        PyErr_SetString(PyExc_RuntimeError, "the xxhash functions are not bound");
        return NULL;
    }
    keyset_t ks;
    Py_buffer ab, sb;
    if (parse_batch(keys_o, addrs_o, sizes_o, &ks, &ab, &sb) < 0)
        return NULL;
    Py_ssize_t n = ks.n;
    const uint64_t *addrs = ab.buf, *sizes = sb.buf;
    PyObject *metas_fast = NULL;
    const char *one_meta = NULL;
    Py_ssize_t one_len = 0;
    const char **mptr = NULL;
    Py_ssize_t *mlen = NULL;
    PyObject *result = NULL;
    res_t *res = PyMem_Malloc(sizeof(res_t) * (size_t)(n ? n : 1));
    uint8_t *stored = PyMem_Calloc((size_t)(n ? n : 1), 1);
    uint64_t *sums = PyMem_Malloc(8 * (size_t)(n ? n : 1));
    if (res == NULL || stored == NULL || sums == NULL) {
        PyErr_NoMemory();
        goto out;
    }
    if (PyBytes_Check(metas_o)) {
        one_meta = PyBytes_AS_STRING(metas_o);
        one_len = PyBytes_GET_SIZE(metas_o);
    } else {
        metas_fast = PySequence_Fast(metas_o, "metas must be bytes or a sequence of bytes");
        if (metas_fast == NULL)
            goto out;
        if (PySequence_Fast_GET_SIZE(metas_fast) != n) {
            PyErr_Format(PyExc_ValueError, "%zd keys but %zd metas", n,
                         PySequence_Fast_GET_SIZE(metas_fast));
            goto out;
        }
        mptr = PyMem_Malloc(sizeof(char *) * (size_t)(n ? n : 1));
        mlen = PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)(n ? n : 1));
        if (mptr == NULL || mlen == NULL) {
            PyErr_NoMemory();
            goto out;
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *m = PySequence_Fast_GET_ITEM(metas_fast, i);
            char *p;
            if (!PyBytes_Check(m) || PyBytes_AsStringAndSize(m, &p, &mlen[i]) < 0) {
                PyErr_Format(PyExc_ValueError, "meta %zd must be bytes", i);
                goto out;
            }
            mptr[i] = p;
        }
    }
    for (Py_ssize_t i = 0; i < n; i++)
        if (sizes[i] == 0 || sizes[i] > 0xffffffffffULL) {
            PyErr_Format(PyExc_ValueError, "block %zd: %llu bytes", i,
                         (unsigned long long)sizes[i]);
            goto out;
        }
    int err = E_OK;
    uint64_t needed = 0;
    Py_ssize_t nres = 0;
    int locked = 0;
    Py_BEGIN_ALLOW_THREADS
    hdr_t *h = s->hdr;
    if (lock(s) < 0) {
        err = E_IO;
        goto unlocked;
    }
    int reclaimed = 0;
    needs_t nd;
    if (n > 0)
        batch_needs(s, &ks, sizes, &nd);
    if (n > 0 && premake(s, &nd) < 0) {
        err = E_IO;
        goto unlocked;
    }
    if (s->disk_root != NULL && n > 0 && prespill(s, &nd) < 0) {
        err = E_IO;
        goto unlocked;
    }
    for (Py_ssize_t i = 0; i < n && err == E_OK; i++) {
        uint8_t *k = ks.keys[i];
        int64_t f = h_find(s, k + 1, k[0]);
        int was_ghost = 0;
        if (f >= 0 && rec_check(s, (uint32_t)f) < 0)
            f = -2;
        if (s->dmg) {
            err = E_IO;
            break;
        }
        if (f >= 0) {
            rec_t *r = R(s, (uint32_t)f);
            if (r->state == S_HOST || r->state == S_DISK)
                continue;
            if (r->state == S_WRITING) {
                if (r->writer == (uint32_t)s->slot + 1 ||
                        proc_alive(&h->procs[r->writer - 1]))
                    continue;
                /* its writer died mid-put: the key is ours (claimed at once, so that
                 * the reclaim pass of an allocation below leaves the record alone) */
                release_chunk(s, r->slab, r->chunk);
                meta_free(s, r);
                r->writer = (uint32_t)s->slot + 1;
                r->gen++;
            } else if (r->state == S_GHOST) {
                q_remove(s, (uint32_t)f);
                was_ghost = 1;
            }
        }
        size_t ml = one_meta ? (size_t)one_len : (size_t)mlen[i];
        const char *mp = one_meta ? one_meta : mptr[i];
        uint32_t slot, chunk, mslab = 0, mchunk = 0;
        int untouched = 0;
        err = allocate(s, size_class(sizes[i]), &slot, &chunk, &reclaimed, &untouched);
        if (err == E_OK && ml > INLINE_META) {
            err = allocate_meta(s, size_class(ml), &mslab, &mchunk);
            if (err != E_OK)
                release_chunk(s, slot, chunk);
        }
        if (err == E_OK && s->dmg) { /* found meanwhile (an eviction's checks) */
            release_chunk(s, slot, chunk);
            err = E_IO;
        }
        if (err != E_OK) {
            needed = sizes[i];
            if (f >= 0 && was_ghost)
                q_push(s, Q_GHOST, (uint32_t)f);
            else if (f >= 0) { /* the dead writer's record, now empty */
                h_delete(s, (uint32_t)f);
                rec_free(s, (uint32_t)f);
            }
            break;
        }
        /* allocate may have moved records (eviction never frees a record we hold:
         * ghosts and dead writers' records are not evictable) */
        if (f < 0) {
            f = rec_new(s);
            if (f < 0) {
                release_chunk(s, slot, chunk);
                if (ml > INLINE_META)
                    release_chunk(s, mslab, mchunk);
                err = E_NOSPACE;
                needed = sizes[i];
                break;
            }
            rec_t *r = R(s, (uint32_t)f);
            r->klen = k[0];
            memcpy(r->key, k + 1, KEYMAX);
            if (h_insert(s, khash(h, r->key, r->klen), (uint32_t)f) < 0) {
                table_damaged(s, "no bucket of %llu is free", (unsigned long long)s->nb);
                rec_free(s, (uint32_t)f);
                release_chunk(s, slot, chunk);
                if (ml > INLINE_META)
                    release_chunk(s, mslab, mchunk);
                err = E_IO;
                break;
            }
        }
        rec_t *r = R(s, (uint32_t)f);
        r->slab = slot;
        r->chunk = chunk;
        r->nbytes = sizes[i];
        r->pins = 0;
        r->readers = 0;
        r->freq = was_ghost; /* remembered: on_insert puts it in main */
        r->writer = (uint32_t)s->slot + 1;
        set_meta(s, r, mp, ml, mslab, mchunk);
        r->state = S_WRITING;
        res[nres].idx = (uint32_t)f;
        res[nres].gen = r->gen;
        res[nres].slab = slot;
        res[nres].chunk = chunk;
        res[nres].i = i;
        res[nres].untouched = (uint32_t)untouched;
        nres++;
    }
    if (err == E_OK && s->dmg)
        err = E_IO;
    if (err != E_OK) { /* all or nothing: give the batch's chunks back */
        for (Py_ssize_t j = 0; j < nres; j++) {
            rec_t *r = R(s, res[j].idx);
            release_chunk(s, r->slab, r->chunk);
            meta_free(s, r);
            h_delete(s, res[j].idx);
            rec_free(s, res[j].idx);
        }
        nres = 0;
    }
    /* the chunks' files are whole before anything is written through the mappings */
    for (Py_ssize_t j = 0; j < nres && err == E_OK; j++)
        if (((j == 0 || res[j].slab != res[j - 1].slab) && slab_check(s, res[j].slab) < 0) ||
                res_at(s, &res[j], sizes[res[j].i]) < 0)
            err = E_IO;
    if (err != E_OK) {
        for (Py_ssize_t j = 0; j < nres; j++) {
            rec_t *r = R(s, res[j].idx);
            release_chunk(s, r->slab, r->chunk);
            meta_free(s, r);
            h_delete(s, res[j].idx);
            rec_free(s, res[j].idx);
        }
        nres = 0;
    }
    if (nres)
        FAULT("put.reserved");
    unlock(s);
    if (after != Py_None && nres) {
        Py_BLOCK_THREADS
        PyObject *r = PyObject_CallNoArgs(after);
        if (r == NULL)
            PyErr_WriteUnraisable(after);
        Py_XDECREF(r);
        Py_UNBLOCK_THREADS
    }
    /* chunks never written have no pages yet: make them in runs (the kernel fills a
     * range at twice the rate the copies fault it in, page by page) */
    for (Py_ssize_t j = 0; j < nres;) {
        if (!res[j].untouched) {
            j++;
            continue;
        }
        Py_ssize_t k = j + 1;
        while (k < nres && res[k].untouched && res[k].slab == res[j].slab &&
               res[k].chunk == res[k - 1].chunk + 1)
            k++;
        uintptr_t lo = (uintptr_t)res[j].at;
        uintptr_t hi = (uintptr_t)(res[k - 1].at + res[k - 1].csize);
        lo &= ~(uintptr_t)(PAGE - 1);
        if (hi - lo >= 16 * PAGE)
            madvise((void *)lo, hi - lo, 23 /* MADV_POPULATE_WRITE */);
        j = k;
    }
    /* the copies, outside the lock: writers copy in parallel */
    copy_job_t job = {s, res, sums, addrs, sizes, NULL, ks.keys, CP_PUT, 0, 0, 0};
    copy_all(job, nres);
    if (nres)
        FAULT("put.copied");
    if (nres && lock(s) == 0) {
        locked = 1;
        for (Py_ssize_t j = 0; j < nres; j++) {
            rec_t *r = R(s, res[j].idx);
            if (r->state != S_WRITING || r->gen != res[j].gen ||
                    r->writer != (uint32_t)s->slot + 1)
                continue; /* taken from us: we were thought dead */
            r->csum = sums[j];
            r->writer = 0;
            r->state = S_HOST;
            int was_ghost = r->freq;
            on_insert(s, res[j].idx, was_ghost);
            h->count[C_HOST_BLOCKS]++;
            h->count[C_HOST_BYTES] += r->nbytes;
            stored[res[j].i] = 1;
            ev_rec(s, EVT_STORED, MED_CPU, res[j].idx);
            FAULT("put.publish");
        }
        unlock(s);
        table_premake(s); /* the next table's file, where this one fills up */
    }
    (void)locked;
unlocked:
    Py_END_ALLOW_THREADS
    if (err == E_IO || s->dmg) {
        lock_error(s);
        goto out;
    }
    result = Py_BuildValue("(y#iK)", (const char *)stored, n, err,
                           (unsigned long long)needed);
out:
    PyMem_Free(res);
    PyMem_Free(stored);
    PyMem_Free(sums);
    PyMem_Free(mptr);
    PyMem_Free(mlen);
    Py_XDECREF(metas_fast);
    PyBuffer_Release(&ab);
    PyBuffer_Release(&sb);
    free_keys(&ks);
    return result;
}

/* ---------------------------------------------------------------------------------- */
/* reads of the index */

/* (under the lock) a pin's count of readable record i moved by delta: 1 moved, 0 not
 * (not readable, or it would go below 0); a record's first pin takes it off its queue,
 * its last puts it back */
static int pin_one(Idx *s, uint32_t i, int delta) {
    hdr_t *h = s->hdr;
    rec_t *rr = R(s, i);
    if (!readable(rr) || (int64_t)rr->pins + delta < 0)
        return 0;
    uint32_t before = rr->pins;
    rr->pins = (uint32_t)((int64_t)rr->pins + delta);
    if (before == 0 && rr->pins > 0) {
        h->count[C_PINNED]++;
        if (rr->state == S_HOST)
            q_remove(s, i);
    } else if (before > 0 && rr->pins == 0) {
        h->count[C_PINNED]--;
        if (rr->state == S_HOST)
            q_push(s, Q_SMALL, i);
    }
    return 1;
}

PyObject *Idx_pin(Idx *s, PyObject *args) {
    PyObject *keys_o;
    int delta;
    if (!PyArg_ParseTuple(args, "Oi", &keys_o, &delta))
        return NULL;
    if (!usable(s))
        return NULL;
    keyset_t ks;
    if (parse_keys(keys_o, &ks) < 0)
        return NULL;
    Py_ssize_t changed = 0;
    int r;
    void *state = xxh_state_new();
    /* a pin brings spilled blocks back (in memory if they fit), their files read with
     * the lock let go, as get's promotion: the keys begun (their index in ps) are
     * pinned once they are HOST, the others at once */
    promo_t *ps = NULL;
    Py_ssize_t *pat = NULL, np = 0;
    if (delta > 0 && state != NULL && ks.n > 0 &&
            ((ps = malloc(sizeof *ps * (size_t)ks.n)) == NULL ||
             (pat = malloc(sizeof *pat * (size_t)ks.n)) == NULL)) {
        free(ps);
        xxh_state_free(state);
        free_keys(&ks);
        return PyErr_NoMemory();
    }
    Py_BEGIN_ALLOW_THREADS
    r = lock(s);
    if (r == 0) {
        int reclaimed = 0;
        for (Py_ssize_t i = 0; i < ks.n && !s->dmg; i++) {
            int64_t f = h_find(s, ks.keys[i] + 1, ks.keys[i][0]);
            if (f < 0 || rec_check(s, (uint32_t)f) < 0)
                continue;
            if (ps != NULL && R(s, (uint32_t)f)->state == S_DISK &&
                    promote_begin(s, (uint32_t)f, &ps[np], &reclaimed) == 1) {
                pat[np++] = i;
                continue;
            }
            changed += pin_one(s, (uint32_t)f, delta);
        }
        if (np > 0 && !s->dmg) {
            unlock(s); /* the spill files' reads, with the lock let go */
            for (Py_ssize_t k = 0; k < np; k++)
                promote_io(s, &ps[k], state);
            r = lock(s);
        }
        if (r == 0) {
            for (Py_ssize_t k = 0; k < np; k++) {
                if (s->dmg) { /* given back: it stays on disk */
                    rec_t *rr = R(s, ps[k].idx);
                    if (rr->state == S_DISK && rr->writer == (uint32_t)s->slot + 1)
                        promote_abandon(s, ps[k].idx);
                    continue;
                }
                promote_finish(s, &ps[k]); /* HOST, or on disk still: pinned there */
                const uint8_t *key = ks.keys[pat[k]];
                int64_t f = h_find(s, key + 1, key[0]);
                if (f >= 0 && rec_check(s, (uint32_t)f) == 0)
                    changed += pin_one(s, (uint32_t)f, delta);
            }
            unlock(s);
        }
        for (Py_ssize_t k = 0; k < np; k++)
            free(ps[k].meta); /* (a failed lock: their chunks are the reclaim's, or damage) */
    }
    Py_END_ALLOW_THREADS
    free(ps);
    free(pat);
    if (state != NULL)
        xxh_state_free(state);
    free_keys(&ks);
    if (r < 0 || s->dmg)
        return lock_error(s);
    return PyLong_FromSsize_t(changed);
}

PyObject *Idx_delete(Idx *s, PyObject *keys_o) {
    if (!usable(s))
        return NULL;
    keyset_t ks;
    if (parse_keys(keys_o, &ks) < 0)
        return NULL;
    Py_ssize_t n = 0;
    int r;
    Py_BEGIN_ALLOW_THREADS
    r = lock(s);
    if (r == 0) {
        for (Py_ssize_t i = 0; i < ks.n && !s->dmg; i++) {
            int64_t f = h_find(s, ks.keys[i] + 1, ks.keys[i][0]);
            if (f < 0 || rec_check(s, (uint32_t)f) < 0)
                continue;
            rec_t *rr = R(s, (uint32_t)f);
            if (rr->state == S_HOST)
                remove_host(s, (uint32_t)f);
            else if (rr->state == S_DISK)
                drop_disk(s, (uint32_t)f, 1);
            else
                continue;
            n++;
        }
        unlock(s);
    }
    Py_END_ALLOW_THREADS
    free_keys(&ks);
    if (r < 0 || s->dmg)
        return lock_error(s);
    return PyLong_FromSsize_t(n);
}

/* ---------------------------------------------------------------------------------- */
/* KV events: a ring (events.kvx) of the blocks that entered and left the store, in the
 * order they did, written by whichever process changed the store (under the lock) while
 * a publisher is attached; one process per namespace (the publisher) reads it */
