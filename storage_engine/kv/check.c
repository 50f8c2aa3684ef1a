/* The consistency checker (BlockIndex.check): every structure the index keeps beside its
 * records compared with what the records say. */
#include "kv.h"

/* check() -> a list of the inconsistencies found (empty: none), for tests and tools:
 * every structure the index keeps beside its records is compared with what the records
 * say (buckets, free records, queues, chunks in use and free, counters) */
#define CHECK_SAY(...)                                                                  \
    do {                                                                                \
        if (nsaid < 16)                                                                 \
            snprintf(said[nsaid], sizeof said[0], __VA_ARGS__);                          \
        nsaid++;                                                                        \
    } while (0)
PyObject *Idx_check(Idx *s, PyObject *unused) {
    (void)unused;
    if (!usable(s))
        return NULL;
    char said[16][160];
    int nsaid = 0, r;
    Py_BEGIN_ALLOW_THREADS
    r = lock(s);
    if (r == 0) {
        hdr_t *h = s->hdr;
        uint64_t bump = h->bump, live = 0, in_buckets = 0, host_n = 0, host_b = 0,
                 disk_n = 0, disk_b = 0;
        /* buckets (of both tables during a growth's move): each names a record of its
         * key, found where it is; the old table's below the move's cursor are empty */
        for (int t = 0; t < 2; t++) {
            const uint64_t *bk = t == 0 ? s->buckets : s->obuckets;
            uint64_t nb = t == 0 ? s->nb : s->onb;
            for (uint64_t b = 0; bk != NULL && b < nb; b++) {
                uint64_t v = bk[b];
                if (!v)
                    continue;
                in_buckets++;
                if (t == 1 && b < h->rehash_at)
                    CHECK_SAY("bucket %llu of the old table is below the move's cursor "
                              "(%llu) and not empty", (unsigned long long)b,
                              (unsigned long long)h->rehash_at);
                uint32_t i = (uint32_t)(v & 0xffffffffu) - 1;
                rec_t *rec = i < bump ? R(s, i) : NULL;
                if (rec == NULL || rec->state == S_FREE || rec->state == S_ZOMBIE ||
                        rec->klen == 0 || rec->klen > KEYMAX) {
                    CHECK_SAY("bucket %llu names record %u, which is free or of no key",
                              (unsigned long long)b, i);
                    continue;
                }
                if (h_find(s, rec->key, rec->klen) != (int64_t)i)
                    CHECK_SAY("record %u is not found by its key", i);
            }
        }
        /* records: those in use are in the buckets, counted once */
        uint8_t *chunks[MAX_SLABS] = {0};
        for (uint32_t k = 0; k < h->nslabs; k++)
            if (h->slabs[k].live == SLAB_LIVE && slab_ok(h, &h->slabs[k]))
                chunks[k] = calloc(h->slabs[k].nchunks, 1);
        uint64_t qlen[NQ] = {0};
        for (uint64_t j = 0; j < bump; j++) {
            rec_t *rec = R(s, (uint32_t)j);
            if (rec->state == S_FREE)
                continue;
            if (rec->state != S_ZOMBIE)
                live++;
            if (rec->queue > 0 && rec->queue <= NQ)
                qlen[rec->queue - 1]++;
            int holds = rec->state == S_WRITING || rec->state == S_HOST ||
                        rec->state == S_ZOMBIE;
            if (rec->state == S_WRITING &&
                    (rec->writer == 0 || rec->writer > MAX_PROCS ||
                     !h->procs[rec->writer - 1].used))
                CHECK_SAY("record %llu is being written by process slot %u, which is gone "
                          "(its chunk leaks)", (unsigned long long)j, rec->writer);
            if (rec->state == S_DISK && rec->writer) {
                if (rec->writer > MAX_PROCS || !h->procs[rec->writer - 1].used)
                    CHECK_SAY("record %llu is being promoted by process slot %u, which is "
                              "gone (its chunk leaks)", (unsigned long long)j, rec->writer);
                if (!chunk_ok(h, rec->pslab, rec->pchunk, 0) || chunks[rec->pslab] == NULL)
                    CHECK_SAY("record %llu is promoted into chunk %u of slab %u, not a live "
                              "one", (unsigned long long)j, rec->pchunk, rec->pslab);
                else if (chunks[rec->pslab][rec->pchunk]++)
                    CHECK_SAY("chunk %u of slab %u is held by two records", rec->pchunk,
                              rec->pslab);
            } else if (rec->writer && rec->state != S_WRITING) {
                CHECK_SAY("record %llu in state %u names writer %u", (unsigned long long)j,
                          rec->state, rec->writer);
            }
            for (int p = 0; p < MAX_PROCS; p++)
                if ((rec->readers >> p & 1) && !h->procs[p].used)
                    CHECK_SAY("record %llu is leased by process slot %d, which is gone",
                              (unsigned long long)j, p);
            if (holds) {
                if (!chunk_ok(h, rec->slab, rec->chunk, 0) || chunks[rec->slab] == NULL)
                    CHECK_SAY("record %llu names chunk %u of slab %u, not a live one",
                              (unsigned long long)j, rec->chunk, rec->slab);
                else if (chunks[rec->slab][rec->chunk]++)
                    CHECK_SAY("chunk %u of slab %u is held by two records", rec->chunk,
                              rec->slab);
                if (rec->meta_len > INLINE_META) {
                    if (!chunk_ok(h, rec->mslab, rec->mchunk, 1) || chunks[rec->mslab] == NULL)
                        CHECK_SAY("record %llu names metadata chunk %u of slab %u",
                                  (unsigned long long)j, rec->mchunk, rec->mslab);
                    else if (chunks[rec->mslab][rec->mchunk]++)
                        CHECK_SAY("metadata chunk %u of slab %u is held twice", rec->mchunk,
                                  rec->mslab);
                }
            }
            if (rec->state == S_HOST) {
                host_n++;
                host_b += rec->nbytes;
            } else if (rec->state == S_DISK) {
                disk_n++;
                disk_b += rec->nbytes;
            }
        }
        if (live != in_buckets)
            CHECK_SAY("%llu records in use, %llu in the buckets", (unsigned long long)live,
                      (unsigned long long)in_buckets);
        /* the free records' chain: free ones only, every free one */
        uint64_t nfree = 0;
        for (uint64_t f = h->free_rec; f && nfree <= bump; nfree++) {
            rec_t *rec = f <= bump ? R(s, (uint32_t)f - 1) : NULL;
            if (rec == NULL || rec->state != S_FREE) {
                CHECK_SAY("the free records' chain reaches record %llu, not free",
                          (unsigned long long)f - 1);
                break;
            }
            f = rec->next;
        }
        uint64_t in_use = 0;
        for (uint64_t j = 0; j < bump; j++)
            in_use += R(s, (uint32_t)j)->state != S_FREE;
        if (nfree + in_use != bump)
            CHECK_SAY("%llu records made: %llu in use, %llu chained free",
                      (unsigned long long)bump, (unsigned long long)in_use,
                      (unsigned long long)nfree);
        /* queues: as long as they say, each record in the one it names */
        for (int q = 0; q < NQ; q++) {
            uint64_t n = 0;
            uint32_t prev = 0;
            for (uint32_t l = h->q[q].head; l && n <= bump; n++) {
                rec_t *rec = l <= bump ? R(s, l - 1) : NULL;
                if (rec == NULL || rec->queue != q + 1 || rec->prev != prev) {
                    CHECK_SAY("queue %d: record %u is not linked into it", q, l - 1);
                    break;
                }
                prev = l;
                l = rec->next;
            }
            if (n != h->q[q].len || qlen[q] != h->q[q].len || h->q[q].tail != prev)
                CHECK_SAY("queue %d: %llu long, %llu walked, %llu records name it", q,
                          (unsigned long long)h->q[q].len, (unsigned long long)n,
                          (unsigned long long)qlen[q]);
        }
        for (uint32_t k = 0; k < h->nslabs; k++) {
            const slab_t *sl = &h->slabs[k];
            if (sl->live == SLAB_MAKING &&
                    (sl->maker == 0 || sl->maker > MAX_PROCS || !h->procs[sl->maker - 1].used))
                CHECK_SAY("slab %u is being made by process slot %u, which is gone (its "
                          "bytes leak)", k, sl->maker);
            else if (sl->live > SLAB_MAKING)
                CHECK_SAY("slab %u is in state %u", k, sl->live);
        }
        /* chunks: in use as the records hold them; the rest made are chained free */
        for (uint32_t k = 0; k < h->nslabs; k++) {
            slab_t *sl = &h->slabs[k];
            if (chunks[k] == NULL)
                continue;
            uint64_t held = 0, chained = 0;
            for (uint32_t c = 0; c < sl->nchunks; c++)
                held += chunks[k][c] != 0;
            char *base = slab_base(s, k);
            for (uint32_t c = sl->free_head; c && base != NULL && chained <= sl->nchunks;) {
                if (c > sl->bump || chunks[k][c - 1]) {
                    CHECK_SAY("slab %u: its free chain reaches chunk %u, held or not made", k,
                              c - 1);
                    break;
                }
                chunks[k][c - 1] = 2;
                chained++;
                memcpy(&c, base + (size_t)(c - 1) * sl->csize, 4);
            }
            if (held != sl->used || held + chained != sl->bump)
                CHECK_SAY("slab %u: %u chunks made, %u in use; %llu held, %llu free", k,
                          sl->bump, sl->used, (unsigned long long)held,
                          (unsigned long long)chained);
            free(chunks[k]);
        }
        if (host_n != h->count[C_HOST_BLOCKS] || host_b != h->count[C_HOST_BYTES] ||
                disk_n != h->count[C_DISK_BLOCKS] || disk_b != h->count[C_DISK_BYTES])
            CHECK_SAY("counters: %llu host blocks (%llu bytes), %llu on disk (%llu); the "
                      "records: %llu (%llu), %llu (%llu)",
                      (unsigned long long)h->count[C_HOST_BLOCKS],
                      (unsigned long long)h->count[C_HOST_BYTES],
                      (unsigned long long)h->count[C_DISK_BLOCKS],
                      (unsigned long long)h->count[C_DISK_BYTES], (unsigned long long)host_n,
                      (unsigned long long)host_b, (unsigned long long)disk_n,
                      (unsigned long long)disk_b);
        if (h->nrecs != in_use)
            CHECK_SAY("%llu records counted, %llu in use", (unsigned long long)h->nrecs,
                      (unsigned long long)in_use);
        unlock(s);
    }
    Py_END_ALLOW_THREADS
    if (r < 0 || s->dmg)
        return lock_error(s);
    PyObject *out = PyList_New(0);
    for (int i = 0; out != NULL && i < nsaid && i < 16; i++) {
        PyObject *u = PyUnicode_FromString(said[i]);
        if (u == NULL || PyList_Append(out, u) < 0)
            Py_CLEAR(out);
        Py_XDECREF(u);
    }
    return out;
}

