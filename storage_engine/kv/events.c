/* KV events: a ring (events.kvx) of neutral records (layout.h's evh_t: type, medium, key,
 * metadata) of the blocks that entered and left the store, in the order they did, written
 * by whichever process changed the store (under the lock) while a publisher is attached;
 * one process per namespace (the publisher) reads it. The wire format a router reads is
 * the client's (tensordb/client/_kv_events.py). */
#include "kv.h"

static void ev_path(Idx *s, char *out, size_t n) { snprintf(out, n, "%s/events.kvx", s->root); }

/* the ring, mapped in this process (under the lock): 0, or -1 */
int ev_map(Idx *s) {
    hdr_t *h = s->hdr;
    if (h->ev_ring == 0)
        return -1;
    if (s->ev_map != NULL && s->ev_size == h->ev_ring)
        return 0;
    if (s->ev_map != NULL)
        munmap(s->ev_map, s->ev_size);
    s->ev_map = NULL;
    char path[4096];
    ev_path(s, path, sizeof path);
    int fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0)
        return -1;
    /* a ring cut short outside the store gets its pages back (zeros: entries that cannot
     * be, which its reader takes for an overrun) before it is mapped: a mapping past
     * the file's end is a SIGBUS at the first touch */
    struct stat st;
    if (fstat(fd, &st) != 0 || ((uint64_t)st.st_size < h->ev_ring &&
                                posix_fallocate(fd, 0, (off_t)h->ev_ring) != 0)) {
        close(fd);
        return -1;
    }
    /* populated: the ring is written all over, and a fault a page was the writers' cost */
    void *m = mmap(NULL, h->ev_ring, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
    close(fd);
    if (m == MAP_FAILED)
        return -1;
    s->ev_map = m;
    s->ev_size = h->ev_ring;
    return 0;
}

static void ev_write(char *at, int type, int medium, const uint8_t *key, uint32_t klen,
                     const uint8_t *meta, uint32_t mlen) {
    evh_t e;
    memset(&e, 0, sizeof e);
    e.len = (uint32_t)ev_bytes(klen, mlen);
    e.mlen = mlen;
    e.type = (uint8_t)type;
    e.medium = (uint8_t)medium;
    e.klen = (uint8_t)klen;
    memcpy(at, &e, sizeof e);
    if (klen)
        memcpy(at + sizeof e, key, klen);
    if (mlen)
        memcpy(at + sizeof e + klen, meta, mlen);
}

/* one event into the ring (under the lock); an event that cannot be written is counted
 * lost, and the publisher announces the store afresh */
void ev_put(Idx *s, int type, int medium, const uint8_t *key, uint32_t klen,
                   const uint8_t *meta, uint32_t mlen) {
    hdr_t *h = s->hdr;
    if (!h->ev_on)
        return;
    uint64_t need = ev_bytes(klen, mlen);
    if (need > h->ev_ring / 4 || ev_map(s) < 0) {
        h->ev_lost++;
        return;
    }
    uint64_t off = h->ev_head % h->ev_ring;
    if (off + need > h->ev_ring) { /* entries never wrap: the rest of the ring is padding */
        uint64_t rest = h->ev_ring - off;
        if (rest >= sizeof(evh_t)) {
            evh_t pad;
            memset(&pad, 0, sizeof pad);
            pad.len = (uint32_t)rest;
            pad.type = EVT_PAD;
            memcpy(s->ev_map + off, &pad, sizeof pad);
        }
        h->ev_head += rest;
        off = 0;
    }
    ev_write(s->ev_map + off, type, medium, key, klen, meta, mlen);
    h->ev_head += need;
}

/* a record's event, with its key and metadata */
void ev_rec(Idx *s, int type, int medium, uint32_t i) {
    if (!s->hdr->ev_on)
        return;
    if (R(s, i)->klen == 0 || R(s, i)->klen > KEYMAX) {
        table_damaged(s, "record %u: a key of %u bytes", i, R(s, i)->klen);
        return;
    }
    uint8_t *owned;
    uint32_t mlen;
    const uint8_t *meta = rec_meta(s, R(s, i), &mlen, &owned);
    ev_put(s, type, medium, R(s, i)->key, R(s, i)->klen, meta, mlen);
    free(owned);
}

typedef struct {
    char *p;
    size_t len, cap;
} evbuf_t;

static int evbuf_add(evbuf_t *b, const void *src, size_t n) {
    if (b->len + n > b->cap) {
        size_t cap = b->cap ? b->cap : 1 << 16;
        while (cap < b->len + n)
            cap *= 2;
        char *p = realloc(b->p, cap);
        if (p == NULL)
            return -1;
        b->p = p;
        b->cap = cap;
    }
    if (src != NULL)
        memcpy(b->p + b->len, src, n);
    b->len += n;
    return 0;
}

/* entries as [(type, medium, key, meta)] (after the lock, with the GIL) */
static PyObject *ev_list(const evbuf_t *b) {
    PyObject *out = PyList_New(0);
    size_t off = 0;
    while (out != NULL && off + sizeof(evh_t) <= b->len) {
        evh_t e;
        memcpy(&e, b->p + off, sizeof e);
        const char *key = b->p + off + sizeof e;
        PyObject *t = Py_BuildValue("(iiy#y#)", e.type, e.medium, key, (Py_ssize_t)e.klen,
                                    key + e.klen, (Py_ssize_t)e.mlen);
        if (t == NULL || PyList_Append(out, t) < 0) {
            Py_XDECREF(t);
            Py_CLEAR(out);
            break;
        }
        Py_DECREF(t);
        off += e.len;
    }
    return out;
}

static int ev_publisher_alive(hdr_t *h, int slot) {
    if (h->ev_pub == 0 || h->ev_pub == (uint32_t)slot + 1)
        return 0;
    proc_t *p = &h->procs[h->ev_pub - 1];
    return p->used && proc_alive(p);
}

/* events_claim() -> None (another live process publishes), or (snapshot, pos, lost, seq):
 * this process becomes the namespace's publisher, events are written from now on, and
 * snapshot is every readable block as a stored event [(type, medium, key, meta)], taken
 * at ring position pos (read on from there); seq: the sequence number to go on from */
PyObject *Idx_events_claim(Idx *s, PyObject *unused) {
    (void)unused;
    if (!usable(s))
        return NULL;
    evbuf_t b = {NULL, 0, 0};
    int r, taken = 0, err = 0;
    uint64_t pos = 0, lost = 0, seq = 0;
    Py_BEGIN_ALLOW_THREADS
    r = lock(s);
    if (r == 0) {
        hdr_t *h = s->hdr;
        if (ev_publisher_alive(h, s->slot)) {
            taken = 1;
        } else {
            if (h->ev_ring == 0) {
                char path[4096];
                ev_path(s, path, sizeof path);
                int fd = create_file(path, EV_RING_BYTES);
                if (fd >= 0) {
                    close(fd);
                    h->ev_ring = EV_RING_BYTES;
                }
            }
            if (ev_map(s) < 0) {
                err = errno ? errno : EIO;
            } else {
                h->ev_pub = (uint32_t)s->slot + 1;
                h->ev_on = 1;
                for (uint64_t j = 0; j < h->bump && !err; j++) {
                    rec_t *rr = R(s, (uint32_t)j);
                    if (rr->state != S_HOST && rr->state != S_DISK)
                        continue;
                    if (rec_check(s, (uint32_t)j) < 0) {
                        err = EIO;
                        break;
                    }
                    uint8_t *owned;
                    uint32_t mlen;
                    const uint8_t *meta = rec_meta(s, rr, &mlen, &owned);
                    uint64_t n = ev_bytes(rr->klen, mlen);
                    size_t at = b.len;
                    if (evbuf_add(&b, NULL, n) < 0) {
                        free(owned);
                        err = ENOMEM;
                        break;
                    }
                    ev_write(b.p + at, EVT_STORED, rr->state == S_HOST ? MED_CPU : MED_STORAGE,
                             rr->key, rr->klen, meta, mlen);
                    free(owned);
                }
                pos = h->ev_head;
                lost = h->ev_lost;
                seq = h->ev_pub_seq;
            }
        }
        unlock(s);
    }
    Py_END_ALLOW_THREADS
    PyObject *out = NULL;
    if (r < 0 || s->dmg) {
        out = lock_error(s);
    } else if (err) {
        errno = err;
        out = PyErr_SetFromErrno(PyExc_OSError);
    } else if (taken) {
        out = Py_NewRef(Py_None);
    } else {
        PyObject *lst = ev_list(&b);
        if (lst != NULL)
            out = Py_BuildValue("(NKKK)", lst, (unsigned long long)pos,
                                (unsigned long long)lost, (unsigned long long)seq);
    }
    free(b.p);
    return out;
}

/* under the lock: the events since ring position *pos into b (whole entries, padding
 * skipped), until about max_bytes or max_events of them are taken. 1 when this process
 * publishes (seq is kept for the next publisher; *lost: the events lost so far;
 * *overrun: the ring was overwritten past *pos, which then moves to the head), 0 when it
 * does not, -1 out of memory. */
static int ev_take(Idx *s, uint64_t *pos, uint64_t seq, size_t max_bytes,
                   uint64_t max_events, evbuf_t *b, uint64_t *lost, int *overrun) {
    hdr_t *h = s->hdr;
    if (h->ev_pub != (uint32_t)s->slot + 1 || !h->ev_on)
        return 0;
    h->ev_pub_seq = seq;
    *lost = h->ev_lost;
    uint64_t head = h->ev_head, ring = h->ev_ring, taken = 0;
    if (*pos > head || head - *pos > ring || ev_map(s) < 0) {
        *overrun = 1;
        *pos = head;
        return 1;
    }
    while (*pos < head && b->len < max_bytes && taken < max_events) {
        uint64_t off = *pos % ring;
        if (ring - off < sizeof(evh_t)) {
            *pos += ring - off;
            continue;
        }
        evh_t e;
        memcpy(&e, s->ev_map + off, sizeof e);
        /* an entry that cannot be (damaged outside the store, or a write torn by a
         * crash): start over from a fresh snapshot, as after an overrun */
        int fits = e.type == EVT_PAD
            ? 1
            : (e.type == EVT_STORED || e.type == EVT_REMOVED || e.type == EVT_CLEARED) &&
              e.klen <= KEYMAX && e.medium <= MED_STORAGE && e.len == ev_bytes(e.klen, e.mlen);
        if (e.len < sizeof(evh_t) || e.len > ring - off || !fits) {
            *overrun = 1;
            *pos = head;
            return 1;
        }
        if (e.type != EVT_PAD) {
            if (evbuf_add(b, s->ev_map + off, e.len) < 0)
                return -1;
            taken++;
        }
        *pos += e.len;
    }
    return 1;
}

/* events_read(pos, max_bytes, seq) -> None (this process no longer publishes), or
 * (events, pos, lost, overrun): the events written since ring position pos (at most
 * about max_bytes of them), where to read on, the events lost so far, and whether the
 * ring has been overwritten past pos (then announce the store afresh: events_claim).
 * seq is kept for the next publisher. */
PyObject *Idx_events_read(Idx *s, PyObject *args) {
    unsigned long long pos, max_bytes, seq;
    if (!PyArg_ParseTuple(args, "KKK", &pos, &max_bytes, &seq))
        return NULL;
    if (!usable(s))
        return NULL;
    evbuf_t b = {NULL, 0, 0};
    int r, mine = 0, overrun = 0;
    uint64_t at = pos, lost = 0;
    Py_BEGIN_ALLOW_THREADS
    r = lock(s);
    if (r == 0) {
        mine = ev_take(s, &at, seq, (size_t)max_bytes, UINT64_MAX, &b, &lost, &overrun);
        unlock(s);
    }
    Py_END_ALLOW_THREADS
    PyObject *out = NULL;
    if (r < 0 || s->dmg) {
        out = lock_error(s);
    } else if (mine < 0) {
        out = PyErr_NoMemory();
    } else if (!mine) {
        out = Py_NewRef(Py_None);
    } else {
        PyObject *lst = ev_list(&b);
        if (lst != NULL)
            out = Py_BuildValue("(NKKO)", lst, (unsigned long long)at,
                                (unsigned long long)lost, overrun ? Py_True : Py_False);
    }
    free(b.p);
    return out;
}

/* events_take(pos, max_events, seq) -> None (this process no longer publishes), or
 * (records, count, pos, lost, overrun): the events written since ring position pos (at
 * most max_events of them) as the ring holds them, neutral records (layout.h's evh_t,
 * then the key, then the metadata, each entry padded to 8 bytes; padding entries left
 * out) in one bytes object, for a caller that encodes them in bulk (the vLLM wire
 * format is the client's: tensordb.client._kv_wire). Each entry was checked as
 * events_read checks it. */
PyObject *Idx_events_take(Idx *s, PyObject *args) {
    unsigned long long pos, max_events, seq;
    if (!PyArg_ParseTuple(args, "KKK", &pos, &max_events, &seq))
        return NULL;
    if (!usable(s))
        return NULL;
    evbuf_t b = {NULL, 0, 0};
    int r, mine = 0, overrun = 0;
    uint64_t at = pos, lost = 0, count = 0;
    Py_BEGIN_ALLOW_THREADS
    r = lock(s);
    if (r == 0) {
        mine = ev_take(s, &at, seq, SIZE_MAX, max_events, &b, &lost, &overrun);
        unlock(s);
    }
    for (size_t k = 0; r == 0 && mine > 0 && k + sizeof(evh_t) <= b.len; count++) {
        evh_t e;
        memcpy(&e, b.p + k, sizeof e);
        k += e.len;
    }
    Py_END_ALLOW_THREADS
    PyObject *out = NULL;
    if (r < 0 || s->dmg)
        out = lock_error(s);
    else if (mine < 0)
        out = PyErr_NoMemory();
    else if (!mine)
        out = Py_NewRef(Py_None);
    else
        out = Py_BuildValue("(y#KKKO)", b.p ? b.p : "", (Py_ssize_t)b.len,
                            (unsigned long long)count, (unsigned long long)at,
                            (unsigned long long)lost, overrun ? Py_True : Py_False);
    free(b.p);
    return out;
}

/* events_release(): this process stops publishing (events are no longer written) */
PyObject *Idx_events_release(Idx *s, PyObject *unused) {
    (void)unused;
    if (!usable(s))
        return NULL;
    int r;
    Py_BEGIN_ALLOW_THREADS
    r = lock(s);
    if (r == 0) {
        if (s->hdr->ev_pub == (uint32_t)s->slot + 1) {
            s->hdr->ev_pub = 0;
            s->hdr->ev_on = 0;
        }
        unlock(s);
    }
    Py_END_ALLOW_THREADS
    if (r < 0 || s->dmg)
        return lock_error(s);
    Py_RETURN_NONE;
}

/* ---------------------------------------------------------------------------------- */
/* what the store holds */
