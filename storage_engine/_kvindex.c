/* The KV block store's index and arena, in shared memory: storage_engine._stream.BlockIndex.
 *
 * Every process of a host that opens a namespace maps the same two files under its
 * root and takes one process-shared, robust mutex for each batch step:
 *
 *   index.kvx        the header: settings, counters, the mutex, the process table (who
 *                    holds read leases), the slab table, the eviction queues' ends
 *   table-<gen>.kvx  the hash table (open addressing, linear probing, backward-shift
 *                    deletion; 8-byte buckets holding a 32-bit tag and the record's
 *                    index) and the records (rec_t), grown by doubling into a new file
 *                    whose generation every process notices at its next lock
 *   slabs/<slot>-<gen>.slab   the arena: files of fixed-size chunks of one size class
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
 */
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

#include "_stream.h"

#define KV_MAGIC 0x3178766b62647374ULL /* "tsdbkvx1" */
#define KV_VERSION 3 /* 3: the table file has its own header */
#define KEYMAX 32
#define INLINE_META 40
#define MAX_SLABS 1024
#define MAX_PROCS 64
#define MIN_CHUNK 512
#define PAGE 4096
#define INITIAL_RECS 256
#define EV_RING_BYTES (16u << 20) /* the event ring's size: the only one ever made */
#define META_SPILLED 0xFFFFFFFFu /* mslab of a spilled block: its metadata is in its file */

enum { S_FREE = 0, S_WRITING = 1, S_HOST = 2, S_DISK = 3, S_ZOMBIE = 4, S_GHOST = 5 };
/* queues: LRU (or S3-FIFO's small), S3-FIFO's main and ghost, spilled blocks */
enum { Q_SMALL = 0, Q_MAIN = 1, Q_GHOST = 2, Q_DISK = 3, NQ = 4 };
enum { EV_LRU = 0, EV_S3FIFO = 1 };
/* shared counters, in the order of COUNTER_NAMES */
enum { C_HOST_BLOCKS, C_HOST_BYTES, C_DISK_BLOCKS, C_DISK_BYTES, C_ARENA_BYTES, C_PINNED,
       C_HITS, C_MISSES, C_EVICTIONS, C_SPILLS, C_CORRUPT, C_SLAB_DROPS, C_RECLAIM_SCANS,
       C_META_BYTES,
       NCOUNTERS };
static const char *COUNTER_NAMES[NCOUNTERS] = {
    "host_blocks", "host_bytes", "disk_blocks", "disk_bytes", "arena_bytes", "pinned",
    "hits", "misses", "evictions", "spills", "corrupt", "slab_drops", "reclaim_scans",
    "meta_bytes"};
/* what a batch step can end with */
enum { E_OK = 0, E_FULL = 1, E_TOO_BIG = 2, E_NOSPACE = 3, E_IO = 4, E_PROCS = 5 };

typedef struct {
    uint8_t key[KEYMAX];
    uint8_t klen, state, queue, freq; /* queue: Q_x + 1, 0 when in none */
    uint32_t pins;
    uint32_t slab, chunk; /* HOST, WRITING, ZOMBIE: where the bytes are; DISK: spill seq */
    uint64_t nbytes;
    uint64_t csum;
    uint64_t readers; /* a bit per process slot holding a zero-copy view */
    uint32_t gen;     /* changes whenever the record's bytes move or it is freed */
    uint32_t writer;  /* WRITING: process slot + 1 */
    uint32_t prev, next; /* queue links, index + 1 (free records: next) */
    uint32_t meta_len, mslab, mchunk, spare; /* metadata past INLINE_META: its chunk */
    uint8_t meta[INLINE_META];
} rec_t;

typedef struct {
    uint64_t csize;
    uint32_t nchunks, used, bump, free_head; /* free_head: chunk + 1, chained in chunks */
    uint32_t gen, live;
    uint32_t fresh; /* its pages were never touched (not a recycled file) */
    uint32_t meta;  /* a slab of blocks' metadata past their records: beside the arena */
} slab_t;

typedef struct {
    int32_t pid;
    uint32_t used;
    uint64_t start;
} proc_t;

typedef struct {
    uint32_t head, tail; /* index + 1 */
    uint64_t len;
} queue_t;

typedef struct {
    uint64_t magic;
    uint32_t version, ready;
    pthread_mutex_t lock;
    uint64_t seed0, seed1;
    uint64_t capacity, slab_bytes;
    uint32_t eviction, gpu_seen;
    uint32_t table_gen, nslabs; /* slab slots ever used (high-water mark) */
    uint64_t bump, free_rec, nrecs; /* records made, the free ones' chain, those in use */
    uint64_t spill_seq, write_epoch;
    uint64_t count[NCOUNTERS];
    queue_t q[NQ];
    proc_t procs[MAX_PROCS];
    slab_t slabs[MAX_SLABS];
    /* KV events: a ring of what entered and left the store (events.kvx), written while a
     * publisher is attached, read by it (one process per namespace) */
    uint32_t ev_on, ev_pub;   /* events written; the publisher's process slot + 1 */
    uint64_t ev_ring;         /* the ring's size in bytes (0: not made yet) */
    uint64_t ev_head;         /* bytes ever written to the ring */
    uint64_t ev_lost;         /* events not written (no ring mapped, too large) */
    uint64_t ev_pub_seq;      /* the publisher's next sequence number, kept for the next */
} hdr_t;

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
#define READY_DAMAGED 0xdead
static PyObject *damage_type; /* what damage raises: (path, reason) -> exception */

/* events: what a ring entry says (EVT_PAD fills the ring's end), and where the block is */
enum { EVT_STORED = 1, EVT_REMOVED = 2, EVT_CLEARED = 3, EVT_PAD = 255 };
enum { MED_CPU = 0, MED_STORAGE = 1 };
typedef struct {
    uint32_t len, mlen; /* the entry's bytes (a multiple of 8), its metadata's */
    uint8_t type, medium, klen, pad[5];
} evh_t;
static void ev_rec(Idx *s, int type, int medium, uint32_t i);

/* a check of a shared file failed: the namespace is damaged (the first reason is kept).
 * `file` names the file under the namespace's root ("index.kvx", or a table's, a
 * slab's or the ring's name). Returns -1. */
__attribute__((format(printf, 3, 4)))
static int damaged(Idx *s, const char *file, const char *fmt, ...) {
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

static int table_damaged(Idx *s, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int table_damaged(Idx *s, const char *fmt, ...) {
    char file[64], why[200];
    snprintf(file, sizeof file, "table-%u.kvx", s->table_gen);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, sizeof why, fmt, ap);
    va_end(ap);
    return damaged(s, file, "%s", why);
}

/* raise the handle's damage (with the GIL) */
static PyObject *raise_damage(Idx *s) {
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
static void ev_put(Idx *s, int type, int medium, const uint8_t *key, uint32_t klen,
                   const uint8_t *meta, uint32_t mlen);

/* ---------------------------------------------------------------------------------- */
/* fault injection (tests), as SQLite's test builds have: a named point in a step does
 * what a test asked of it, once its count of hits runs out. Compiled in always: while
 * no point is armed, a point costs one load of a flag that never changes. */

enum { FP_OFF = 0, FP_KILL = 1, FP_SLEEP = 2 };
typedef struct {
    const char *name;
    int action;
    long arg;   /* FP_SLEEP: microseconds */
    long after; /* hits before it acts (1: the next) */
} fpoint_t;
static fpoint_t fpoints[] = {
    {"put.reserved", 0, 0, 0},  /* a put's chunks reserved, under the lock */
    {"put.copied", 0, 0, 0},    /* its copies made, before the lock to publish */
    {"put.publish", 0, 0, 0},   /* the first of its records published, under the lock */
    {"read.copy", 0, 0, 0},     /* a batch read between its look-up and its copies */
    {"grow.made", 0, 0, 0},     /* a table growth's new file written, not published */
    {"grow.published", 0, 0, 0},/* the new table published, the old file not removed */
    {"evict", 0, 0, 0},         /* a victim's record taken out of its queue */
    {"spill.written", 0, 0, 0}, /* a victim's spill file written, its record not moved */
    {"promote.read", 0, 0, 0},  /* a spilled block read back into a chunk, not published */
    {"reclaim", 0, 0, 0},       /* a dead process's first chunk given back */
};
#define NFPOINTS (sizeof fpoints / sizeof fpoints[0])
static int faults_armed;

static void fault_hit(const char *name) {
    for (size_t i = 0; i < NFPOINTS; i++) {
        fpoint_t *f = &fpoints[i];
        if (f->action == FP_OFF || strcmp(f->name, name) != 0)
            continue;
        if (__atomic_sub_fetch(&f->after, 1, __ATOMIC_RELAXED) > 0)
            return;
        if (f->action == FP_KILL)
            kill(getpid(), SIGKILL); /* a crash: nothing of this process runs on */
        else
            usleep((useconds_t)f->arg);
        if (f->after <= 0)
            f->after = 1; /* a sleep acts at every hit from then on */
        return;
    }
}
#define FAULT(name)                                                                     \
    do {                                                                                \
        if (__builtin_expect(faults_armed, 0))                                          \
            fault_hit(name);                                                            \
    } while (0)

/* ---------------------------------------------------------------------------------- */
/* small helpers */

static inline uint64_t mix64(uint64_t x) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ULL;
    x ^= x >> 33;
    return x;
}

/* a keyed hash of a key: the seeds are random per store, so that chosen keys cannot
 * pile into one run of buckets without knowing them */
static uint64_t khash(const hdr_t *h, const uint8_t *key, size_t klen) {
    uint64_t acc = h->seed0 ^ (klen * 0x9e3779b97f4a7c15ULL);
    uint64_t w[4] = {0, 0, 0, 0};
    memcpy(w, key, klen <= KEYMAX ? klen : KEYMAX); /* a record's klen is a shared byte */
    for (int i = 0; i < 4; i++)
        acc = mix64(acc ^ w[i] ^ (h->seed1 + (uint64_t)i));
    return acc;
}

uint64_t size_class(uint64_t n) {
    if (n < PAGE) {
        uint64_t c = MIN_CHUNK;
        while (c < n)
            c <<= 1;
        return c;
    }
    uint64_t p = (n + PAGE - 1) / PAGE * PAGE;
    if (p <= 16 * PAGE)
        return p;
    int bits = 64 - __builtin_clzll(p);
    uint64_t step = 1ULL << (bits - 3);
    return (p + step - 1) / step * step;
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

static int proc_alive(const proc_t *p) {
    return p->used && p->pid > 0 && start_ticks(p->pid) == p->start;
}

static inline rec_t *R(Idx *s, uint32_t i) { return &s->recs[i]; }

/* ---------------------------------------------------------------------------------- */
/* the table file */

/* A table file starts with its own header: its sizes live with it, so that a growth
 * publishes a new table with one store (the index's table_gen, written last) and a
 * holder killed at any point of it leaves either the old table named, whole, or the new
 * one, whole (a file made and not named is removed by the next growth). */
#define TABLE_MAGIC 0x3162617462647374ULL /* "tsdbtab1" */
typedef struct {
    uint64_t magic;
    uint32_t gen, pad;
    uint64_t nbuckets, cap;
    uint64_t spare[4];
} thdr_t; /* 64 bytes: the buckets after it stay aligned */
#define THDR_BYTES 64
_Static_assert(sizeof(thdr_t) == THDR_BYTES, "a table header is 64 bytes");

static size_t table_bytes(uint64_t nbuckets, uint64_t cap) {
    return (size_t)(THDR_BYTES + nbuckets * 8 + cap * sizeof(rec_t));
}

/* a new table file of the sizes, its header written (fd, or -1) */
static int create_table(const char *path, uint32_t gen, uint64_t nb, uint64_t cap);

static void table_path(Idx *s, uint32_t gen, char *out, size_t n) {
    snprintf(out, n, "%s/table-%u.kvx", s->root, gen);
}

/* the sizes a table can have: doubled from INITIAL_RECS, twice as many buckets as
 * records, at most 2^32 buckets (a bucket's tag holds 32 bits of the hash) */
static int table_sizes_ok(uint64_t nb, uint64_t cap) {
    return cap >= INITIAL_RECS && nb == cap * 2 && (nb & (nb - 1)) == 0 && nb <= (1ULL << 32);
}

/* this process's mapping of the table the header names (under the lock): only where
 * its sizes can be and its file is at least that long (a mapping past a file's end is a
 * SIGBUS at the first touch) */
static int map_table(Idx *s) {
    hdr_t *h = s->hdr;
    uint32_t gen = __atomic_load_n(&h->table_gen, __ATOMIC_ACQUIRE);
    char path[4096], file[64];
    snprintf(file, sizeof file, "table-%u.kvx", gen);
    table_path(s, gen, path, sizeof path);
    int fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0) {
        if (errno == ENOENT)
            return damaged(s, file, "the table file the index names is missing");
        return -1;
    }
    thdr_t th;
    struct stat st;
    if (fstat(fd, &st) != 0) {
        close(fd);
        return -1;
    }
    if ((uint64_t)st.st_size < THDR_BYTES || pread(fd, &th, sizeof th, 0) != sizeof th) {
        close(fd);
        return damaged(s, file, "it is %lld bytes: no table header", (long long)st.st_size);
    }
    uint64_t nb = th.nbuckets, cap = th.cap;
    if (th.magic != TABLE_MAGIC || th.gen != gen || !table_sizes_ok(nb, cap)) {
        close(fd);
        return damaged(s, file, "its header says generation %u (named: %u), %llu buckets "
                       "and %llu records", th.gen, gen, (unsigned long long)nb,
                       (unsigned long long)cap);
    }
    size_t size = table_bytes(nb, cap);
    if ((uint64_t)st.st_size < size) {
        close(fd);
        return damaged(s, file, "it is %lld bytes; a table of %llu records is %zu",
                       (long long)st.st_size, (unsigned long long)cap, size);
    }
    void *m = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (m == MAP_FAILED)
        return -1;
    if (s->table != NULL)
        munmap(s->table, s->table_size);
    s->table = (char *)m;
    s->table_size = size;
    s->buckets = (uint64_t *)((char *)m + THDR_BYTES);
    s->recs = (rec_t *)((char *)m + THDR_BYTES + nb * 8);
    s->table_gen = gen;
    s->nb = nb;
    s->ncap = cap;
    return 0;
}

static int create_file(const char *path, size_t size) {
    unlink(path); /* left by a creator killed before it published the name */
    int fd = open(path, O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
    if (fd < 0)
        return -1;
    int r = posix_fallocate(fd, 0, (off_t)size);
    if (r != 0) {
        close(fd);
        unlink(path);
        errno = r;
        return -1;
    }
    return fd;
}

static int create_table(const char *path, uint32_t gen, uint64_t nb, uint64_t cap) {
    int fd = create_file(path, table_bytes(nb, cap));
    if (fd < 0)
        return -1;
    thdr_t th;
    memset(&th, 0, sizeof th);
    th.magic = TABLE_MAGIC;
    th.gen = gen;
    th.nbuckets = nb;
    th.cap = cap;
    if (pwrite(fd, &th, sizeof th, 0) != sizeof th) {
        int e = errno ? errno : EIO;
        close(fd);
        unlink(path);
        errno = e;
        return -1;
    }
    return fd;
}

/* 0, or -1 when no bucket is free (the table holds at most half as many records as
 * buckets: only a damaged table is full) */
static int h_insert_raw(uint64_t *buckets, uint64_t nb, uint64_t hash, uint32_t idx) {
    uint64_t mask = nb - 1, b = hash & mask;
    for (uint64_t probes = 0; buckets[b]; probes++) {
        if (probes >= nb)
            return -1;
        b = (b + 1) & mask;
    }
    buckets[b] = (hash << 32) | (uint64_t)(idx + 1); /* the tag: the hash's low 32 bits */
    return 0;
}

/* double the records (and the buckets with them) into a new table file */
static int grow(Idx *s) {
    hdr_t *h = s->hdr;
    uint64_t cap = s->ncap * 2, nb = s->nb * 2;
    if (nb > (1ULL << 32)) { /* a bucket's tag holds 32 bits of the hash: its home */
        errno = ENOSPC;
        return -1;
    }
    char path[4096];
    table_path(s, h->table_gen + 1, path, sizeof path);
    size_t size = table_bytes(nb, cap);
    int fd = create_table(path, h->table_gen + 1, nb, cap);
    if (fd < 0)
        return -1;
    char *m = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (m == MAP_FAILED) {
        unlink(path);
        return -1;
    }
    uint64_t *buckets = (uint64_t *)(m + THDR_BYTES);
    rec_t *recs = (rec_t *)(m + THDR_BYTES + nb * 8);
    memcpy(recs, s->recs, h->bump * sizeof(rec_t));
    for (uint64_t b = 0; b < s->nb; b++) {
        uint64_t v = s->buckets[b];
        if (v) {
            uint32_t i = (uint32_t)(v & 0xffffffffu) - 1;
            if (i >= h->bump || recs[i].klen == 0 || recs[i].klen > KEYMAX ||
                    h_insert_raw(buckets, nb, khash(h, recs[i].key, recs[i].klen), i) < 0) {
                munmap(m, size);
                unlink(path);
                table_damaged(s, "bucket %llu names record %u of %llu",
                              (unsigned long long)b, i, (unsigned long long)h->bump);
                errno = EIO;
                return -1;
            }
        }
    }
    FAULT("grow.made");
    char old[4096];
    table_path(s, h->table_gen, old, sizeof old);
    /* published: one store, after everything it names is written */
    __atomic_store_n(&h->table_gen, h->table_gen + 1, __ATOMIC_RELEASE);
    munmap(s->table, s->table_size);
    s->table = m;
    s->table_size = size;
    s->buckets = buckets;
    s->recs = recs;
    s->table_gen = h->table_gen;
    s->nb = nb;
    s->ncap = cap;
    FAULT("grow.published");
    unlink(old); /* the others' mappings keep its pages until they remap */
    return 0;
}

/* ---------------------------------------------------------------------------------- */
/* hash table */

/* the record of a key, or -1 (absent), or -2 (the table is damaged: see damaged()) */
static int64_t h_find(Idx *s, const uint8_t *key, size_t klen) {
    hdr_t *h = s->hdr;
    uint64_t hash = khash(h, key, klen), mask = s->nb - 1, b = hash & mask;
    uint64_t tag = hash & 0xffffffffu;
    for (uint64_t probes = 0; probes < s->nb; probes++) {
        uint64_t v = s->buckets[b];
        if (!v)
            return -1;
        if ((v >> 32) == tag) {
            uint32_t i = (uint32_t)(v & 0xffffffffu) - 1;
            if (i >= h->bump)
                return table_damaged(s, "bucket %llu names record %u of %llu",
                                     (unsigned long long)b, i, (unsigned long long)h->bump) * 2;
            rec_t *r = R(s, i);
            if (r->klen == klen && memcmp(r->key, key, klen) == 0)
                return i;
        }
        b = (b + 1) & mask;
    }
    return table_damaged(s, "no bucket of %llu is empty", (unsigned long long)s->nb) * 2;
}

static void h_delete(Idx *s, uint32_t idx) {
    hdr_t *h = s->hdr;
    rec_t *r = R(s, idx);
    uint64_t mask = s->nb - 1, b = khash(h, r->key, r->klen) & mask, probes = 0;
    while ((uint32_t)(s->buckets[b] & 0xffffffffu) != idx + 1) {
        if (!s->buckets[b])
            return; /* not there (a repair in progress) */
        if (++probes >= s->nb) {
            table_damaged(s, "no bucket of %llu is empty", (unsigned long long)s->nb);
            return;
        }
        b = (b + 1) & mask;
    }
    /* backward shift: pull later entries of the run into the hole */
    uint64_t hole = b, j = b;
    for (probes = 0;; probes++) {
        j = (j + 1) & mask;
        uint64_t v = s->buckets[j];
        if (!v)
            break;
        if (probes >= s->nb) {
            table_damaged(s, "no bucket of %llu is empty", (unsigned long long)s->nb);
            return;
        }
        /* its home from its tag, the hash's low bits (the table has at most 2^32
         * buckets): no look at its record, which is cold */
        uint64_t home = (v >> 32) & mask;
        /* can the entry at j move to hole? only if its home is not in (hole, j] */
        int between = hole <= j ? (home > hole && home <= j) : (home > hole || home <= j);
        if (!between) {
            s->buckets[hole] = v;
            hole = j;
        }
    }
    s->buckets[hole] = 0;
}

/* ---------------------------------------------------------------------------------- */
/* queues */

/* a queue link or head read from the table or header: 0 (none) or a record + 1 */
static inline int link_ok(Idx *s, uint32_t l) { return l <= s->hdr->bump; }

static void q_push(Idx *s, int q, uint32_t i) {
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

static void q_remove(Idx *s, uint32_t i) {
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

static int64_t rec_new(Idx *s) {
    hdr_t *h = s->hdr;
    uint32_t i;
    if (h->free_rec) {
        i = (uint32_t)h->free_rec - 1;
        if (h->free_rec > h->bump || R(s, i)->state != S_FREE || !link_ok(s, R(s, i)->next)) {
            table_damaged(s, "the free records' chain reaches record %u", i);
            errno = EIO;
            return -1;
        }
        h->free_rec = R(s, i)->next;
    } else {
        if (h->bump >= s->ncap && grow(s) < 0)
            return -1;
        i = (uint32_t)h->bump++;
        R(s, i)->gen = 0;
    }
    rec_t *r = R(s, i);
    uint32_t gen = r->gen;
    memset(r, 0, sizeof *r);
    r->gen = gen;
    h->nrecs++;
    return i;
}

static void rec_free(Idx *s, uint32_t i) {
    hdr_t *h = s->hdr;
    rec_t *r = R(s, i);
    r->state = S_FREE;
    r->gen++;
    r->readers = 0;
    r->queue = 0;
    r->prev = 0;
    r->next = (uint32_t)h->free_rec;
    h->free_rec = i + 1;
    h->nrecs--;
}

/* ---------------------------------------------------------------------------------- */
/* slabs and chunks */

/* a slab's entry of the slab table can be: its chunk size a size class, its file's
 * size within what an allocation makes (a data slab within the capacity, a metadata
 * slab of 256 KiB or one chunk), its counts within its chunks */
static int slab_ok(const hdr_t *h, const slab_t *sl) {
    uint64_t bytes;
    if (sl->csize < MIN_CHUNK || sl->csize > (1ULL << 40) || size_class(sl->csize) != sl->csize ||
            sl->nchunks == 0 || __builtin_mul_overflow(sl->csize, (uint64_t)sl->nchunks, &bytes))
        return 0;
    uint64_t most = sl->meta ? (sl->csize > (256u << 10) ? sl->csize : 256u << 10) : h->capacity;
    return bytes <= most && sl->used <= sl->nchunks && sl->bump <= sl->nchunks &&
           sl->free_head <= sl->nchunks;
}

static int slab_damaged(Idx *s, uint32_t slot) {
    const slab_t *sl = &s->hdr->slabs[slot];
    return damaged(s, "index.kvx", "slab %u: %llu chunks of %llu bytes, %u used, %u made, "
                   "free from %u", slot, (unsigned long long)sl->nchunks,
                   (unsigned long long)sl->csize, sl->used, sl->bump, sl->free_head);
}

/* a chunk a record names is one of a live slab's (of metadata, or of blocks) */
static inline int chunk_ok(const hdr_t *h, uint32_t slot, uint32_t chunk, int meta) {
    return slot < h->nslabs && h->slabs[slot].live && chunk < h->slabs[slot].nchunks &&
           h->slabs[slot].meta == (uint32_t)meta;
}

/* record i, reached by a key, a queue or a lease, can be what its fields say: 0, or -1
 * (the table is damaged: see damaged()). What match and contains read of it (its key
 * and state) needs no check; everything that leads to an address or a length does. */
static int rec_check(Idx *s, uint32_t i) {
    hdr_t *h = s->hdr;
    rec_t *r = R(s, i);
    const char *bad = NULL;
    int holds = r->state == S_WRITING || r->state == S_HOST || r->state == S_ZOMBIE;
    if (r->klen == 0 || r->klen > KEYMAX)
        bad = "key length";
    else if (r->state > S_GHOST || r->queue > NQ)
        bad = "state";
    else if (r->writer > MAX_PROCS || (r->state == S_WRITING && r->writer == 0))
        bad = "writer";
    else if (!link_ok(s, r->prev) || !link_ok(s, r->next))
        bad = "queue links";
    else if (holds && !chunk_ok(h, r->slab, r->chunk, 0))
        bad = "chunk";
    else if (r->state == S_HOST &&
             (r->nbytes == 0 || size_class(r->nbytes) != h->slabs[r->slab].csize))
        bad = "size";
    else if (r->state == S_DISK && (r->nbytes == 0 || r->nbytes > h->capacity))
        bad = "size";
    else if (r->meta_len > INLINE_META &&
             (r->state == S_DISK ? r->mslab != META_SPILLED
                                 : !holds || !chunk_ok(h, r->mslab, r->mchunk, 1) ||
                                   r->meta_len > h->slabs[r->mslab].csize))
        bad = "metadata";
    if (bad == NULL)
        return 0;
    return table_damaged(s, "record %u: its %s cannot be (state %u, slab %u, chunk %u, "
                         "%llu bytes, metadata %u bytes)", i, bad, r->state, r->slab,
                         r->chunk, (unsigned long long)r->nbytes, r->meta_len);
}

static void slab_path(Idx *s, uint32_t slot, uint32_t gen, char *out, size_t n) {
    snprintf(out, n, "%s/slabs/%04x-%u.slab", s->root, slot, gen);
}

static void unmap_slab(Idx *s, uint32_t slot) {
    smap_t *m = &s->maps[slot];
    if (m->base != NULL)
        munmap(m->base, m->size);
    if (m->fd >= 0)
        close(m->fd);
    m->base = NULL;
    m->size = 0;
    m->fd = -1;
}

/* this process's shared mapping of a slab (NULL on failure). A slab file cut short
 * outside the store gets its pages back first: an access past the end of a file is a
 * SIGBUS, where restored pages read zeros and fail their blocks' checksums. */
static char *slab_base(Idx *s, uint32_t slot) {
    if (slot >= s->hdr->nslabs) {
        damaged(s, "index.kvx", "slab %u of %u", slot, s->hdr->nslabs);
        return NULL;
    }
    slab_t *sl = &s->hdr->slabs[slot];
    smap_t *m = &s->maps[slot];
    size_t size = sl->csize * sl->nchunks;
    if (m->base != NULL && m->gen == sl->gen && m->size == size)
        return m->base;
    if (!slab_ok(s->hdr, sl)) { /* checked where it is mapped, not where it is used */
        slab_damaged(s, slot);
        return NULL;
    }
    unmap_slab(s, slot);
    char path[4096];
    slab_path(s, slot, sl->gen, path, sizeof path);
    int fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0 && errno == ENOENT) /* deleted under the store: its blocks fail their sums */
        fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (fd < 0)
        return NULL;
    struct stat st;
    if (fstat(fd, &st) == 0 && (size_t)st.st_size < size && posix_fallocate(fd, 0, size)) {
        close(fd);
        return NULL;
    }
    /* where the file's pages exist (written before, or a recycled file), fill this
     * process's page tables now (~10 GB/s) rather than fault page by page in the copies
     * (under 1 GB/s); a fresh slab's pages are made as its chunks are first written */
    int populate = !sl->fresh && (size_t)st.st_blocks * 512 >= size / 2 ? MAP_POPULATE : 0;
    void *b = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED | populate, fd, 0);
    if (b == MAP_FAILED) {
        close(fd);
        return NULL;
    }
    m->base = (char *)b;
    m->size = size;
    m->gen = sl->gen;
    m->fd = fd;
    return m->base;
}

/* the slab's file is as long as the slab (one fstat): see slab_base */
static int slab_check(Idx *s, uint32_t slot) {
    slab_t *sl = &s->hdr->slabs[slot];
    smap_t *m = &s->maps[slot];
    if (slab_base(s, slot) == NULL)
        return -1;
    struct stat st;
    size_t size = sl->csize * sl->nchunks;
    if (fstat(m->fd, &st) == 0 && (size_t)st.st_size >= size)
        return 0;
    return posix_fallocate(m->fd, 0, size) ? -1 : 0;
}

static int take_free(Idx *s, uint64_t csize, uint32_t *slot, uint32_t *chunk,
                     int *untouched, uint32_t meta) {
    hdr_t *h = s->hdr;
    /* the slab the last allocation used first: a batch's chunks come from one slab, and
     * a scan of the slab table per block costs what the table holds */
    uint32_t hint = s->hint < h->nslabs ? s->hint : 0;
    for (uint32_t k = 0; k < h->nslabs; k++) {
        uint32_t i = k == 0 ? hint : (k <= hint ? k - 1 : k);
        slab_t *sl = &h->slabs[i];
        if (!sl->live || sl->csize != csize || sl->used == sl->nchunks || sl->meta != meta)
            continue;
        if (sl->free_head > sl->nchunks) /* a chain damaged outside the store */
            sl->free_head = 0;
        if (sl->free_head) {
            char *base = slab_base(s, i);
            if (base == NULL)
                return -1;
            uint32_t c = sl->free_head - 1;
            memcpy(&sl->free_head, base + (size_t)c * csize, 4);
            if (sl->free_head > sl->nchunks) /* a chain damaged outside the store */
                sl->free_head = 0;
            *chunk = c;
            *untouched = 0;
        } else if (sl->bump < sl->nchunks) {
            *chunk = sl->bump++;
            *untouched = (int)sl->fresh;
            if (sl->bump == sl->nchunks)
                sl->fresh = 0; /* every chunk written once: its pages all exist */
        } else {
            continue;
        }
        sl->used++;
        *slot = i;
        s->hint = i;
        return 1;
    }
    return 0;
}

static void release_chunk(Idx *s, uint32_t slot, uint32_t chunk) {
    if (slot >= s->hdr->nslabs || chunk >= s->hdr->slabs[slot].nchunks) {
        table_damaged(s, "a record names chunk %u of slab %u", chunk, slot);
        return;
    }
    slab_t *sl = &s->hdr->slabs[slot];
    if (s->want_csize == sl->csize && !s->hand && !sl->meta) {
        s->hand = 1; /* still counted in use: the allocation takes it as it is */
        s->hand_slot = slot;
        s->hand_chunk = chunk;
        return;
    }
    char *base = slab_base(s, slot);
    sl->used--;
    if (base != NULL) {
        memcpy(base + (size_t)chunk * sl->csize, &sl->free_head, 4);
        sl->free_head = chunk + 1;
    }
    /* else: the chunk is lost to this slab until it empties (its memory is gone) */
}

/* This process's mappings of slab files it handed to the store's pool (a namespace
 * destroyed here), by inode: a new slab that claims such a file back takes the mapping
 * as it is, page tables filled, instead of mapping the file again (filling 64 MiB of
 * page-table entries costs ~4-5 ms, about half of a 64 MiB put + get). A mapping kept of
 * a file since unlinked would keep its pages alive: every keep and claim closes those
 * (and the pool truncates a file to nothing before it unlinks it, which frees the pages
 * of every mapping); at most KEPT_MAX are kept, the oldest closed first. A forked child
 * drops its parent's. storage_engine._mapping.MapCache does the same for segments. */
#define KEPT_MAX 64
typedef struct {
    dev_t dev;
    ino_t ino;
    char *base;
    size_t size;
    int fd;
} kept_t;
static kept_t kept[KEPT_MAX];
static int nkept;
static pid_t kept_pid;
static uint64_t kept_reused, kept_kept;
static pthread_mutex_t kept_mu = PTHREAD_MUTEX_INITIALIZER;

static void kept_close(kept_t *k) {
    munmap(k->base, k->size);
    close(k->fd);
}

/* under kept_mu: forget a forked parent's mappings, close those of files gone */
static void kept_prune_locked(void) {
    if (kept_pid != getpid()) {
        for (int i = 0; i < nkept; i++)
            kept_close(&kept[i]); /* this child's copies of its parent's mappings */
        nkept = 0;
        kept_pid = getpid();
        return;
    }
    int j = 0;
    for (int i = 0; i < nkept; i++) {
        struct stat st;
        if (fstat(kept[i].fd, &st) != 0 || st.st_nlink == 0)
            kept_close(&kept[i]);
        else
            kept[j++] = kept[i];
    }
    nkept = j;
}

static void workers_atfork_child(void);

static void kv_atfork_child(void) {
    pthread_mutex_init(&kept_mu, NULL);
    workers_atfork_child();
}

/* keep a slab's mapping (base, size, its file open as fd); takes both over */
static void kept_add(char *base, size_t size, int fd) {
    struct stat st;
    kept_t gone = {0, 0, NULL, 0, -1};
    pthread_mutex_lock(&kept_mu);
    kept_prune_locked();
    if (fstat(fd, &st) != 0 || st.st_nlink == 0) {
        pthread_mutex_unlock(&kept_mu);
        munmap(base, size);
        close(fd);
        return;
    }
    for (int i = 0; i < nkept; i++)
        if (kept[i].dev == st.st_dev && kept[i].ino == st.st_ino) { /* an older one */
            gone = kept[i];
            memmove(&kept[i], &kept[i + 1], sizeof(kept_t) * (size_t)(nkept - i - 1));
            nkept--;
            break;
        }
    if (gone.base == NULL && nkept == KEPT_MAX) { /* the oldest goes */
        gone = kept[0];
        memmove(&kept[0], &kept[1], sizeof(kept_t) * (KEPT_MAX - 1));
        nkept--;
    }
    kept[nkept].dev = st.st_dev;
    kept[nkept].ino = st.st_ino;
    kept[nkept].base = base;
    kept[nkept].size = size;
    kept[nkept].fd = fd;
    nkept++;
    kept_kept++;
    pthread_mutex_unlock(&kept_mu);
    if (gone.base != NULL)
        kept_close(&gone);
}

static int kept_has(dev_t dev, ino_t ino) {
    int found = 0;
    pthread_mutex_lock(&kept_mu);
    if (kept_pid == getpid())
        for (int i = 0; i < nkept && !found; i++)
            found = kept[i].dev == dev && kept[i].ino == ino;
    pthread_mutex_unlock(&kept_mu);
    return found;
}

/* the kept mapping of the file (dev, ino), handed over cut to its first size bytes
 * (the file may have been cut shorter: nothing past size may stay mapped); NULL where
 * none covers size */
static char *kept_take(dev_t dev, ino_t ino, size_t size, int *fd) {
    kept_t got = {0, 0, NULL, 0, -1};
    pthread_mutex_lock(&kept_mu);
    kept_prune_locked();
    for (int i = 0; i < nkept; i++)
        if (kept[i].dev == dev && kept[i].ino == ino) {
            got = kept[i];
            memmove(&kept[i], &kept[i + 1], sizeof(kept_t) * (size_t)(nkept - i - 1));
            nkept--;
            break;
        }
    if (got.base != NULL && got.size >= size)
        kept_reused++;
    pthread_mutex_unlock(&kept_mu);
    if (got.base == NULL)
        return NULL;
    if (got.size < size) {
        kept_close(&got);
        return NULL;
    }
    size_t keep = (size + PAGE - 1) / PAGE * PAGE, all = (got.size + PAGE - 1) / PAGE * PAGE;
    if (all > keep)
        munmap(got.base + keep, all - keep);
    *fd = got.fd;
    return got.base;
}

/* a file of the store's pool of freed files, renamed to path: one this process still
 * maps (kept_t) first, else the smallest of at least min bytes (its pages are allocated
 * already, so the slab costs page-table entries, not page faults). The pool's protocol
 * (storage_engine._pool): a file is moved only under an exclusive flock, and only while
 * its name still names the locked file. Returns its size (>= min), 0 when the pool has
 * none; *map the kept mapping of its first `use` bytes (the slab's; *map_fd its file),
 * NULL when there is none. */
static size_t claim_pooled(Idx *s, const char *path, size_t min, size_t max,
                           uint64_t csize, char **map, int *map_fd) {
    *map = NULL;
    if (s->pool_dir == NULL)
        return 0;
    DIR *d = opendir(s->pool_dir);
    if (d == NULL)
        return 0;
    char best[4096], cand[4096];
    size_t best_size = 0;
    int best_kept = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (e->d_name[0] == '.')
            continue;
        snprintf(cand, sizeof cand, "%s/%s", s->pool_dir, e->d_name);
        struct stat st;
        if (stat(cand, &st) != 0 || !S_ISREG(st.st_mode) || (size_t)st.st_size < min ||
                (size_t)st.st_blocks * 512 < min / 2)
            continue;
        int k = kept_has(st.st_dev, st.st_ino);
        if (best_size == 0 || k > best_kept ||
                (k == best_kept && (size_t)st.st_size < best_size)) {
            best_size = (size_t)st.st_size;
            best_kept = k;
            memcpy(best, cand, sizeof best);
        }
    }
    closedir(d);
    if (best_size == 0)
        return 0;
    int fd = open(best, O_RDWR | O_CLOEXEC);
    if (fd < 0)
        return 0;
    struct stat a, b;
    if (flock(fd, LOCK_EX | LOCK_NB) != 0 || fstat(fd, &a) != 0 || stat(best, &b) != 0 ||
            a.st_ino != b.st_ino || a.st_dev != b.st_dev || rename(best, path) != 0) {
        close(fd);
        return 0;
    }
    size_t size = best_size < max ? best_size : max;
    /* its pages are there (a walk of them to allocate none cost 3 ms per 64 MiB) */
    int whole = fstat(fd, &a) == 0 && (size_t)a.st_blocks * 512 >= size;
    if (ftruncate(fd, (off_t)size) != 0 || (!whole && posix_fallocate(fd, 0, (off_t)size))) {
        close(fd);
        unlink(path);
        return 0;
    }
    fchmod(fd, 0600);
    close(fd); /* and its lock: the file is the slab's now */
    if (best_kept)
        *map = kept_take(a.st_dev, a.st_ino, size / csize * csize, map_fd);
    return size;
}

/* a new slab of chunks of csize where the capacity allows: 1, 0 (no room), -1 (error) */
/* a slab of metadata chunks: beside the arena, not counted in its capacity (a block's
 * metadata past its record takes at most one chunk, and lives as long as the block);
 * 1, or -1 (errno) */
/* a slot of the slab table for a new slab: an unused one, the next, or MAX_SLABS */
static uint32_t free_slab_slot(hdr_t *h) {
    for (uint32_t i = 0; i < h->nslabs; i++)
        if (!h->slabs[i].live)
            return i;
    return h->nslabs < MAX_SLABS ? h->nslabs : MAX_SLABS;
}

/* a new slab of n chunks of csize in its table slot, its file made */
static void init_slab(hdr_t *h, uint32_t slot, uint64_t csize, uint64_t n, int fresh,
                      int meta) {
    slab_t *sl = &h->slabs[slot];
    sl->csize = csize;
    sl->nchunks = (uint32_t)n;
    sl->used = sl->bump = sl->free_head = 0;
    sl->gen++;
    sl->live = 1;
    sl->fresh = (uint32_t)fresh;
    sl->meta = (uint32_t)meta;
    if (slot == h->nslabs)
        h->nslabs++;
    h->count[meta ? C_META_BYTES : C_ARENA_BYTES] += csize * n;
}

static int new_meta_slab(Idx *s, uint64_t csize) {
    hdr_t *h = s->hdr;
    uint64_t n = (256u << 10) / csize;
    if (n < 1)
        n = 1;
    uint32_t slot = free_slab_slot(h);
    if (slot == MAX_SLABS) {
        errno = ENOSPC;
        return -1;
    }
    char path[4096];
    slab_path(s, slot, h->slabs[slot].gen + 1, path, sizeof path);
    int fd = create_file(path, (size_t)(csize * n));
    if (fd < 0)
        return -1;
    close(fd);
    init_slab(h, slot, csize, n, 1, 1);
    return 1;
}

/* a chunk for a block's metadata: E_OK, E_NOSPACE, E_IO */
static int allocate_meta(Idx *s, uint64_t csize, uint32_t *slot, uint32_t *chunk) {
    int untouched;
    uint32_t hint = s->hint;
    for (int tries = 0; tries < 2; tries++) {
        int r = take_free(s, csize, slot, chunk, &untouched, 1);
        if (r > 0) {
            s->hint = hint; /* the hint is the data slabs' */
            return E_OK;
        }
        if (r < 0)
            return E_IO;
        if (tries == 0 && new_meta_slab(s, csize) < 0)
            return errno == ENOSPC || errno == EDQUOT || errno == EFBIG ? E_NOSPACE : E_IO;
    }
    return E_IO;
}

static int new_slab(Idx *s, uint64_t csize) {
    hdr_t *h = s->hdr;
    uint64_t used = h->count[C_ARENA_BYTES];
    if (used >= h->capacity)
        return 0;
    /* slabs of at least 1/1024 of the capacity, so that the table never runs out */
    uint64_t want = h->slab_bytes > h->capacity / 1024 ? h->slab_bytes : h->capacity / 1024;
    uint64_t n = want / csize;
    if (n < 1)
        n = 1;
    if (n > (h->capacity - used) / csize)
        n = (h->capacity - used) / csize;
    if (n < 1)
        return 0;
    uint32_t slot = free_slab_slot(h);
    if (slot == MAX_SLABS)
        return 0;
    uint32_t gen = h->slabs[slot].gen + 1;
    char path[4096];
    slab_path(s, slot, gen, path, sizeof path);
    /* a pooled file first: as many chunks as it holds, within what the capacity allows */
    uint64_t most = (h->capacity - used) / csize;
    char *kept_map = NULL;
    int kept_fd = -1;
    size_t got = claim_pooled(s, path, (size_t)(csize * n), (size_t)(csize * most), csize,
                              &kept_map, &kept_fd);
    int fresh = got == 0;
    if (got) {
        n = got / csize;
        if (kept_map != NULL) { /* this process's mapping of the file: nothing to map */
            unmap_slab(s, slot);
            s->maps[slot].base = kept_map;
            s->maps[slot].size = (size_t)(csize * n);
            s->maps[slot].gen = gen;
            s->maps[slot].fd = kept_fd;
        }
    } else {
        int fd = create_file(path, (size_t)(csize * n));
        if (fd < 0)
            return -1;
        close(fd);
    }
    init_slab(h, slot, csize, n, fresh, 0);
    return 1;
}

static int drop_empty_slab(Idx *s, uint64_t keep) {
    hdr_t *h = s->hdr;
    for (uint32_t i = 0; i < h->nslabs; i++) {
        slab_t *sl = &h->slabs[i];
        if (sl->live && sl->used == 0 && sl->csize != keep && !sl->meta) {
            char path[4096];
            slab_path(s, i, sl->gen, path, sizeof path);
            unmap_slab(s, i);
            unlink(path); /* readers' mappings keep their pages */
            h->count[C_ARENA_BYTES] -= sl->csize * sl->nchunks;
            h->count[C_SLAB_DROPS]++;
            sl->live = 0;
            return 1;
        }
    }
    return 0;
}

/* ---------------------------------------------------------------------------------- */
/* spill files */

static void spill_file(Idx *s, const uint8_t *key, size_t klen, uint64_t seq, char *out,
                       size_t n) {
    char hex[2 * KEYMAX + 1];
    if (klen > KEYMAX) /* a record's klen is a shared byte: rec_check flags it */
        klen = KEYMAX;
    for (size_t i = 0; i < klen; i++)
        snprintf(hex + 2 * i, 3, "%02x", key[i]);
    hex[2 * klen] = 0;
    snprintf(out, n, "%s/%s-%llx.blk", s->disk_root, hex, (unsigned long long)seq);
}

static void spill_path(Idx *s, rec_t *r, char *out, size_t n) {
    spill_file(s, r->key, r->klen, ((uint64_t)r->slab << 32) | r->chunk, out, n);
}

/* read a spilled block's file into dst: 0, or -1 (missing or short) */
static int read_spill(const char *path, char *dst, uint64_t nbytes) {
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

static void note_left(Idx *s, rec_t *r) {
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

static void meta_free(Idx *s, rec_t *r) {
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
static const uint8_t *rec_meta(Idx *s, rec_t *r, uint32_t *len, uint8_t **owned) {
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
static void drop_disk(Idx *s, uint32_t i, int forget) {
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
static int spill_write(const char *path, const char *src, uint64_t n, const uint8_t *meta,
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
static int spill(Idx *s, uint32_t i) {
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

/* Spills written outside the lock. A batch that will evict (its blocks need more room
 * than the arena has free) picks its victims first, under the lock, and holds each by
 * this process's reader bit (so that nothing evicts, rewrites or frees its chunk; a
 * read still serves it from the arena; a delete parks it as a zombie), lets the lock go,
 * writes their files, and takes the lock again to make each a spilled block: only where
 * nothing else came to hold it meanwhile (another reader, a pin, a delete), else its file
 * is removed and the block stays. A lookup then never waits behind a spill's write. */
static int64_t victim(Idx *s);

typedef struct {
    uint32_t idx, gen;
    uint64_t seq, nbytes;
    const char *src;
    uint8_t *meta; /* a copy */
    uint32_t mlen;
    int want_meta;
    char path[4096];
} pspill_t;

/* the room the arena has for chunks of the classes cls (free chunks of their slabs, and
 * capacity for new slabs) */
static uint64_t room_for(Idx *s, const uint64_t *cls, int ncls) {
    hdr_t *h = s->hdr;
    uint64_t room = h->capacity > h->count[C_ARENA_BYTES] ? h->capacity - h->count[C_ARENA_BYTES]
                                                          : 0;
    for (uint32_t k = 0; k < h->nslabs; k++) {
        slab_t *sl = &h->slabs[k];
        if (!sl->live || sl->meta || sl->used > sl->nchunks)
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
static Py_ssize_t prespill_pick(Idx *s, uint64_t need, pspill_t *out, Py_ssize_t max) {
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
static void prespill_commit(Idx *s, pspill_t *ps, Py_ssize_t n, const uint8_t *ok) {
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

/* a host record leaves the store (deleted, dropped as corrupt, evicted with no spill):
 * its chunk is freed, or parked with the record while someone reads it */
static void remove_host(Idx *s, uint32_t i) {
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

static inline int evictable(rec_t *r) {
    return r->state == S_HOST && r->pins == 0 && r->readers == 0;
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
static int64_t victim(Idx *s) {
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

static void on_insert(Idx *s, uint32_t i, int was_ghost) {
    rec_t *r = R(s, i);
    r->freq = 0;
    if (r->pins)
        return; /* pinned blocks stay out of the queues until unpinned */
    q_push(s, s->hdr->eviction == EV_S3FIFO && was_ghost ? Q_MAIN : Q_SMALL, i);
}

static void on_access(Idx *s, uint32_t i) {
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
static uint64_t reclaim_dead(Idx *s) {
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
static int allocate(Idx *s, uint64_t csize, uint32_t *slot, uint32_t *chunk, int *reclaimed,
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
    if (h->table_gen != s->table_gen || h->bump > s->ncap || h->free_rec > h->bump ||
            h->nrecs > h->bump)
        return damaged(s, "index.kvx", "table generation %u (mapped: %u, of %llu records), "
                       "%llu made, free from %llu, %llu in use", h->table_gen, s->table_gen,
                       (unsigned long long)s->ncap, (unsigned long long)h->bump,
                       (unsigned long long)h->free_rec, (unsigned long long)h->nrecs);
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
static int lock(Idx *s) {
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
    if (s->table_gen != h->table_gen || s->table == NULL) {
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

static void unlock(Idx *s) { pthread_mutex_unlock(&s->hdr->lock); }

/* everything derivable from the records, after a process died holding the lock */
static void rebuild(Idx *s) {
    hdr_t *h = s->hdr;
    memset(s->buckets, 0, s->nb * 8); /* the mapped table's: its own header's size */
    { /* a growth's holder killed before it removed the old file, or before it named
       * the new one */
        char other[4096];
        if (h->table_gen > 1) {
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
        if (h->slabs[k].live && !slab_ok(h, &h->slabs[k])) {
            slab_damaged(s, k);
            return;
        }
    for (uint32_t k = 0; k < h->nslabs; k++)
        if (h->slabs[k].live)
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
                (holds && (r->slab >= h->nslabs || !h->slabs[r->slab].live ||
                           r->chunk >= h->slabs[r->slab].nchunks))) {
            r->state = S_FREE;
            r->next = (uint32_t)h->free_rec;
            h->free_rec = i + 1;
            r->gen++;
            continue;
        }
        h->nrecs++;
        if (holds && used[r->slab])
            used[r->slab][r->chunk / 8] |= (uint8_t)(1 << (r->chunk % 8));
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
            q_push(s, Q_DISK, i);
        } else if (r->state == S_GHOST) {
            q_push(s, Q_GHOST, i);
        }
    }
    for (uint32_t k = 0; k < h->nslabs; k++) {
        slab_t *sl = &h->slabs[k];
        if (!sl->live || used[k] == NULL)
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

typedef struct {
    uint8_t (*keys)[KEYMAX + 1]; /* [0]: length */
    Py_ssize_t n;
} keyset_t;

static int parse_keys(PyObject *seq, keyset_t *ks) {
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

static void free_keys(keyset_t *ks) { PyMem_Free(ks->keys); }

static int u64_buffer(PyObject *obj, Py_buffer *b, Py_ssize_t n, const char *what) {
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
static int parse_batch(PyObject *keys_o, PyObject *addrs_o, PyObject *sizes_o,
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

static int usable(Idx *s) {
    if (s->hdr == NULL) {
        PyErr_SetString(PyExc_ValueError, "the block index is closed");
        return 0;
    }
    return 1;
}

/* a step that failed: its damage, or its errno (never an OSError of errno 0) */
static PyObject *lock_error(Idx *s) {
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
        h->table_gen = 1;
        char tpath[4096];
        table_path(s, 1, tpath, sizeof tpath);
        int t = create_table(tpath, 1, INITIAL_RECS * 2, INITIAL_RECS);
        if (t < 0) {
            munmap(h, sizeof *h);
            close(tfd);
            unlink(tmp);
            PyErr_SetFromErrnoWithFilename(PyExc_OSError, tpath);
            return -1;
        }
        close(t);
        h->version = KV_VERSION;
        h->magic = KV_MAGIC;
        h->ready = 1;
        munmap(h, sizeof *h);
        if (link(tmp, path) == 0)
            created = 1;
        else
            unlink(tpath); /* another process made it first: use theirs */
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
    if (s->table != NULL)
        munmap(s->table, s->table_size);
    munmap(s->hdr, sizeof(hdr_t));
    s->hdr = NULL;
    s->table = NULL;
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
        if (s->table != NULL)
            munmap(s->table, s->table_size);
        munmap(s->hdr, sizeof(hdr_t));
    }
    s->hdr = NULL;
    s->table = NULL;
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

/* the address of a batch entry's chunk, under the lock after slab_check: 0, or -1 (the
 * chunk lies outside the mapping: damage) */
static int res_at(Idx *s, res_t *r, uint64_t nbytes) {
    smap_t *m = &s->maps[r->slab];
    uint64_t cs = s->hdr->slabs[r->slab].csize;
    uint64_t off = (uint64_t)r->chunk * cs;
    if (m->base == NULL || nbytes > cs || off > m->size || m->size - off < cs)
        return damaged(s, "index.kvx", "slab %u: chunk %u of %llu bytes lies outside its "
                       "%zu-byte file", r->slab, r->chunk, (unsigned long long)cs, m->size);
    r->at = m->base + off;
    r->csize = cs;
    return 0;
}

/* the copies of a batch step, outside the lock and the GIL: on two threads (or as many
 * as the host has, at most four) when the batch is large enough to repay starting them
 * (one core copies and hashes at about half the memory bus's rate) */
#define PARALLEL_MIN (4u << 20)
enum { CP_PUT = 0, CP_READ = 1, CP_READ_NOVERIFY = 2 };

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

static void copy_range(copy_job_t *j) {
    Idx *s = j->s;
    void *state = xxh_state_new();
    for (Py_ssize_t k = j->lo; k < j->hi; k++) {
        res_t *r = &j->res[k];
        Py_ssize_t i = r->i;
        char *ext = (char *)(uintptr_t)j->addrs[i];
        uint64_t n = j->sizes[i];
        if (j->mode != CP_PUT && r->untouched == 2) { /* a spilled block: from its file */
            char path[4096];
            spill_file(s, j->keys[i] + 1, j->keys[i][0],
                       ((uint64_t)r->slab << 32) | r->chunk, path, sizeof path);
            if (read_spill(path, ext, n) < 0)
                j->sums[k] = ~j->want[k]; /* missing or short: corrupt, if it did not move */
            else
                j->sums[k] = j->mode == CP_READ && state != NULL ? hash_only(state, ext, n)
                                                                  : j->want[k];
            continue;
        }
        char *chunk = r->at;
        if (j->mode == CP_PUT)
            j->sums[k] = state != NULL ? copy_hash_one(state, chunk, ext, n, j->stream_min) : 0;
        else if (j->mode == CP_READ)
            j->sums[k] = state != NULL ? copy_hash_one(state, ext, chunk, n, j->stream_min)
                                       : ~j->want[k];
        else
            stream_copy(ext, chunk, n, j->stream_min);
    }
    fence();
    if (state != NULL)
        xxh_state_free(state);
}

static void *copy_thread(void *arg) {
    copy_range((copy_job_t *)arg);
    return NULL;
}

/* The copy workers: threads of this process that wait for a batch's runs, started at
 * the first batch that wants them and kept (a thread started and joined per batch,
 * and the faults of its fresh stack, cost 50-100 us a batch). One batch at a time uses
 * them; a batch that finds them busy (another thread's, copying at once) starts
 * threads of its own as before. A forked child starts its own. */
#define MAX_WORKERS 3
typedef struct {
    pthread_t tid;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    copy_job_t *job; /* the run to copy; NULL when idle */
    int done;
} worker_t;
static worker_t workers[MAX_WORKERS];
static int nworkers;
static long ncpus;
static pthread_mutex_t workers_mu = PTHREAD_MUTEX_INITIALIZER; /* held while in use */

static void *worker_main(void *arg) {
    worker_t *w = arg;
    pthread_mutex_lock(&w->mu);
    for (;;) {
        while (w->job == NULL)
            pthread_cond_wait(&w->cv, &w->mu);
        copy_job_t *j = w->job;
        pthread_mutex_unlock(&w->mu);
        copy_range(j);
        pthread_mutex_lock(&w->mu);
        w->job = NULL;
        w->done = 1;
        pthread_cond_broadcast(&w->cv);
    }
    return NULL;
}

/* under workers_mu: at least `want` workers (fewer where threads cannot be had) */
static int workers_ready(int want) {
    while (nworkers < want) {
        worker_t *w = &workers[nworkers];
        pthread_mutex_init(&w->mu, NULL);
        pthread_cond_init(&w->cv, NULL);
        w->job = NULL;
        w->done = 0;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int r = pthread_create(&w->tid, &attr, worker_main, w);
        pthread_attr_destroy(&attr);
        if (r != 0)
            break;
        nworkers++;
    }
    return nworkers < want ? nworkers : want;
}

static void workers_atfork_child(void) {
    /* the parent's workers do not exist here */
    nworkers = 0;
    pthread_mutex_init(&workers_mu, NULL);
}

static void copy_all(copy_job_t job, Py_ssize_t n) {
    if (n <= 0)
        return;
    uint64_t total = 0;
    for (Py_ssize_t k = 0; k < n; k++)
        total += job.sizes[job.res[k].i];
    job.stream_min = total >= STREAM_BATCH ? STREAM_BLOCK_MIN : STREAM_MIN;
    long cpus = ncpus;
    int t = total < PARALLEL_MIN || n < 2 ? 1 : (int)(cpus < 2 ? 1 : cpus > 4 ? 4 : cpus);
    if (t > n)
        t = (int)n;
    copy_job_t jobs[4];
    pthread_t tid[4];
    int started[4] = {0, 0, 0, 0};
    /* runs of the batch of about equal bytes, one a thread */
    Py_ssize_t lo = 0;
    uint64_t acc = 0;
    for (int w = 0; w < t; w++) {
        Py_ssize_t hi = lo;
        uint64_t goal = total * (uint64_t)(w + 1) / (uint64_t)t;
        while (hi < n && (w == t - 1 || acc < goal))
            acc += job.sizes[job.res[hi++].i];
        jobs[w] = job;
        jobs[w].lo = lo;
        jobs[w].hi = hi;
        lo = hi;
    }
    if (t == 1) {
        copy_range(&jobs[0]);
        return;
    }
    int pooled = pthread_mutex_trylock(&workers_mu) == 0;
    int have = pooled ? workers_ready(t - 1) : 0;
    for (int w = 1; w < t; w++) {
        if (w - 1 < have) {
            worker_t *k = &workers[w - 1];
            pthread_mutex_lock(&k->mu);
            k->done = 0;
            k->job = &jobs[w];
            pthread_cond_broadcast(&k->cv);
            pthread_mutex_unlock(&k->mu);
        } else {
            started[w] = pthread_create(&tid[w], NULL, copy_thread, &jobs[w]) == 0;
        }
    }
    copy_range(&jobs[0]);
    for (int w = 1; w < t; w++) {
        if (w - 1 < have) {
            worker_t *k = &workers[w - 1];
            pthread_mutex_lock(&k->mu);
            while (!k->done)
                pthread_cond_wait(&k->cv, &k->mu);
            pthread_mutex_unlock(&k->mu);
        } else if (started[w]) {
            pthread_join(tid[w], NULL);
        } else {
            copy_range(&jobs[w]); /* no thread to be had: here */
        }
    }
    if (pooled)
        pthread_mutex_unlock(&workers_mu);
}

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
/* under the lock, before a batch's reservations: the spills the batch will cause,
 * written outside the lock (see pspill_t), in rounds of PRESPILL_ROUND victims. 0, or
 * -1 (the lock could not be taken again: damage, unlocked) */
#define PRESPILL_ROUND 64
static int prespill(Idx *s, const keyset_t *ks, const uint64_t *sizes) {
    uint64_t cls[8], want = 0;
    int ncls = 0;
    for (Py_ssize_t i = 0; i < ks->n; i++) {
        int64_t f = h_find(s, ks->keys[i] + 1, ks->keys[i][0]);
        if (f >= 0 && R(s, (uint32_t)f)->state != S_GHOST)
            continue; /* present, or being written: no room taken */
        uint64_t c = size_class(sizes[i]);
        want += c;
        int k = 0;
        while (k < ncls && cls[k] != c)
            k++;
        if (k == ncls && ncls < 8)
            cls[ncls++] = c;
    }
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

static PyObject *Idx_put(Idx *s, PyObject *args) {
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
    if (s->disk_root != NULL && n > 0 && prespill(s, &ks, sizes) < 0) {
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
            if (h_insert_raw(s->buckets, s->nb, khash(h, r->key, r->klen),
                             (uint32_t)f) < 0) {
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

static inline int readable(rec_t *r) { return r->state == S_HOST || r->state == S_DISK; }

static PyObject *Idx_match(Idx *s, PyObject *keys_o) {
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
        for (; n < ks.n; n++) {
            int64_t f = h_find(s, ks.keys[n] + 1, ks.keys[n][0]);
            if (f < 0 || !readable(R(s, (uint32_t)f)))
                break;
        }
        unlock(s);
    }
    Py_END_ALLOW_THREADS
    free_keys(&ks);
    if (r < 0 || s->dmg)
        return lock_error(s);
    return PyLong_FromSsize_t(n);
}

static PyObject *Idx_contains(Idx *s, PyObject *keys_o) {
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
    int r;
    Py_BEGIN_ALLOW_THREADS
    r = lock(s);
    if (r == 0) {
        for (Py_ssize_t i = 0; i < ks.n; i++) {
            int64_t f = h_find(s, ks.keys[i] + 1, ks.keys[i][0]);
            o[i] = f >= 0 && readable(R(s, (uint32_t)f));
        }
        unlock(s);
    }
    Py_END_ALLOW_THREADS
    free_keys(&ks);
    if (r < 0 || s->dmg) {
        Py_DECREF(out);
        return lock_error(s);
    }
    return out;
}

/* a spilled block back into the arena (under the lock): 1 now HOST, 0 no spill here,
 * -2 no room in the arena (it stays on disk), -1 corrupt or missing (dropped) */
static int promote(Idx *s, uint32_t i, void *state, int *reclaimed) {
    hdr_t *h = s->hdr;
    rec_t *r = R(s, i);
    if (s->disk_root == NULL)
        return 0;
    uint32_t slot, chunk, mslab = 0, mchunk = 0;
    /* allocation may evict (and spill) others, never this record: it is not HOST, and
     * out of the disk queue meanwhile, so a trim of the disk cannot drop it */
    q_remove(s, i);
    if (allocate(s, size_class(r->nbytes), &slot, &chunk, reclaimed, NULL) != E_OK) {
        q_push(s, Q_DISK, i);
        return -2;
    }
    r = R(s, i);
    char path[4096];
    spill_path(s, r, path, sizeof path);
    char *base = slab_base(s, slot);
    int ok = 0;
    if (base != NULL) {
        char *dst = base + (size_t)chunk * h->slabs[slot].csize;
        ok = read_spill(path, dst, r->nbytes) == 0 &&
             hash_only(state, dst, r->nbytes) == r->csum;
    }
    if (!ok) {
        release_chunk(s, slot, chunk);
        drop_disk(s, i, 1);
        h->count[C_CORRUPT]++;
        return -1;
    }
    if (r->meta_len > INLINE_META) { /* its metadata back into the arena */
        uint32_t ms, mc;
        if (allocate_meta(s, size_class(r->meta_len), &ms, &mc) != E_OK) {
            release_chunk(s, slot, chunk);
            q_push(s, Q_DISK, i);
            return -2;
        }
        r = R(s, i);
        char *mb = slab_base(s, ms);
        int fd = open(path, O_RDONLY | O_CLOEXEC);
        ssize_t got = fd >= 0 && mb != NULL
            ? pread(fd, mb + (size_t)mc * h->slabs[ms].csize, r->meta_len, (off_t)r->nbytes)
            : -1;
        if (fd >= 0)
            close(fd);
        if (got != (ssize_t)r->meta_len) {
            release_chunk(s, ms, mc);
            release_chunk(s, slot, chunk);
            drop_disk(s, i, 1);
            h->count[C_CORRUPT]++;
            return -1;
        }
        mslab = ms;
        mchunk = mc;
    }
    FAULT("promote.read");
    ev_rec(s, EVT_REMOVED, MED_STORAGE, i);
    unlink(path);
    h->count[C_DISK_BLOCKS]--;
    h->count[C_DISK_BYTES] -= r->nbytes;
    /* the record names its chunks with the state that says so (see spill) */
    if (r->meta_len > INLINE_META) {
        r->mslab = mslab;
        r->mchunk = mchunk;
    }
    r->slab = slot;
    r->chunk = chunk;
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

static PyObject *Idx_read_into(Idx *s, PyObject *args) {
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
 * has no room to bring it back: every block in it is pinned or being read) or
 * (idx, gen, slab, slab_gen, offset, nbytes, csum, meta): a read lease on each present
 * block (this process's bit in its record) for a zero-copy view, given back by release */
typedef struct {
    uint32_t idx, gen, slab, slab_gen;
    uint64_t offset, nbytes, csum;
    size_t meta_at, meta_len;
    int status; /* 1 leased, 0 absent, -1 corrupt */
} leased_t;

static PyObject *Idx_lease(Idx *s, PyObject *keys_o) {
    if (!usable(s))
        return NULL;
    keyset_t ks;
    if (parse_keys(keys_o, &ks) < 0)
        return NULL;
    Py_ssize_t n = ks.n;
    leased_t *ls = PyMem_Calloc((size_t)(n ? n : 1), sizeof(leased_t));
    void *state = xxh_state_new();
    PyObject *out = NULL;
    char *metas = NULL;
    size_t mused = 0, mcap = 0;
    int r = 0, oom = 0;
    if (ls == NULL || state == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    r = lock(s);
    if (r == 0) {
        hdr_t *h = s->hdr;
        int reclaimed = 0;
        Py_ssize_t hits = 0;
        uint64_t bit = 1ULL << s->slot;
        uint32_t checked = UINT32_MAX;
        for (Py_ssize_t i = 0; i < n && !oom && !s->dmg; i++) {
            int64_t f = h_find(s, ks.keys[i] + 1, ks.keys[i][0]);
            if (f < 0 || !readable(R(s, (uint32_t)f)) || rec_check(s, (uint32_t)f) < 0)
                continue;
            rec_t *rr = R(s, (uint32_t)f);
            if (rr->state == S_DISK) {
                int p = promote(s, (uint32_t)f, state, &reclaimed);
                if (p < 0)
                    ls[i].status = p == -2 ? -2 : -1;
                if (p <= 0)
                    continue;
                rr = R(s, (uint32_t)f);
            }
            if (rr->state != S_HOST || (rr->slab != checked && slab_check(s, rr->slab) < 0))
                continue;
            checked = rr->slab;
            const char *mp = (const char *)rr->meta;
            if (rr->meta_len > INLINE_META)
                mp = s->maps[rr->mslab].base != NULL || slab_base(s, rr->mslab) != NULL
                         ? s->maps[rr->mslab].base + (size_t)rr->mchunk * h->slabs[rr->mslab].csize
                         : NULL;
            if (mused + rr->meta_len > mcap) {
                size_t cap = (mcap + rr->meta_len) * 2 + 256;
                char *m = realloc(metas, cap);
                if (m == NULL) {
                    oom = 1;
                    break;
                }
                metas = m;
                mcap = cap;
            }
            leased_t *l = &ls[i];
            l->meta_at = mused;
            l->meta_len = mp != NULL ? rr->meta_len : 0;
            if (mp != NULL && rr->meta_len) /* metas is NULL until the first meta */
                memcpy(metas + mused, mp, rr->meta_len);
            mused += l->meta_len;
            slab_t *sl = &h->slabs[rr->slab];
            l->idx = (uint32_t)f;
            l->gen = rr->gen;
            l->slab = rr->slab;
            l->slab_gen = sl->gen;
            l->offset = (uint64_t)rr->chunk * sl->csize;
            l->nbytes = rr->nbytes;
            l->csum = rr->csum;
            l->status = 1;
            rr->readers |= bit;
            on_access(s, (uint32_t)f);
            hits++;
        }
        if (oom || s->dmg) /* give the leases back */
            for (Py_ssize_t i = 0; i < n; i++)
                if (ls[i].status == 1)
                    R(s, ls[i].idx)->readers &= ~bit;
        h->count[C_HITS] += (uint64_t)hits;
        h->count[C_MISSES] += (uint64_t)(n - hits);
        unlock(s);
    }
    Py_END_ALLOW_THREADS
    if (r < 0 || s->dmg) {
        lock_error(s);
        goto done;
    }
    if (oom) {
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
                                 metas != NULL ? metas + l->meta_at : "",
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
    free(metas);
    if (state != NULL)
        xxh_state_free(state);
    free_keys(&ks);
    return out;
}

/* release(idxs, gens): this process lets go of its leases (its last view of each) */
static PyObject *Idx_release(Idx *s, PyObject *args) {
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
static PyObject *Idx_drop_corrupt(Idx *s, PyObject *args) {
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

static PyObject *Idx_pin(Idx *s, PyObject *args) {
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
    Py_BEGIN_ALLOW_THREADS
    r = lock(s);
    if (r == 0) {
        hdr_t *h = s->hdr;
        int reclaimed = 0;
        for (Py_ssize_t i = 0; i < ks.n && !s->dmg; i++) {
            int64_t f = h_find(s, ks.keys[i] + 1, ks.keys[i][0]);
            if (f < 0 || rec_check(s, (uint32_t)f) < 0)
                continue;
            rec_t *rr = R(s, (uint32_t)f);
            if (rr->state == S_DISK && delta > 0 && state != NULL)
                promote(s, (uint32_t)f, state, &reclaimed); /* pinned: in memory if it fits */
            f = h_find(s, ks.keys[i] + 1, ks.keys[i][0]);
            if (f < 0 || s->dmg)
                continue;
            rr = R(s, (uint32_t)f);
            if (!readable(rr) || (int64_t)rr->pins + delta < 0)
                continue;
            uint32_t before = rr->pins;
            rr->pins = (uint32_t)((int64_t)rr->pins + delta);
            if (before == 0 && rr->pins > 0) {
                h->count[C_PINNED]++;
                if (rr->state == S_HOST)
                    q_remove(s, (uint32_t)f);
            } else if (before > 0 && rr->pins == 0) {
                h->count[C_PINNED]--;
                if (rr->state == S_HOST)
                    q_push(s, Q_SMALL, (uint32_t)f);
            }
            changed++;
        }
        unlock(s);
    }
    Py_END_ALLOW_THREADS
    if (state != NULL)
        xxh_state_free(state);
    free_keys(&ks);
    if (r < 0 || s->dmg)
        return lock_error(s);
    return PyLong_FromSsize_t(changed);
}

static PyObject *Idx_delete(Idx *s, PyObject *keys_o) {
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


static void ev_path(Idx *s, char *out, size_t n) { snprintf(out, n, "%s/events.kvx", s->root); }

/* the ring, mapped in this process (under the lock): 0, or -1 */
static int ev_map(Idx *s) {
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

static inline uint64_t ev_bytes(uint32_t klen, uint32_t mlen) {
    return ((uint64_t)sizeof(evh_t) + klen + mlen + 7) & ~7ULL;
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
static void ev_put(Idx *s, int type, int medium, const uint8_t *key, uint32_t klen,
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
static void ev_rec(Idx *s, int type, int medium, uint32_t i) {
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
static PyObject *Idx_events_claim(Idx *s, PyObject *unused) {
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
static PyObject *Idx_events_read(Idx *s, PyObject *args) {
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

/* events_wire(pos, max_events, seq, stored_head, removed_head, tail_host, tail_disk,
 * no_info) -> None (this process no longer publishes), or (events, count, pos, lost,
 * overrun, cleared): events_read's events spliced into their wire bytes, a msgpack array
 * of count events (at most max_events), each the head of its kind, its hashes (the
 * msgpack array its info keeps, or [key]), for a stored event the rest of its fields
 * (from its info, or no_info), and the tail of its medium. The pieces are the caller's
 * (tensordb.client._kv_events): this code only splices them. cleared: a cleared event
 * was read (announce the store afresh: events_claim). */
static PyObject *Idx_events_wire(Idx *s, PyObject *args) {
    unsigned long long pos, max_events, seq;
    Py_buffer heads[2], tails[2], noinfo;
    if (!PyArg_ParseTuple(args, "KKKy*y*y*y*y*", &pos, &max_events, &seq, &heads[0],
                          &heads[1], &tails[0], &tails[1], &noinfo))
        return NULL;
    PyObject *out = NULL;
    evbuf_t b = {NULL, 0, 0}, o = {NULL, 0, 0};
    int r = -1, mine = 0, overrun = 0, err = 0, cleared = 0;
    uint64_t at = pos, lost = 0, count = 0;
    if (!usable(s))
        goto done;
    Py_BEGIN_ALLOW_THREADS
    r = lock(s);
    if (r == 0) {
        mine = ev_take(s, &at, seq, SIZE_MAX, max_events, &b, &lost, &overrun);
        unlock(s);
    }
    err = mine < 0;
    /* the splice, outside the lock: the array's length first */
    for (size_t k = 0; r == 0 && mine > 0 && k + sizeof(evh_t) <= b.len;) {
        evh_t e;
        memcpy(&e, b.p + k, sizeof e);
        k += e.len;
        count += e.type == EVT_STORED || e.type == EVT_REMOVED;
        cleared |= e.type == EVT_CLEARED;
    }
    uint8_t hdr[3] = {(uint8_t)(0x90 | count), 0, 0};
    size_t hn = 1;
    if (count >= 16) {
        hdr[0] = 0xdc;
        hdr[1] = (uint8_t)(count >> 8);
        hdr[2] = (uint8_t)count;
        hn = 3;
    }
    if (r == 0 && mine > 0 && evbuf_add(&o, hdr, hn) < 0)
        err = 1;
    for (size_t k = 0; r == 0 && mine > 0 && !err && k + sizeof(evh_t) <= b.len;) {
        evh_t e;
        memcpy(&e, b.p + k, sizeof e);
        const uint8_t *key = (const uint8_t *)b.p + k + sizeof e, *meta = key + e.klen;
        k += e.len;
        if (e.type != EVT_STORED && e.type != EVT_REMOVED)
            continue;
        const uint8_t *hashes = NULL, *rest = (const uint8_t *)noinfo.buf;
        size_t hl = 0, rl = (size_t)noinfo.len;
        const uint8_t *sep = memchr(meta, 0, e.mlen);
        if (sep != NULL) {
            const uint8_t *info = sep + 1;
            size_t il = e.mlen - (size_t)(info - meta);
            if (il >= 5 && info[0] == 1) {
                uint32_t n = (uint32_t)info[1] | (uint32_t)info[2] << 8 |
                             (uint32_t)info[3] << 16 | (uint32_t)info[4] << 24;
                if (5 + (size_t)n <= il) {
                    hashes = n ? info + 5 : NULL;
                    hl = n;
                    rest = info + 5 + n;
                    rl = il - 5 - n;
                }
            }
        }
        uint8_t keyarr[3 + KEYMAX] = {0x91, 0xc4, e.klen};
        memcpy(keyarr + 3, key, e.klen);
        int stored = e.type == EVT_STORED;
        Py_buffer *tail = &tails[e.medium == MED_STORAGE];
        if (evbuf_add(&o, heads[!stored].buf, (size_t)heads[!stored].len) < 0 ||
                (hashes != NULL ? evbuf_add(&o, hashes, hl)
                                : evbuf_add(&o, keyarr, 3 + (size_t)e.klen)) < 0 ||
                (stored && evbuf_add(&o, rest, rl) < 0) ||
                evbuf_add(&o, tail->buf, (size_t)tail->len) < 0)
            err = 1;
    }
    Py_END_ALLOW_THREADS
    if (r < 0 || s->dmg)
        out = lock_error(s);
    else if (err)
        out = PyErr_NoMemory();
    else if (!mine)
        out = Py_NewRef(Py_None);
    else
        out = Py_BuildValue("(y#KKKOO)", o.p ? o.p : "", (Py_ssize_t)o.len,
                            (unsigned long long)count, (unsigned long long)at,
                            (unsigned long long)lost, overrun ? Py_True : Py_False,
                            cleared ? Py_True : Py_False);
done:
    for (int i = 0; i < 2; i++) {
        PyBuffer_Release(&heads[i]);
        PyBuffer_Release(&tails[i]);
    }
    PyBuffer_Release(&noinfo);
    free(b.p);
    free(o.p);
    return out;
}

/* events_release(): this process stops publishing (events are no longer written) */
static PyObject *Idx_events_release(Idx *s, PyObject *unused) {
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

static PyObject *Idx_stats(Idx *s, PyObject *unused) {
    (void)unused;
    if (!usable(s))
        return NULL;
    uint64_t c[NCOUNTERS], recs = 0, cap = 0;
    int r;
    Py_BEGIN_ALLOW_THREADS
    r = lock(s);
    if (r == 0) {
        memcpy(c, s->hdr->count, sizeof c);
        recs = s->hdr->nrecs;
        cap = s->ncap;
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
/* check() -> a list of the inconsistencies found (empty: none), for tests and tools:
 * every structure the index keeps beside its records is compared with what the records
 * say (buckets, free records, queues, chunks in use and free, counters) */
#define CHECK_SAY(...)                                                                  \
    do {                                                                                \
        if (nsaid < 16)                                                                 \
            snprintf(said[nsaid], sizeof said[0], __VA_ARGS__);                          \
        nsaid++;                                                                        \
    } while (0)
static PyObject *Idx_check(Idx *s, PyObject *unused) {
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
        /* buckets: each names a record of its key, found where it is */
        for (uint64_t b = 0; b < s->nb; b++) {
            uint64_t v = s->buckets[b];
            if (!v)
                continue;
            in_buckets++;
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
        /* records: those in use are in the buckets, counted once */
        uint8_t *chunks[MAX_SLABS] = {0};
        for (uint32_t k = 0; k < h->nslabs; k++)
            if (h->slabs[k].live && slab_ok(h, &h->slabs[k]))
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
            if (sscanf(e->d_name, "table-%u.kvx", &gen) == 1 && gen != h->table_gen) {
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
    {"events_wire", (PyCFunction)Idx_events_wire, METH_VARARGS, NULL},
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
    .tp_doc = "The shared-memory index and arena of a KV block store (see _kvindex.c).",
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

/* kept_maps(prune=True) -> (mappings, bytes, kept, reused): this process's kept
 * mappings of pooled slab files (kept_t) after closing those of files gone, and how many
 * were ever kept and taken back by a new slab */
static PyObject *py_kept_maps(PyObject *self, PyObject *args) {
    (void)self;
    int prune = 1;
    if (!PyArg_ParseTuple(args, "|p", &prune))
        return NULL;
    int n;
    size_t bytes = 0;
    uint64_t k, r;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&kept_mu);
    if (prune || kept_pid != getpid())
        kept_prune_locked();
    n = nkept;
    for (int i = 0; i < nkept; i++)
        bytes += kept[i].size;
    k = kept_kept;
    r = kept_reused;
    pthread_mutex_unlock(&kept_mu);
    Py_END_ALLOW_THREADS
    return Py_BuildValue("(inKK)", n, (Py_ssize_t)bytes, (unsigned long long)k,
                         (unsigned long long)r);
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

/* set_fault(point, action, arg=0, after=1): arm a fault point (tests) */
static PyObject *py_set_fault(PyObject *self, PyObject *args) {
    (void)self;
    const char *name, *action;
    long arg = 0, after = 1;
    if (!PyArg_ParseTuple(args, "ss|ll", &name, &action, &arg, &after))
        return NULL;
    int a = strcmp(action, "off") == 0 ? FP_OFF : strcmp(action, "kill") == 0 ? FP_KILL
          : strcmp(action, "sleep") == 0 ? FP_SLEEP : -1;
    if (a < 0 || after < 1 || arg < 0) {
        PyErr_Format(PyExc_ValueError, "a fault is off, kill or sleep (microseconds >= 0), "
                     "after at least one hit: %s %ld after %ld", action, arg, after);
        return NULL;
    }
    fpoint_t *f = NULL;
    for (size_t i = 0; i < NFPOINTS; i++)
        if (strcmp(fpoints[i].name, name) == 0)
            f = &fpoints[i];
    if (f == NULL) {
        PyErr_Format(PyExc_ValueError, "no fault point %s", name);
        return NULL;
    }
    f->action = a;
    f->arg = arg;
    f->after = after;
    int armed = 0;
    for (size_t i = 0; i < NFPOINTS; i++)
        armed |= fpoints[i].action != FP_OFF;
    faults_armed = armed;
    Py_RETURN_NONE;
}

static PyObject *py_fault_points(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    PyObject *t = PyTuple_New((Py_ssize_t)NFPOINTS);
    for (size_t i = 0; t != NULL && i < NFPOINTS; i++) {
        PyObject *u = PyUnicode_FromString(fpoints[i].name);
        if (u == NULL) {
            Py_CLEAR(t);
            break;
        }
        PyTuple_SET_ITEM(t, (Py_ssize_t)i, u);
    }
    return t;
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
