/* Locking and repair: the namespace's process-shared robust mutex, the header's checks at
 * every lock, damage (a failed check of a shared file), and the rebuild of everything
 * derivable from the records after a holder died. Process slots' liveness (/proc). */
#include "kv.h"

PyObject *damage_type; /* what damage raises: (path, reason) -> exception (set_damage_error) */

/* a check of a shared file failed: the namespace is damaged (the first reason is kept).
 * `file` names the file under the namespace's root ("index.kvx", or a table's, a
 * slab's or the ring's name). Returns -1. */
int damaged(Idx *s, const char *file, const char *fmt, ...) {
    if (!s->dmg) {
        s->dmg = 1;
        snprintf(s->dmg_path, sizeof s->dmg_path, "%s/%s", s->root ? s->root : "?", file);
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(s->dmg_why, sizeof s->dmg_why, fmt, ap);
        va_end(ap);
    }
    if (s->hdr != NULL)
        __atomic_store_n(&s->hdr->ready, READY_DAMAGED, __ATOMIC_RELEASE);
    return -1;
}

static int vgen_damaged(Idx *s, uint32_t gen, const char *fmt, va_list ap) {
    char file[64], why[200];
    snprintf(file, sizeof file, "table-%u.kvx", gen);
    vsnprintf(why, sizeof why, fmt, ap);
    return damaged(s, file, "%s", why);
}

/* the table of generation gen is damaged */
int gen_damaged(Idx *s, uint32_t gen, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int r = vgen_damaged(s, gen, fmt, ap);
    va_end(ap);
    return r;
}

/* the table in use is damaged */
int table_damaged(Idx *s, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int r = vgen_damaged(s, s->table_gen, fmt, ap);
    va_end(ap);
    return r;
}

/* raise the handle's damage (with the GIL) */
PyObject *raise_damage(Idx *s) {
    PyObject *t = damage_type != NULL ? damage_type : PyExc_RuntimeError;
    if (damage_type == NULL) {
        PyErr_Format(t, "damaged: %s: %s", s->dmg_path, s->dmg_why);
        return NULL;
    }
    PyObject *e = PyObject_CallFunction(t, "ss", s->dmg_path, s->dmg_why);
    if (e != NULL) {
        PyErr_SetObject((PyObject *)Py_TYPE(e), e);
        Py_DECREF(e);
    }
    return NULL;
}

static uint64_t start_ticks(int pid) {
    char path[64], buf[1024];
    snprintf(path, sizeof path, "/proc/%d/stat", pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return 0;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0)
        return 0;
    buf[n] = 0;
    char *p = strrchr(buf, ')');
    if (p == NULL || p[1] == 0 || p[2] == 'Z')
        return 0;
    p += 2; /* the state field */
    for (int field = 3; field < 22; field++) {
        p = strchr(p, ' ');
        if (p == NULL)
            return 0;
        p++;
    }
    return strtoull(p, NULL, 10);
}

int proc_alive(const proc_t *p) {
    return p->used && p->pid > 0 && start_ticks(p->pid) == p->start;
}

static void rebuild(Idx *s);

/* the mutex, taken: 0, EOWNERDEAD, or an error. A lock word damaged outside the store
 * can name a holder that does not exist, which nobody would ever wake the waiters of:
 * one that stays the same for LOCK_STUCK_S seconds while its thread does not exist is
 * damage (a holder that dies is the kernel's to report: EOWNERDEAD). The wait is long
 * on purpose: a holder in another PID namespace (a container sharing /dev/shm) names a
 * thread this process cannot see, and only a lock held past this long by a live holder
 * could be taken for damage; nothing of the store holds it for more than a moment. */
#define LOCK_STUCK_S 30
static int take_mutex(Idx *s) {
    pthread_mutex_t *mu = &s->hdr->lock;
    int r = pthread_mutex_trylock(mu);
    if (r != EBUSY)
        return r;
    int stuck = 0;
    uint32_t last = 0;
    for (;;) {
        struct timespec t;
        clock_gettime(CLOCK_REALTIME, &t);
        t.tv_sec += 1;
        r = pthread_mutex_timedlock(mu, &t);
        if (r != ETIMEDOUT)
            return r;
#ifdef __GLIBC__
        uint32_t w = (uint32_t)__atomic_load_n(&mu->__data.__lock, __ATOMIC_RELAXED);
        pid_t tid = (pid_t)(w & 0x3fffffffu); /* FUTEX_TID_MASK */
        int gone = tid == 0 || (kill(tid, 0) != 0 && errno == ESRCH);
        stuck = gone && (stuck == 0 || w == last) ? stuck + 1 : 0;
        last = w;
        if (stuck >= LOCK_STUCK_S) {
            damaged(s, "index.kvx", "its lock is held by thread %d, which does not exist",
                    (int)tid);
            return EDEADLK;
        }
#endif
    }
}

/* the header's fields that every step reads can be (under the lock: they change only
 * under it); the table's sizes are checked where it is mapped */
static int hdr_check(Idx *s) {
    hdr_t *h = s->hdr;
    if (h->ready != 1)
        return damaged(s, "index.kvx", h->ready == READY_DAMAGED
                       ? "marked damaged: a check of the namespace's files failed"
                       : "its ready mark is %u", h->ready);
    if (h->magic != KV_MAGIC || h->version != KV_VERSION)
        return damaged(s, "index.kvx", "it is not a block index of this version");
    if (h->nslabs > MAX_SLABS || h->eviction > EV_S3FIFO || h->ev_pub > MAX_PROCS ||
            (h->ev_ring != 0 && h->ev_ring != EV_RING_BYTES))
        return damaged(s, "index.kvx", "%u slabs, eviction %u, publisher %u, a ring of "
                       "%llu bytes", h->nslabs, h->eviction, h->ev_pub,
                       (unsigned long long)h->ev_ring);
    if (h->tables != s->tables || h->bump > s->ncap || h->free_rec > h->bump ||
            h->nrecs > h->bump || h->rehash_at > s->onb)
        return damaged(s, "index.kvx", "table generation %u (mapped: %u, of %llu records), "
                       "%llu made, free from %llu, %llu in use, %llu of %llu buckets moved",
                       h->table_gen, s->table_gen, (unsigned long long)s->ncap,
                       (unsigned long long)h->bump, (unsigned long long)h->free_rec,
                       (unsigned long long)h->nrecs, (unsigned long long)h->rehash_at,
                       (unsigned long long)s->onb);
    for (int q = 0; q < NQ; q++)
        if (h->q[q].head > h->bump || h->q[q].tail > h->bump || h->q[q].len > h->bump ||
                (h->q[q].len == 0) != (h->q[q].head == 0))
            return damaged(s, "index.kvx", "queue %d: %llu long, from %u to %u", q,
                           (unsigned long long)h->q[q].len, h->q[q].head, h->q[q].tail);
    return 0;
}

/* the lock, the header checked and the table mapped: 0, or -1 (errno; or damage, see
 * damaged(), with the lock let go). A holder that died is repaired (rebuild) before
 * the mutex is marked consistent, and only where the repair could be made: otherwise
 * it is let go unmarked, and every later lock fails (ENOTRECOVERABLE: damaged). */
int lock(Idx *s) {
    hdr_t *h = s->hdr;
    if (s->dmg)
        return -1;
    int r = take_mutex(s);
    int dead_owner = r == EOWNERDEAD;
    if (r != 0 && !dead_owner) {
        if (!s->dmg)
            damaged(s, "index.kvx", r == ENOTRECOVERABLE
                    ? "its lock is unusable: a holder died and its repair failed"
                    : "its lock cannot be taken (error %d)", r);
        return -1;
    }
    int saved = 0;
    if (s->tables != __atomic_load_n(&h->tables, __ATOMIC_ACQUIRE) || s->table == NULL) {
        /* the header's basic marks before its sizes are believed */
        if (h->ready != 1 || h->magic != KV_MAGIC || h->version != KV_VERSION)
            hdr_check(s);
        else if (map_table(s) < 0)
            saved = errno ? errno : EIO;
    }
    if (!s->dmg && !saved)
        hdr_check(s);
    if (!s->dmg && !saved && dead_owner)
        rebuild(s);
    if (s->dmg || saved) {
        /* a dead holder's mutex is let go unrepaired: ENOTRECOVERABLE from now on */
        pthread_mutex_unlock(&h->lock);
        errno = saved ? saved : EIO;
        return -1;
    }
    if (dead_owner)
        pthread_mutex_consistent(&h->lock);
    h->write_epoch++;
    return 0;
}


/* everything derivable from the records, after a process died holding the lock */
static void rebuild(Idx *s) {
    hdr_t *h = s->hdr;
    /* one window of the buckets' seqlock for all of it (a dead holder may have left
     * tseq odd: tseq_end makes it even) */
    tseq_begin(h);
    memset(s->buckets, 0, s->nb * 8); /* the mapped table's: its own header's size */
    /* every record goes into the table in use: a growth's move out of the old one is
     * over (its file goes, with the next table's file of a growth killed before it
     * named it) */
    if (h->old_gen != 0) {
        __atomic_store_n(&h->tables, (uint64_t)h->table_gen, __ATOMIC_RELEASE);
        drop_old(s);
        h->rehash_at = 0;
    }
    {
        char other[4096];
        if (h->table_gen - 1 != 0) {
            table_path(s, h->table_gen - 1, other, sizeof other);
            unlink(other);
        }
        table_path(s, h->table_gen + 1, other, sizeof other);
        unlink(other);
    }
    memset(h->q, 0, sizeof h->q);
    for (int c = 0; c < NCOUNTERS; c++)
        if (c != C_HITS && c != C_MISSES && c != C_EVICTIONS && c != C_SPILLS &&
                c != C_CORRUPT && c != C_SLAB_DROPS && c != C_ARENA_BYTES &&
                c != C_RECLAIM_SCANS && c != C_META_BYTES)
            h->count[c] = 0;
    /* chunks in use, per slab, as a bitmap */
    uint8_t *used[MAX_SLABS] = {0};
    for (uint32_t k = 0; k < h->nslabs; k++)
        if (h->slabs[k].live == SLAB_LIVE && !slab_ok(h, &h->slabs[k])) {
            tseq_end(h);
            slab_damaged(s, k);
            return;
        }
    for (uint32_t k = 0; k < h->nslabs; k++)
        if (h->slabs[k].live == SLAB_LIVE)
            used[k] = calloc((h->slabs[k].nchunks + 7) / 8, 1);
    h->free_rec = 0;
    h->nrecs = 0;
    for (uint64_t j = h->bump; j-- > 0;) {
        uint32_t i = (uint32_t)j;
        rec_t *r = R(s, i);
        r->queue = 0;
        r->prev = r->next = 0;
        int holds = r->state == S_WRITING || r->state == S_HOST || r->state == S_ZOMBIE;
        if (r->state == S_FREE || r->state > S_GHOST || r->klen == 0 || r->klen > KEYMAX ||
                (holds && (r->slab >= h->nslabs || h->slabs[r->slab].live != SLAB_LIVE ||
                           r->chunk >= h->slabs[r->slab].nchunks))) {
            r->state = S_FREE;
            r->writer = 0;
            r->next = (uint32_t)h->free_rec;
            h->free_rec = i + 1;
            r->gen++;
            continue;
        }
        h->nrecs++;
        if (holds && used[r->slab])
            used[r->slab][r->chunk / 8] |= (uint8_t)(1 << (r->chunk % 8));
        /* a spilled block being promoted (its promoter, outside the lock, may live on):
         * its chunk stays held, the block out of the disk queue */
        int promoting = r->state == S_DISK && r->writer && r->writer <= MAX_PROCS &&
                        r->pslab < h->nslabs && h->slabs[r->pslab].live == SLAB_LIVE &&
                        !h->slabs[r->pslab].meta && r->pchunk < h->slabs[r->pslab].nchunks;
        if (r->state == S_DISK && !promoting)
            r->writer = 0;
        if (promoting && used[r->pslab])
            used[r->pslab][r->pchunk / 8] |= (uint8_t)(1 << (r->pchunk % 8));
        if (holds && r->meta_len > INLINE_META && r->mslab < h->nslabs && used[r->mslab] &&
                r->mchunk < h->slabs[r->mslab].nchunks)
            used[r->mslab][r->mchunk / 8] |= (uint8_t)(1 << (r->mchunk % 8));
        if (r->state != S_ZOMBIE &&
                h_insert_raw(s->buckets, s->nb, khash(h, r->key, r->klen), i) < 0)
            table_damaged(s, "no bucket is free for record %u", i);
        if (r->state == S_HOST) {
            h->count[C_HOST_BLOCKS]++;
            h->count[C_HOST_BYTES] += r->nbytes;
            if (r->pins)
                h->count[C_PINNED]++;
            else
                q_push(s, Q_SMALL, i);
        } else if (r->state == S_DISK) {
            h->count[C_DISK_BLOCKS]++;
            h->count[C_DISK_BYTES] += r->nbytes;
            if (r->pins)
                h->count[C_PINNED]++;
            if (!promoting)
                q_push(s, Q_DISK, i);
        } else if (r->state == S_GHOST) {
            q_push(s, Q_GHOST, i);
        }
    }
    tseq_end(h);
    for (uint32_t k = 0; k < h->nslabs; k++) {
        slab_t *sl = &h->slabs[k];
        if (sl->live != SLAB_LIVE || used[k] == NULL)
            continue;
        char *base = slab_base(s, k);
        sl->used = 0;
        sl->free_head = 0;
        for (uint32_t c = sl->bump; c-- > 0;) {
            if (used[k][c / 8] >> (c % 8) & 1) {
                sl->used++;
            } else if (base != NULL) {
                memcpy(base + (size_t)c * sl->csize, &sl->free_head, 4);
                sl->free_head = c + 1;
            }
        }
        free(used[k]);
    }
    /* a holder died mid-change: the publisher announces the store afresh */
    ev_put(s, EVT_CLEARED, 0, NULL, 0, NULL, 0);
}

/* ---------------------------------------------------------------------------------- */
/* the Python type: arguments */
