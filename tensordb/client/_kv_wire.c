/* The KV events' wire bytes, spliced natively: tensordb.client._kv_wire.splice, whose
 * only caller is the publisher of tensordb/client/_kv_events.py.
 *
 * The store's event ring holds neutral records (storage_engine/kv/layout.h's evh_t:
 * type, medium, key, metadata), which BlockStore.events_take hands over in one bytes
 * object. A vLLM KV event is a msgpack map whose fields this code does not encode: the
 * caller gives the pieces (the head of a BlockStored and of a BlockRemoved, the tail of
 * each medium, a stored event's fields for a block without info), and each block's
 * info (KVCache.put(..., info=...), kept in its metadata after a 0 byte: the byte 1, the
 * length of its hashes' msgpack as 4 bytes little-endian, the hashes, the rest of a
 * BlockStored's fields) gives its own. This code only splices them into one msgpack
 * array: in Python the same splice ran at 0.26-0.45 M events a second, below vLLM's own
 * publisher (benchmarks/kv_events.py).
 *
 * The records are checked before use (each entry's length against what is left, its
 * key and metadata within it, its type and medium): records that break them give None,
 * which the publisher takes for an overrun (it announces the store afresh).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../../storage_engine/kv/layout.h"

typedef struct {
    char *p;
    size_t len, cap;
} buf_t;

static int add(buf_t *b, const void *src, size_t n) {
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
    memcpy(b->p + b->len, src, n);
    b->len += n;
    return 0;
}

/* the entry at rec + k of n bytes: its head, or -1 where it breaks layout.h's rules */
static int entry(const uint8_t *rec, size_t n, size_t k, evh_t *e) {
    if (n - k < sizeof *e)
        return -1;
    memcpy(e, rec + k, sizeof *e);
    if (e->len < sizeof *e || e->len > n - k || e->len % 8 != 0 || e->klen > KEYMAX ||
            (uint64_t)sizeof *e + e->klen + e->mlen > e->len || e->medium > MED_STORAGE ||
            (e->type != EVT_STORED && e->type != EVT_REMOVED && e->type != EVT_CLEARED))
        return -1;
    return 0;
}

enum { RES_OK = 0, RES_BAD = 1, RES_NOMEM = 2 };

/* the splice of records into o (without the GIL) */
static int splice_into(const uint8_t *rec, size_t n, Py_buffer *pieces, buf_t *o,
                       uint64_t *count, int *cleared) {
    Py_buffer *heads = pieces, *tails = pieces + 2, *noinfo = pieces + 4;
    uint64_t c = 0;
    evh_t e;
    for (size_t k = 0; k < n; k += e.len) {
        if (entry(rec, n, k, &e) < 0)
            return RES_BAD;
        c += e.type != EVT_CLEARED;
        *cleared |= e.type == EVT_CLEARED;
    }
    uint8_t hdr[5];
    size_t hn;
    if (c < 16) {
        hdr[0] = (uint8_t)(0x90 | c);
        hn = 1;
    } else if (c <= 0xffff) {
        hdr[0] = 0xdc;
        hdr[1] = (uint8_t)(c >> 8);
        hdr[2] = (uint8_t)c;
        hn = 3;
    } else if (c <= 0xffffffffu) {
        hdr[0] = 0xdd;
        for (int i = 0; i < 4; i++)
            hdr[1 + i] = (uint8_t)(c >> (24 - 8 * i));
        hn = 5;
    } else {
        return RES_BAD;
    }
    if (add(o, hdr, hn) < 0)
        return RES_NOMEM;
    for (size_t k = 0; k < n; k += e.len) {
        memcpy(&e, rec + k, sizeof e); /* checked above */
        if (e.type == EVT_CLEARED)
            continue;
        const uint8_t *key = rec + k + sizeof e, *meta = key + e.klen;
        const uint8_t *hashes = NULL, *rest = (const uint8_t *)noinfo->buf;
        size_t hl = 0, rl = (size_t)noinfo->len;
        const uint8_t *sep = e.mlen ? memchr(meta, 0, e.mlen) : NULL;
        if (sep != NULL) {
            const uint8_t *info = sep + 1;
            size_t il = e.mlen - (size_t)(info - meta);
            if (il >= 5 && info[0] == 1) {
                uint32_t h = (uint32_t)info[1] | (uint32_t)info[2] << 8 |
                             (uint32_t)info[3] << 16 | (uint32_t)info[4] << 24;
                if ((size_t)h <= il - 5) {
                    hashes = h ? info + 5 : NULL;
                    hl = h;
                    rest = info + 5 + h;
                    rl = il - 5 - h;
                }
            }
        }
        uint8_t keyarr[3 + KEYMAX] = {0x91, 0xc4, e.klen};
        memcpy(keyarr + 3, key, e.klen);
        int stored = e.type == EVT_STORED;
        Py_buffer *tail = &tails[e.medium == MED_STORAGE];
        if (add(o, heads[!stored].buf, (size_t)heads[!stored].len) < 0 ||
                (hashes != NULL ? add(o, hashes, hl) : add(o, keyarr, 3 + (size_t)e.klen)) < 0 ||
                (stored && add(o, rest, rl) < 0) ||
                add(o, tail->buf, (size_t)tail->len) < 0)
            return RES_NOMEM;
    }
    *count = c;
    return RES_OK;
}

/* splice(records, stored_head, removed_head, tail_host, tail_disk, no_info) -> None
 * (records that break the layout), or (wire, count, cleared): wire a msgpack array of
 * the count stored and removed events, each its kind's head, its hashes (the msgpack
 * array its info keeps, or [key]), for a stored event the rest of its fields (from its
 * info, or no_info), and its medium's tail; cleared: a cleared record came. */
static PyObject *py_splice(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer rec, pieces[5];
    if (!PyArg_ParseTuple(args, "y*y*y*y*y*y*", &rec, &pieces[0], &pieces[1], &pieces[2],
                          &pieces[3], &pieces[4]))
        return NULL;
    buf_t o = {NULL, 0, 0};
    uint64_t count = 0;
    int cleared = 0, res;
    Py_BEGIN_ALLOW_THREADS
    res = splice_into((const uint8_t *)rec.buf, (size_t)rec.len, pieces, &o, &count,
                      &cleared);
    Py_END_ALLOW_THREADS
    PyObject *out;
    if (res == RES_NOMEM)
        out = PyErr_NoMemory();
    else if (res == RES_BAD)
        out = Py_NewRef(Py_None);
    else
        out = Py_BuildValue("(y#KO)", o.p ? o.p : "", (Py_ssize_t)o.len,
                            (unsigned long long)count, cleared ? Py_True : Py_False);
    PyBuffer_Release(&rec);
    for (int i = 0; i < 5; i++)
        PyBuffer_Release(&pieces[i]);
    free(o.p);
    return out;
}

static PyMethodDef functions[] = {
    {"splice", py_splice, METH_VARARGS,
     "splice(records, stored_head, removed_head, tail_host, tail_disk, no_info) -> None, "
     "or (wire, count, cleared): the store's event records as KV events' wire bytes"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "tensordb.client._kv_wire",
    "The KV events' wire bytes, spliced natively from the store's event records.", -1,
    functions, NULL, NULL, NULL, NULL,
};

__attribute__((visibility("default"))) PyMODINIT_FUNC PyInit__kv_wire(void) {
    return PyModule_Create(&module);
}
