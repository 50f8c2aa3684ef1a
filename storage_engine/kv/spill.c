/* Spill files: a victim's bytes and metadata written to the spill directory, its record
 * made a DISK block. A batch that will evict writes its victims' files outside the lock
 * (prespill), holding them by its reader bit meanwhile. */
#include "kv.h"

void spill_file(Idx *s, const uint8_t *key, size_t klen, uint64_t seq, char *out,
                       size_t n) {
    char hex[2 * KEYMAX + 1];
    if (klen > KEYMAX) /* a record's klen is a shared byte: rec_check flags it */
        klen = KEYMAX;
    for (size_t i = 0; i < klen; i++)
        snprintf(hex + 2 * i, 3, "%02x", key[i]);
    hex[2 * klen] = 0;
    snprintf(out, n, "%s/%s-%llx.blk", s->disk_root, hex, (unsigned long long)seq);
}

void spill_path(Idx *s, rec_t *r, char *out, size_t n) {
    spill_file(s, r->key, r->klen, ((uint64_t)r->slab << 32) | r->chunk, out, n);
}

/* read a spilled block's file into dst: 0, or -1 (missing or short) */
int read_spill(const char *path, char *dst, uint64_t nbytes) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    size_t got = 0;
    while (got < nbytes) {
        ssize_t m = pread(fd, dst + got, nbytes - got, (off_t)got);
        if (m <= 0)
            break;
        got += (size_t)m;
    }
    close(fd);
    return got == nbytes ? 0 : -1;
}

void note_left(Idx *s, rec_t *r) {
    if (!s->hdr->gpu_seen)
        return;
    if (s->nleft == s->left_cap) {
        size_t cap = s->left_cap ? s->left_cap * 2 : 64;
        uint8_t *p = realloc(s->left, cap * (KEYMAX + 1));
        if (p == NULL)
            return; /* a GPU copy left behind is dropped when it is next read */
        s->left = p;
        s->left_cap = cap;
    }
    uint8_t *e = s->left + s->nleft++ * (KEYMAX + 1);
    e[0] = r->klen <= KEYMAX ? r->klen : KEYMAX;
    memcpy(e + 1, r->key, KEYMAX);
}

void meta_free(Idx *s, rec_t *r) {
    if (r->meta_len > INLINE_META) {
        if (r->mslab != META_SPILLED && chunk_ok(s->hdr, r->mslab, r->mchunk, 1))
            release_chunk(s, r->mslab, r->mchunk);
        else if (r->mslab != META_SPILLED)
            table_damaged(s, "a record's metadata is in chunk %u of slab %u", r->mchunk,
                          r->mslab);
        r->meta_len = 0;
    }
}

/* a record's metadata: in the record, in its chunk of the arena, or (a spilled block's)
 * read from its file into *owned, which the caller frees; NULL, *len 0, when it cannot
 * be read */
const uint8_t *rec_meta(Idx *s, rec_t *r, uint32_t *len, uint8_t **owned) {
    *owned = NULL;
    *len = r->meta_len;
    if (r->meta_len <= INLINE_META)
        return r->meta;
    if (r->mslab == META_SPILLED) {
        char path[4096];
        spill_path(s, r, path, sizeof path);
        uint8_t *buf = r->meta_len <= (1u << 30) ? malloc(r->meta_len) : NULL;
        int fd = open(path, O_RDONLY | O_CLOEXEC);
        ssize_t got = fd >= 0 && buf != NULL ? pread(fd, buf, r->meta_len, (off_t)r->nbytes) : -1;
        if (fd >= 0)
            close(fd);
        if (got != (ssize_t)r->meta_len) {
            free(buf);
            *len = 0;
            return NULL;
        }
        *owned = buf;
        return buf;
    }
    if (!chunk_ok(s->hdr, r->mslab, r->mchunk, 1) || r->meta_len > s->hdr->slabs[r->mslab].csize) {
        table_damaged(s, "a record's %u bytes of metadata are in chunk %u of slab %u",
                      r->meta_len, r->mchunk, r->mslab);
        *len = 0;
        return NULL;
    }
    char *base = slab_base(s, r->mslab);
    if (base == NULL) {
        *len = 0;
        return NULL;
    }
    return (const uint8_t *)base + (size_t)r->mchunk * s->hdr->slabs[r->mslab].csize;
}

/* a spilled block leaves the disk: its file, its counts, its record */
void drop_disk(Idx *s, uint32_t i, int forget) {
    hdr_t *h = s->hdr;
    rec_t *r = R(s, i);
    char path[4096];
    ev_rec(s, EVT_REMOVED, MED_STORAGE, i); /* first: its metadata is in its file */
    if (s->disk_root != NULL) {
        spill_path(s, r, path, sizeof path);
        unlink(path);
    }
    q_remove(s, i);
    h->count[C_DISK_BLOCKS]--;
    h->count[C_DISK_BYTES] -= r->nbytes;
    if (r->pins)
        h->count[C_PINNED]--;
    meta_free(s, r);
    if (forget)
        note_left(s, r);
    h_delete(s, i);
    if (r->writer && r->writer <= MAX_PROCS && chunk_ok(h, r->pslab, r->pchunk, 0)) {
        /* being promoted: its promoter is filling pslab:pchunk outside the lock. The
         * record holds that chunk as a ZOMBIE for the promoter's reader bit, which it
         * (or the reclaim of a dead one) ends */
        r->readers = 1ULL << (r->writer - 1);
        r->slab = r->pslab;
        r->chunk = r->pchunk;
        r->writer = 0;
        r->state = S_ZOMBIE;
        r->gen++;
        return;
    }
    rec_free(s, i);
}

static void trim_disk(Idx *s) {
    hdr_t *h = s->hdr;
    uint32_t cur = h->q[Q_DISK].head;
    for (uint64_t steps = 0; cur && h->count[C_DISK_BYTES] > s->disk_capacity && !s->dmg;
         steps++) {
        uint32_t i = cur - 1;
        if (!link_ok(s, cur) || steps > h->bump || rec_check(s, i) < 0 ||
                R(s, i)->state != S_DISK) {
            table_damaged(s, "the spilled blocks' queue reaches record %u", i);
            return;
        }
        cur = R(s, i)->next;
        if (R(s, i)->pins == 0)
            drop_disk(s, i, 1);
    }
}

static int write_all(int fd, const char *p, size_t n) {
    while (n) {
        ssize_t w = write(fd, p, n);
        if (w < 0) {
            if (errno == EINTR)
                continue;
            return -1;
        }
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

/* the block at host record i goes to a spill file; 0, or -1 (it could not: drop it) */
/* a spill's file: the block's bytes, then its metadata past the record (a spilled block
 * holds nothing of the arena: its metadata's chunk kept the arena full of spilled
 * blocks' metadata). Needs no lock: the bytes are a HOST chunk, which nothing rewrites
 * while it is held. 0, or -1 (nothing left behind) */
int spill_write(const char *path, const char *src, uint64_t n, const uint8_t *meta,
                       uint32_t mlen, int want_meta) {
    int fd = open(path, O_CREAT | O_TRUNC | O_WRONLY | O_CLOEXEC, 0600);
    int ok = fd >= 0 && write_all(fd, src, n) == 0 &&
             (!want_meta || (meta != NULL && write_all(fd, (const char *)meta, mlen) == 0));
    if (fd >= 0)
        close(fd);
    if (!ok) {
        unlink(path);
        return -1;
    }
    FAULT("spill.written");
    return 0;
}

/* a HOST record, its spill file written, becomes a spilled one (under the lock): the
 * record names its chunk until it names its file, with the state that says which (a
 * holder killed before then leaves the block in the arena, the file an orphan) */
static void spill_commit(Idx *s, uint32_t i, uint64_t seq) {
    hdr_t *h = s->hdr;
    rec_t *r = R(s, i);
    ev_rec(s, EVT_REMOVED, MED_CPU, i);
    ev_rec(s, EVT_STORED, MED_STORAGE, i);
    release_chunk(s, r->slab, r->chunk);
    if (r->meta_len > INLINE_META) {
        release_chunk(s, r->mslab, r->mchunk);
        r->mslab = META_SPILLED;
        r->mchunk = 0;
    }
    r->slab = (uint32_t)(seq >> 32);
    r->chunk = (uint32_t)seq;
    r->state = S_DISK;
    r->gen++;
    q_push(s, Q_DISK, i);
    h->count[C_SPILLS]++;
    h->count[C_DISK_BLOCKS]++;
    h->count[C_DISK_BYTES] += r->nbytes;
    if (h->count[C_DISK_BYTES] > s->disk_capacity)
        trim_disk(s);
}

/* a victim spilled under the lock (an eviction a batch's spills before it did not
 * foresee): 0, or -1 (not spilled) */
int spill(Idx *s, uint32_t i) {
    hdr_t *h = s->hdr;
    rec_t *r = R(s, i);
    if (rec_check(s, i) < 0)
        return -1;
    char *base = slab_base(s, r->slab);
    if (base == NULL || s->disk_root == NULL || r->nbytes > s->disk_capacity)
        return -1;
    const char *src = base + (size_t)r->chunk * h->slabs[r->slab].csize;
    uint64_t seq = ++h->spill_seq;
    char path[4096];
    spill_file(s, r->key, r->klen, seq, path, sizeof path);
    uint8_t *owned = NULL;
    uint32_t mlen = 0;
    const uint8_t *meta = r->meta_len > INLINE_META ? rec_meta(s, r, &mlen, &owned) : NULL;
    int bad = spill_write(path, src, r->nbytes, meta, mlen, r->meta_len > INLINE_META);
    free(owned);
    if (bad)
        return -1;
    spill_commit(s, i, seq);
    return 0;
}

/* the room the arena has for chunks of the classes cls (free chunks of their slabs, and
 * capacity for new slabs) */
uint64_t room_for(Idx *s, const uint64_t *cls, int ncls) {
    hdr_t *h = s->hdr;
    uint64_t room = h->capacity > h->count[C_ARENA_BYTES] ? h->capacity - h->count[C_ARENA_BYTES]
                                                          : 0;
    for (uint32_t k = 0; k < h->nslabs; k++) {
        slab_t *sl = &h->slabs[k];
        if (sl->live != SLAB_LIVE || sl->meta || sl->used > sl->nchunks)
            continue;
        for (int c = 0; c < ncls; c++)
            if (sl->csize == cls[c]) {
                room += (uint64_t)(sl->nchunks - sl->used) * sl->csize;
                break;
            }
    }
    return room;
}

/* under the lock: hold victims for `need` bytes (at most max); returns how many */
Py_ssize_t prespill_pick(Idx *s, uint64_t need, pspill_t *out, Py_ssize_t max) {
    hdr_t *h = s->hdr;
    uint64_t bit = 1ULL << s->slot;
    Py_ssize_t n = 0;
    while (need > 0 && n < max && !s->dmg) {
        int64_t v = victim(s);
        if (v < 0)
            break;
        rec_t *r = R(s, (uint32_t)v);
        if (rec_check(s, (uint32_t)v) < 0 || r->nbytes > s->disk_capacity)
            break;
        char *base = slab_base(s, r->slab);
        if (base == NULL)
            break;
        pspill_t *p = &out[n];
        p->idx = (uint32_t)v;
        p->gen = r->gen;
        p->nbytes = r->nbytes;
        p->src = base + (size_t)r->chunk * h->slabs[r->slab].csize;
        p->want_meta = r->meta_len > INLINE_META;
        p->meta = NULL;
        p->mlen = 0;
        if (p->want_meta) {
            uint8_t *owned = NULL;
            uint32_t mlen = 0;
            const uint8_t *m = rec_meta(s, r, &mlen, &owned);
            p->meta = m != NULL ? malloc(mlen ? mlen : 1) : NULL;
            if (p->meta != NULL)
                memcpy(p->meta, m, mlen);
            p->mlen = mlen;
            free(owned);
        }
        p->seq = ++h->spill_seq;
        spill_file(s, r->key, r->klen, p->seq, p->path, sizeof p->path);
        r->readers |= bit;
        uint64_t cs = size_class(r->nbytes);
        need = need > cs ? need - cs : 0;
        n++;
    }
    return n;
}

/* under the lock again: each held victim, its file written (ok), becomes a spilled
 * block where nothing else holds it; else it stays and its file goes */
void prespill_commit(Idx *s, pspill_t *ps, Py_ssize_t n, const uint8_t *ok) {
    hdr_t *h = s->hdr;
    uint64_t bit = 1ULL << s->slot;
    for (Py_ssize_t j = 0; j < n; j++) {
        pspill_t *p = &ps[j];
        rec_t *r = p->idx < h->bump ? R(s, p->idx) : NULL;
        int mine = r != NULL && (r->readers & bit);
        if (mine && ok[j] && r->state == S_HOST && r->gen == p->gen && r->readers == bit &&
                r->pins == 0) {
            r->readers = 0;
            h->count[C_EVICTIONS]++;
            q_remove(s, p->idx);
            h->count[C_HOST_BLOCKS]--;
            h->count[C_HOST_BYTES] -= r->nbytes;
            spill_commit(s, p->idx, p->seq);
        } else {
            if (ok[j])
                unlink(p->path);
            if (mine) {
                r->readers &= ~bit;
                if (r->state == S_ZOMBIE && !r->readers) {
                    release_chunk(s, r->slab, r->chunk);
                    meta_free(s, r);
                    rec_free(s, p->idx);
                }
            }
        }
        free(p->meta);
        p->meta = NULL;
    }
}

/* ---------------------------------------------------------------------------------- */
/* leaving the host arena */
