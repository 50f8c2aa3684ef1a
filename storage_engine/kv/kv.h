/* The KV block store's index and arena, in shared memory: storage_engine._stream.BlockIndex.
 *
 * Every process of a host that opens a namespace maps the same files under its root
 * (layout.h: what each holds, and the invariants every value read from them is checked
 * against) and takes one process-shared, robust mutex for each batch step.
 *
 * A batch costs one lock for its reservations, the copies (GIL and lock released,
 * checksums in the same pass), and one lock to publish: no Python object, LMDB call or
 * system call per block. Reads of whole batches (read_into) take no lease: they copy,
 * then check under the lock that each record still names the chunk they copied from
 * (its generation), and copy again where it moved (a seqlock). Zero-copy reads lease
 * the record (a bit per process slot in `readers`) until the view is gone.
 *
 * Invariants (the Python tests hold the store to them):
 * - first writer wins: a key present, or being written by a live writer, is skipped;
 * - a block that fails its checksum is dropped and never served;
 * - a pinned block, a leased block and a block being written are never evicted;
 * - when nothing can go, a put fails at once (status FULL), having stored nothing.
 *
 * Crash safety: a process killed while it holds the mutex leaves it EOWNERDEAD; the next
 * locker rebuilds everything derivable (buckets, queues, free lists, counters) from the
 * records, which are written state-last. Dead writers' chunks and dead readers' leases
 * are reclaimed when an allocation finds no room (once per batch), never scanned for
 * per block.
 *
 * The files of this library, one job each (this header declares what they share):
 *   layout.h    the shared structs, the layout's version and each struct's invariants
 *   fault.c     compiled-in fault points (tests)
 *   table.c     the table files, the records file and the hash table (open addressing,
 *               growth by doubling, buckets moved to the next table a few at a time)
 *   arena.c     records, slabs and chunks, kept mappings of pooled slab files
 *   evict.c     the eviction queues (LRU, S3-FIFO), victims, reclaiming dead processes
 *   spill.c     spill files: a victim's bytes to disk, written outside the lock
 *   lock.c      the robust mutex, damage, and the repair of a dead holder's state
 *   copy.c      the copies and checksums of a batch, on worker threads
 *   write.c     put, pin, delete
 *   read.c      match, contains, read_into, lease / release, promotion from disk
 *   events.c    the event ring (events.kvx): neutral records of what entered and left
 *   check.c     the consistency checker (BlockIndex.check)
 *   module.c    the Python type: arguments, open and close, stats, module functions
 */
#ifndef TENSORDB_KV_H
#define TENSORDB_KV_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "../_stream.h"
#include "layout.h"

/* what a batch step can end with */
enum { E_OK = 0, E_FULL = 1, E_TOO_BIG = 2, E_NOSPACE = 3, E_IO = 4, E_PROCS = 5 };

typedef struct {
    char *base;
    size_t size;
    uint32_t gen;
    int fd;
} smap_t;

typedef struct {
    PyObject_HEAD
    hdr_t *hdr;
    uint64_t *buckets;
    rec_t *recs;
    char *table;
    size_t table_size;
    uint32_t table_gen;
    int slot; /* this handle's process slot */
    uint32_t hint; /* the slab of the last allocation */
    /* an eviction's chunk handed straight to the allocation that evicted for it (not
     * chained into the free list and popped again: that write and read of the victim's
     * memory were a quarter of a put into a full arena) */
    uint64_t want_csize;
    uint32_t hand_slot, hand_chunk;
    int hand;
    char *root;
    char *disk_root;
    char *pool_dir; /* the store's pool of freed files, whose pages new slabs take */
    uint64_t disk_capacity;
    smap_t maps[MAX_SLABS];
    /* keys that left the store in the last call (GPU copies to forget) */
    uint8_t *left;
    size_t nleft, left_cap;
    char *ev_map; /* the event ring, mapped once events are on */
    size_t ev_size;
    uint64_t nb, ncap; /* the table this process maps: its buckets and records */
    uint64_t tables;   /* the header's tables (both generations) these mappings are of */
    /* the table a growth is moving buckets out of (old_gen; NULL: none), mapped too */
    char *otable;
    size_t otable_size;
    uint64_t *obuckets;
    uint64_t onb;
    uint32_t old_gen;
    size_t recs_mapped; /* bytes of the records file mapped at recs (a reservation of
                         * MAX_RECS records, made at the first mapping) */
    /* this process's hold on that mapping: lookups without the mutex read it under a
     * read hold, and whoever replaces or unmaps it (a remap after a growth, a growth,
     * close) takes the write hold, so that no thread of the process reads a table
     * unmapped under it */
    pthread_rwlock_t maplock;
    int maplock_ok;
    uint32_t premade; /* the table generation this process last made a file for */
    /* damage found in a shared file (see damaged()): the next return raises it */
    int dmg;
    char dmg_path[4200];
    char dmg_why[200];
} Idx;

/* The shared files are not trusted: every index, length, offset and count read from
 * them is checked before it is used (an address, an array index, a copy's length, a
 * loop's bound), and every file is fstat'ed before it is mapped. A failed check marks
 * the namespace damaged in its header (ready = READY_DAMAGED): from then on every
 * process's next lock fails, and every call raises the damage error (KVIndexDamaged,
 * CorruptData to the client) naming the file, instead of serving from state that
 * cannot be trusted. The blocks are a cache: removing the namespace's files starts it
 * empty. What can be derived is derived instead: a slab file cut short gets its pages
 * back (its blocks then fail their checksums), a damaged entry of the event ring reads
 * as an overrun (the publisher announces the store afresh), a damaged free chain of a
 * slab is dropped. */


/* damage (lock.c): a check of a shared file failed; `file` names the file under the
 * namespace's root. Both return -1. */
HIDDEN int damaged(Idx *s, const char *file, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
HIDDEN int table_damaged(Idx *s, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
HIDDEN int gen_damaged(Idx *s, uint32_t gen, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* fault points (fault.c): FAULT(name) does what a test armed the point to do */
HIDDEN extern int faults_armed;
HIDDEN void fault_hit(const char *name);
#define FAULT(name)                                                                     \
    do {                                                                                \
        if (__builtin_expect(faults_armed, 0))                                          \
            fault_hit(name);                                                            \
    } while (0)

/* what a batch's copies do (copy.c) */
enum { CP_PUT = 0, CP_READ = 1, CP_READ_NOVERIFY = 2 };

static inline uint64_t mix64(uint64_t x) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ULL;
    x ^= x >> 33;
    return x;
}

static inline rec_t *R(Idx *s, uint32_t i) { return &s->recs[i]; }

/* a queue link or head read from the table or header: 0 (none) or a record + 1 */
static inline int link_ok(Idx *s, uint32_t l) { return l <= s->hdr->bump; }

/* a chunk a record names is one of a live slab's (of metadata, or of blocks) */
static inline int chunk_ok(const hdr_t *h, uint32_t slot, uint32_t chunk, int meta) {
    return slot < h->nslabs && h->slabs[slot].live == SLAB_LIVE &&
           chunk < h->slabs[slot].nchunks &&
           h->slabs[slot].meta == (uint32_t)meta;
}

typedef struct {
    uint32_t idx, gen;
    uint64_t seq, nbytes;
    const char *src;
    uint8_t *meta; /* a copy */
    uint32_t mlen;
    int want_meta;
    char path[4096];
} pspill_t;

static inline int evictable(rec_t *r) {
    return r->state == S_HOST && r->pins == 0 && r->readers == 0;
}

typedef struct {
    uint8_t (*keys)[KEYMAX + 1]; /* [0]: length */
    Py_ssize_t n;
} keyset_t;

typedef struct {
    uint32_t idx, gen, slab, chunk;
    Py_ssize_t i;
    uint32_t untouched; /* a chunk of a fresh slab never written: its pages not made yet */
    /* the chunk's address in this process's mapping and its size, taken under the lock
     * where they were checked: the copies outside it never read the shared slab table,
     * which another process may change meanwhile (a slab dropped and its slot made again
     * with another chunk size would move the address outside this mapping) */
    char *at;
    uint64_t csize;
} res_t;

typedef struct {
    Idx *s;
    res_t *res;
    uint64_t *sums;
    const uint64_t *addrs, *sizes, *want;
    uint8_t (*keys)[KEYMAX + 1];
    int mode;
    size_t stream_min; /* blocks of this many bytes or more go around the cache */
    Py_ssize_t lo, hi;
} copy_job_t;

static inline int readable(rec_t *r) { return r->state == S_HOST || r->state == S_DISK; }

static inline uint64_t ev_bytes(uint32_t klen, uint32_t mlen) {
    return ((uint64_t)sizeof(evh_t) + klen + mlen + 7) & ~7ULL;
}

static inline void unlock(Idx *s) { pthread_mutex_unlock(&s->hdr->lock); }
static inline void free_keys(keyset_t *ks) { PyMem_Free(ks->keys); }

/* ------------------------------------------------------------------------------ */
/* what the files call of each other */


/* lock.c */
PyObject *raise_damage(Idx *s);
int proc_alive(const proc_t *p);
int lock(Idx *s);

/* fault.c */
PyObject *py_set_fault(PyObject *self, PyObject *args);
PyObject *py_fault_points(PyObject *self, PyObject *unused);

/* table.c */
uint64_t khash(const hdr_t *h, const uint8_t *key, size_t klen);
void table_path(Idx *s, uint32_t gen, char *out, size_t n);
int map_table(Idx *s);
int create_file(const char *path, size_t size);
int create_table(const char *path, uint32_t gen, uint64_t nb, uint64_t cap);
void records_path(const char *root, uint32_t gen, char *out, size_t n);
void unmap_tables(Idx *s);
void drop_old(Idx *s);
int rehash(Idx *s, uint64_t budget);
#define REHASH_STEP 4 /* buckets of the old table moved on at each record made: it holds
                       * half as many as the new one, which a growth doubles again only
                       * after cap / 2 more records, so it is empty well before */
int h_insert_raw(uint64_t *buckets, uint64_t nb, uint64_t hash, uint32_t idx);
int h_insert(Idx *s, uint64_t hash, uint32_t idx);
int grow(Idx *s);
void table_premake(Idx *s);
int64_t h_find(Idx *s, const uint8_t *key, size_t klen);
int lf_present(Idx *s, const uint8_t *key, size_t klen);
void map_hold(Idx *s, int write);
void map_let_go(Idx *s);

/* the buckets' seqlock (hdr_t.tseq), under the lock: a window in which they change */
static inline void tseq_begin(hdr_t *h) {
    __atomic_store_n(&h->tseq, h->tseq | 1, __ATOMIC_RELAXED);
    __atomic_thread_fence(__ATOMIC_RELEASE);
}
static inline void tseq_end(hdr_t *h) {
    __atomic_store_n(&h->tseq, (h->tseq | 1) + 1, __ATOMIC_RELEASE);
}
void h_delete(Idx *s, uint32_t idx);

/* arena.c */
int64_t rec_new(Idx *s);
void rec_free(Idx *s, uint32_t i);
int slab_ok(const hdr_t *h, const slab_t *sl);
int slab_damaged(Idx *s, uint32_t slot);
int rec_check(Idx *s, uint32_t i);
void slab_path(Idx *s, uint32_t slot, uint32_t gen, char *out, size_t n);
void unmap_slab(Idx *s, uint32_t slot);
char *slab_base(Idx *s, uint32_t slot);
int slab_check(Idx *s, uint32_t slot);
int take_free(Idx *s, uint64_t csize, uint32_t *slot, uint32_t *chunk,
                     int *untouched, uint32_t meta);
void release_chunk(Idx *s, uint32_t slot, uint32_t chunk);
void kv_atfork_child(void);
void kept_add(char *base, size_t size, int fd);
int allocate_meta(Idx *s, uint64_t csize, uint32_t *slot, uint32_t *chunk);
int new_slab(Idx *s, uint64_t csize);
int make_slab(Idx *s, uint64_t csize);
void drop_making(Idx *s, uint32_t slot);
int drop_empty_slab(Idx *s, uint64_t keep);
PyObject *py_kept_maps(PyObject *self, PyObject *args);

/* evict.c */
void q_push(Idx *s, int q, uint32_t i);
void q_remove(Idx *s, uint32_t i);
void remove_host(Idx *s, uint32_t i);
int64_t victim(Idx *s);
void on_insert(Idx *s, uint32_t i, int was_ghost);
void on_access(Idx *s, uint32_t i);
uint64_t reclaim_dead(Idx *s);
int allocate(Idx *s, uint64_t csize, uint32_t *slot, uint32_t *chunk, int *reclaimed,
                    int *untouched);

/* copy.c */
int res_at(Idx *s, res_t *r, uint64_t nbytes);
void workers_atfork_child(void);
void copy_all(copy_job_t job, Py_ssize_t n);

/* spill.c */
void spill_file(Idx *s, const uint8_t *key, size_t klen, uint64_t seq, char *out,
                       size_t n);
void spill_path(Idx *s, rec_t *r, char *out, size_t n);
int read_spill(const char *path, char *dst, uint64_t nbytes);
void note_left(Idx *s, rec_t *r);
void meta_free(Idx *s, rec_t *r);
const uint8_t *rec_meta(Idx *s, rec_t *r, uint32_t *len, uint8_t **owned);
void drop_disk(Idx *s, uint32_t i, int forget);
int spill_write(const char *path, const char *src, uint64_t n, const uint8_t *meta,
                       uint32_t mlen, int want_meta);
int spill(Idx *s, uint32_t i);
uint64_t room_for(Idx *s, const uint64_t *cls, int ncls);
Py_ssize_t prespill_pick(Idx *s, uint64_t need, pspill_t *out, Py_ssize_t max);
void prespill_commit(Idx *s, pspill_t *ps, Py_ssize_t n, const uint8_t *ok);

/* module.c */
int parse_keys(PyObject *seq, keyset_t *ks);
int u64_buffer(PyObject *obj, Py_buffer *b, Py_ssize_t n, const char *what);
int parse_batch(PyObject *keys_o, PyObject *addrs_o, PyObject *sizes_o,
                       keyset_t *ks, Py_buffer *ab, Py_buffer *sb);
int usable(Idx *s);
PyObject *lock_error(Idx *s);

/* write.c */
PyObject *Idx_put(Idx *s, PyObject *args);
PyObject *Idx_pin(Idx *s, PyObject *args);
PyObject *Idx_delete(Idx *s, PyObject *keys_o);

/* read.c */
PyObject *Idx_match(Idx *s, PyObject *keys_o);
PyObject *Idx_contains(Idx *s, PyObject *keys_o);
/* a promotion of a spilled block: begun and finished under the lock, its file read
 * (promote_io) with the lock let go */
typedef struct {
    uint32_t idx, gen, slot, chunk;
    uint64_t nbytes, csum, seq;
    uint32_t meta_len; /* its metadata past the record (in its file): 0 for none */
    uint8_t klen, key[KEYMAX];
    char *dst;         /* the chunk, in this process's mapping of its slab */
    uint8_t *meta;     /* the metadata read (malloc), for its chunk at the end */
    int ok;            /* read whole and checked */
} promo_t;
int promote_begin(Idx *s, uint32_t i, promo_t *p, int *reclaimed);
void promote_io(Idx *s, promo_t *p, void *state);
int promote_finish(Idx *s, promo_t *p);
void promote_abandon(Idx *s, uint32_t i);
PyObject *Idx_read_into(Idx *s, PyObject *args);
PyObject *Idx_lease(Idx *s, PyObject *keys_o);
PyObject *Idx_release(Idx *s, PyObject *args);
PyObject *Idx_drop_corrupt(Idx *s, PyObject *args);

/* check.c */
PyObject *Idx_check(Idx *s, PyObject *unused);

/* events.c */
int ev_map(Idx *s);
void ev_put(Idx *s, int type, int medium, const uint8_t *key, uint32_t klen,
                   const uint8_t *meta, uint32_t mlen);
void ev_rec(Idx *s, int type, int medium, uint32_t i);
PyObject *Idx_events_claim(Idx *s, PyObject *unused);
PyObject *Idx_events_read(Idx *s, PyObject *args);
PyObject *Idx_events_take(Idx *s, PyObject *args);
PyObject *Idx_events_release(Idx *s, PyObject *unused);



extern PyObject *damage_type; /* lock.c: what damage raises: (path, reason) -> exception */
extern pid_t kept_pid;        /* arena.c: the process whose kept mappings these are */
extern long ncpus;            /* copy.c: the host's processors */

#endif
