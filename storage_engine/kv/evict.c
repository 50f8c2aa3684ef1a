/* Eviction: the queues (LRU, or S3-FIFO's small, main and ghost; and the spilled
 * blocks'), picking a victim, blocks leaving the host arena, and reclaiming what dead
 * processes held when an allocation finds no room. */
#include "kv.h"

void q_push(Idx *s, int q, uint32_t i) {
    hdr_t *h = s->hdr;
    rec_t *r = R(s, i);
    if (!link_ok(s, h->q[q].tail)) {
        damaged(s, "index.kvx", "queue %d ends at record %u of %llu", q, h->q[q].tail - 1,
                (unsigned long long)h->bump);
        return;
    }
    r->queue = (uint8_t)(q + 1);
    r->next = 0;
    r->prev = h->q[q].tail;
    if (h->q[q].tail)
        R(s, h->q[q].tail - 1)->next = i + 1;
    else
        h->q[q].head = i + 1;
    h->q[q].tail = i + 1;
    h->q[q].len++;
}

void q_remove(Idx *s, uint32_t i) {
    hdr_t *h = s->hdr;
    rec_t *r = R(s, i);
    if (!r->queue)
        return;
    int q = r->queue - 1;
    if (q >= NQ || !link_ok(s, r->prev) || !link_ok(s, r->next)) {
        table_damaged(s, "record %u: queue %d, links %u and %u", i, q, r->prev, r->next);
        return;
    }
    if (r->prev)
        R(s, r->prev - 1)->next = r->next;
    else
        h->q[q].head = r->next;
    if (r->next)
        R(s, r->next - 1)->prev = r->prev;
    else
        h->q[q].tail = r->prev;
    h->q[q].len--;
    r->queue = 0;
    r->prev = r->next = 0;
}

/* ---------------------------------------------------------------------------------- */
/* records */

/* a host record leaves the store (deleted, dropped as corrupt, evicted with no spill):
 * its chunk is freed, or parked with the record while someone reads it */
void remove_host(Idx *s, uint32_t i) {
    hdr_t *h = s->hdr;
    rec_t *r = R(s, i);
    q_remove(s, i);
    h_delete(s, i);
    h->count[C_HOST_BLOCKS]--;
    h->count[C_HOST_BYTES] -= r->nbytes;
    if (r->pins)
        h->count[C_PINNED]--;
    r->pins = 0;
    note_left(s, r);
    ev_rec(s, EVT_REMOVED, MED_CPU, i);
    if (r->readers) {
        r->state = S_ZOMBIE;
        return;
    }
    release_chunk(s, r->slab, r->chunk);
    meta_free(s, r);
    rec_free(s, i);
}

static void ghost_trim(Idx *s) {
    hdr_t *h = s->hdr;
    uint64_t limit = h->q[Q_MAIN].len + h->q[Q_SMALL].len;
    if (limit < 16)
        limit = 16;
    while (h->q[Q_GHOST].len > limit && !s->dmg) {
        uint32_t i = h->q[Q_GHOST].head - 1;
        if (h->q[Q_GHOST].head == 0 || !link_ok(s, h->q[Q_GHOST].head) ||
                R(s, i)->queue != Q_GHOST + 1) {
            damaged(s, "index.kvx", "the ghost queue (%llu long) starts at record %u",
                    (unsigned long long)h->q[Q_GHOST].len, i);
            return;
        }
        q_remove(s, i);
        h_delete(s, i);
        rec_free(s, i);
    }
}

static void evict(Idx *s, uint32_t i) {
    hdr_t *h = s->hdr;
    rec_t *r = R(s, i);
    int from_small = r->queue == Q_SMALL + 1;
    h->count[C_EVICTIONS]++;
    if (s->disk_root != NULL) {
        q_remove(s, i);
        FAULT("evict");
        h->count[C_HOST_BLOCKS]--;
        h->count[C_HOST_BYTES] -= r->nbytes;
        if (spill(s, i) == 0)
            return;
        h->count[C_HOST_BLOCKS]++;
        h->count[C_HOST_BYTES] += r->nbytes;
    }
    if (h->eviction == EV_S3FIFO && from_small) {
        /* remembered in the ghost queue: a key seen again goes straight to main */
        q_remove(s, i);
        h->count[C_HOST_BLOCKS]--;
        h->count[C_HOST_BYTES] -= r->nbytes;
        ev_rec(s, EVT_REMOVED, MED_CPU, i);
        release_chunk(s, r->slab, r->chunk);
        meta_free(s, r);
        note_left(s, r);
        r->state = S_GHOST;
        r->gen++;
        q_push(s, Q_GHOST, i);
        ghost_trim(s);
        return;
    }
    remove_host(s, i);
}

/* a queue that holds records starts at one that is in it and can be (see rec_check) */
static int queue_head_bad(Idx *s, int q) {
    hdr_t *h = s->hdr;
    uint32_t head = h->q[q].head;
    if (head == 0 || !link_ok(s, head) || R(s, head - 1)->queue != q + 1)
        return damaged(s, "index.kvx", "queue %d (%llu long) starts at record %u", q,
                       (unsigned long long)h->q[q].len, head - 1);
    return rec_check(s, head - 1);
}

/* the next block to evict, or -1 */
int64_t victim(Idx *s) {
    hdr_t *h = s->hdr;
    if (h->eviction == EV_LRU) {
        uint64_t budget = h->q[Q_SMALL].len;
        while (budget-- && !s->dmg) {
            uint32_t i = h->q[Q_SMALL].head - 1;
            if (queue_head_bad(s, Q_SMALL))
                return -1;
            if (evictable(R(s, i)))
                return i;
            q_remove(s, i); /* being read: to the tail */
            q_push(s, Q_SMALL, i);
        }
        return -1;
    }
    /* S3-FIFO (Yang et al., SOSP 2023): a small FIFO filtering one-hit wonders, a main
     * FIFO with lazy promotion, a ghost FIFO of keys recently evicted from small */
    uint64_t budget = 5 * (h->q[Q_SMALL].len + h->q[Q_MAIN].len) + 8;
    uint64_t refused = 0;
    while (budget--) {
        uint64_t small = h->q[Q_SMALL].len, main = h->q[Q_MAIN].len;
        if (small + main == 0 || refused >= small + main)
            return -1;
        int from_small = small > 0 && (small * 10 > small + main || main == 0);
        int q = from_small ? Q_SMALL : Q_MAIN;
        uint32_t i = h->q[q].head - 1;
        if (s->dmg || queue_head_bad(s, q))
            return -1;
        rec_t *r = R(s, i);
        if (q == Q_SMALL && r->freq >= 1) {
            q_remove(s, i);
            r->freq = 0;
            q_push(s, Q_MAIN, i);
            continue;
        }
        if (q == Q_MAIN && r->freq > 0) {
            q_remove(s, i);
            r->freq--;
            q_push(s, Q_MAIN, i);
            continue;
        }
        if (evictable(r))
            return i;
        refused++;
        q_remove(s, i);
        q_push(s, q, i);
    }
    return -1;
}

void on_insert(Idx *s, uint32_t i, int was_ghost) {
    rec_t *r = R(s, i);
    r->freq = 0;
    if (r->pins)
        return; /* pinned blocks stay out of the queues until unpinned */
    q_push(s, s->hdr->eviction == EV_S3FIFO && was_ghost ? Q_MAIN : Q_SMALL, i);
}

void on_access(Idx *s, uint32_t i) {
    rec_t *r = R(s, i);
    if (s->hdr->eviction == EV_S3FIFO) {
        if (r->freq < 3)
            r->freq++;
    } else if (r->queue) {
        q_remove(s, i);
        q_push(s, Q_SMALL, i);
    }
}

/* dead readers' leases and dead writers' chunks: one pass over the records, run when an
 * allocation finds no room; how many chunks it freed */
uint64_t reclaim_dead(Idx *s) {
    hdr_t *h = s->hdr;
    uint64_t dead = 0;
    for (int p = 0; p < MAX_PROCS; p++)
        if (h->procs[p].used && p != s->slot && !proc_alive(&h->procs[p])) {
            dead |= 1ULL << p;
            h->procs[p].used = 0;
        }
    if (!dead)
        return 0;
    if (h->ev_pub && h->ev_pub <= MAX_PROCS && (dead >> (h->ev_pub - 1) & 1)) {
        /* the publisher died: none now */
        h->ev_pub = 0;
        h->ev_on = 0;
    }
    h->count[C_RECLAIM_SCANS]++;
    uint64_t freed = 0;
    for (uint32_t k = 0; k < h->nslabs; k++) {
        slab_t *sl = &h->slabs[k];
        if (sl->live == SLAB_MAKING &&
                (sl->maker == 0 || sl->maker > MAX_PROCS || (dead >> (sl->maker - 1) & 1))) {
            drop_making(s, k); /* its maker died outside the lock, the file half made */
            freed++;
        }
    }
    for (uint64_t j = 0; j < h->bump; j++) {
        uint32_t i = (uint32_t)j;
        rec_t *r = R(s, i);
        if (r->state == S_FREE)
            continue;
        if (r->readers & dead) {
            r->readers &= ~dead;
            if (r->state == S_ZOMBIE && !r->readers) {
                release_chunk(s, r->slab, r->chunk);
                meta_free(s, r);
                rec_free(s, i);
                freed++;
            }
        }
        if (r->state == S_DISK && r->writer && r->writer <= MAX_PROCS &&
                (dead >> (r->writer - 1) & 1)) {
            promote_abandon(s, i); /* its promoter died outside the lock */
            freed++;
        }
        if (r->state == S_WRITING && r->writer && r->writer <= MAX_PROCS &&
                (dead >> (r->writer - 1) & 1)) {
            release_chunk(s, r->slab, r->chunk);
            FAULT("reclaim");
            meta_free(s, r);
            h_delete(s, i);
            rec_free(s, i);
            freed++;
        }
    }
    return freed;
}

/* a chunk of csize: E_OK, E_FULL (nothing evictable), E_TOO_BIG, E_NOSPACE, E_IO */
int allocate(Idx *s, uint64_t csize, uint32_t *slot, uint32_t *chunk, int *reclaimed,
                    int *untouched) {
    hdr_t *h = s->hdr;
    int scratch;
    if (untouched == NULL)
        untouched = &scratch;
    if (csize > h->capacity)
        return E_TOO_BIG;
    for (;;) {
        int r = take_free(s, csize, slot, chunk, untouched, 0);
        if (r > 0)
            return E_OK;
        if (r < 0)
            return E_IO;
        r = new_slab(s, csize);
        if (r > 0)
            continue;
        if (r < 0)
            return errno == ENOSPC || errno == EDQUOT || errno == EFBIG ? E_NOSPACE : E_IO;
        if (drop_empty_slab(s, csize))
            continue;
        if (!*reclaimed) {
            *reclaimed = 1;
            if (reclaim_dead(s))
                continue;
        }
        int64_t v = victim(s);
        if (v < 0)
            return E_FULL;
        s->want_csize = csize;
        s->hand = 0;
        evict(s, (uint32_t)v);
        s->want_csize = 0;
        if (s->hand) {
            s->hand = 0;
            *slot = s->hand_slot;
            *chunk = s->hand_chunk;
            *untouched = 0;
            s->hint = *slot;
            return E_OK;
        }
    }
}

/* ---------------------------------------------------------------------------------- */
/* locking and repair */
