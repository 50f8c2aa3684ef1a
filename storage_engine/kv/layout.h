/* The KV block store's shared layout: every struct that lives in a namespace's files,
 * mapped by every process of the host that opens the namespace. Nothing here is trusted
 * when read back: each field's invariant below is what the code checks before it uses
 * the value (an index, a length, an offset, a loop's bound), and a failed check marks
 * the namespace damaged (hdr_t.ready = READY_DAMAGED) instead of acting on it.
 *
 * The files of a namespace (under its root):
 *   index.kvx                 one hdr_t
 *   table-<gen>.kvx           one thdr_t, then thdr_t.nbuckets buckets (uint64_t)
 *   records-<rec_gen>.kvx     the records (rec_t): at least the table's thdr_t.cap; they
 *                             never move (a growth extends the file)
 *   slabs/<slot>-<gen>.slab   hdr_t.slabs[slot].nchunks chunks of .csize bytes each
 *   events.kvx                the event ring: hdr_t.ev_ring bytes of evh_t entries
 *   (the spill directory)     a spilled block's file: its bytes, then its metadata
 *
 * Any change to a struct here changes KV_VERSION: a namespace of another version is
 * refused at open (its files are a cache: removing them starts it empty).
 */
#ifndef TENSORDB_KV_LAYOUT_H
#define TENSORDB_KV_LAYOUT_H

#include <pthread.h>
#include <stdint.h>

#define KV_MAGIC 0x3178766b62647374ULL /* "tsdbkvx1" */
#define KV_VERSION 5 /* 3: the table file has its own header; 4: hdr_t.tseq, slabs
                      * made and blocks promoted outside the lock (slab_t.maker,
                      * rec_t.pslab); 5: the records in a file of their own that a
                      * growth extends, the buckets moved to the next table a few at a
                      * time (hdr_t.old_gen, rehash_at) */
#define KEYMAX 32
#define INLINE_META 40
#define MAX_SLABS 1024
#define MAX_PROCS 64
#define MIN_CHUNK 512
#define PAGE 4096
#define INITIAL_RECS 256
#define MAX_RECS (1u << 28) /* records a namespace can have: each process reserves the
                             * address space of this many (40 GiB) for the records file,
                             * so that a growth maps more of it where it is and no record
                             * ever moves */
#define EV_RING_BYTES (16u << 20) /* the event ring's size: the only one ever made */
#define META_SPILLED 0xFFFFFFFFu /* mslab of a spilled block: its metadata is in its file */
#define READY_DAMAGED 0xdead     /* hdr_t.ready of a namespace found damaged */

/* The chunk sizes (a slab's csize is one of them): powers of two from MIN_CHUNK below a
 * page, whole pages up to 16, then 8 steps per doubling */
static inline uint64_t size_class(uint64_t n) {
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

/* a record's state; a record is written state-last (the other fields first) */
enum { S_FREE = 0, S_WRITING = 1, S_HOST = 2, S_DISK = 3, S_ZOMBIE = 4, S_GHOST = 5 };
/* queues: LRU (or S3-FIFO's small), S3-FIFO's main and ghost, spilled blocks */
enum { Q_SMALL = 0, Q_MAIN = 1, Q_GHOST = 2, Q_DISK = 3, NQ = 4 };
enum { EV_LRU = 0, EV_S3FIFO = 1 };
/* shared counters, in the order of COUNTER_NAMES (module.c) */
enum { C_HOST_BLOCKS, C_HOST_BYTES, C_DISK_BLOCKS, C_DISK_BYTES, C_ARENA_BYTES, C_PINNED,
       C_HITS, C_MISSES, C_EVICTIONS, C_SPILLS, C_CORRUPT, C_SLAB_DROPS, C_RECLAIM_SCANS,
       C_META_BYTES,
       NCOUNTERS };

/* A block's record, in the table file.
 * - 1 <= klen <= KEYMAX for every state but FREE; key[klen..] is zero.
 * - HOST, WRITING, ZOMBIE: slab < hdr.nslabs names a live, non-meta slab, chunk < its
 *   nchunks, nbytes <= its csize; the chunk is this record's alone.
 * - DISK: slab:chunk is the spill sequence number (the file's name); nbytes its length.
 * - queue is Q_x + 1 of the one queue it is linked in (0: none); prev / next are
 *   record index + 1 (0: the end), each <= hdr.bump; a FREE record's next chains the
 *   free records.
 * - writer: WRITING: the writing process's slot + 1 (<= MAX_PROCS). DISK: 0, or the
 *   slot + 1 of a process promoting the block back into the arena outside the lock;
 *   its chunk for it is pslab:pchunk (a live block slab's, this record's alone), and
 *   the record is out of the disk queue meanwhile. Any other state: 0.
 * - readers: a bit per process slot (< MAX_PROCS) holding a zero-copy view.
 * - gen changes whenever the bytes move or the record is freed (readers' seqlock).
 * - meta_len <= INLINE_META: the metadata is meta[]; above it the metadata is the chunk
 *   mchunk of the meta slab mslab (META_SPILLED for a DISK block: in its file). */
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
    uint32_t pslab, pchunk; /* DISK, writer set: the chunk its promotion fills */
    uint8_t meta[INLINE_META];
} rec_t;

/* A slab slot of the header. live is SLAB_LIVE: its file slabs/<slot>-<gen>.slab
 * exists, of nchunks * csize bytes (checked by fstat before it is mapped); csize is a
 * size class (size_class()); used <= bump <= nchunks; free_head is a chunk + 1 (<= bump)
 * whose first 4 bytes chain the next free one; meta: a slab of metadata, not of blocks.
 * SLAB_MAKING: process slot maker - 1 makes its file outside the lock (its bytes are
 * counted in the arena already; nothing allocates from it and no record names it); a
 * maker that died leaves it to reclaim_dead. SLAB_FREE: the slot is unused. */
enum { SLAB_FREE = 0, SLAB_LIVE = 1, SLAB_MAKING = 2 };
typedef struct {
    uint64_t csize;
    uint32_t nchunks, used, bump, free_head; /* free_head: chunk + 1, chained in chunks */
    uint32_t gen, live;
    uint32_t fresh; /* its pages were never touched (not a recycled file) */
    uint32_t meta;  /* a slab of blocks' metadata past their records: beside the arena */
    uint32_t maker; /* SLAB_MAKING: the maker's process slot + 1 */
    uint32_t spare;
} slab_t;

/* A process slot: used while a process holds it; pid and start (its start time in
 * /proc/<pid>/stat) name it, so that a reused pid is not taken for the holder. */
typedef struct {
    int32_t pid;
    uint32_t used;
    uint64_t start;
} proc_t;

/* A queue's ends, record index + 1 (0: empty), each <= hdr.bump; len its records. */
typedef struct {
    uint32_t head, tail; /* index + 1 */
    uint64_t len;
} queue_t;

/* index.kvx. magic and version are checked at every open, ready at every lock (1: made;
 * READY_DAMAGED: serves nothing). table_gen names the table file in use; old_gen (0:
 * none) the table a growth is still moving buckets out of into it, a few at each record
 * made (rehash_at: its buckets below this are moved, all empty; <= its nbuckets, which
 * are half of the table's). Both are stored at once (tables), last when a growth
 * publishes (release); the sizes are in the tables' own headers. The first generation
 * is random in [1, 2^30], so that creators racing on a new namespace never share a
 * name; the records file is named by it (rec_gen) and never changes. nslabs <=
 * MAX_SLABS. bump <= the table's cap; free_rec: record index + 1 of the free chain.
 * The lock is a process-shared robust mutex: a holder's death leaves it EOWNERDEAD, and
 * the next locker rebuilds what can be derived from the records before it is marked
 * consistent. tseq is the buckets' seqlock: odd while a holder changes any bucket (an
 * insert, a delete's backward shift, a move to the new table, a rebuild), so that
 * lookups can read the tables without the lock (read.c); a holder killed inside leaves
 * it odd, and the rebuild after it makes it even again. */
typedef struct {
    uint64_t magic;
    uint32_t version, ready;
    pthread_mutex_t lock;
    uint64_t seed0, seed1;
    uint64_t capacity, slab_bytes;
    uint32_t eviction, gpu_seen;
    union {
        struct {
            uint32_t table_gen, old_gen;
        };
        uint64_t tables; /* both, for the one store that publishes them */
    };
    uint32_t nslabs, rec_gen; /* slab slots ever used (high-water mark); the records' file */
    uint64_t rehash_at;
    uint64_t bump, free_rec, nrecs; /* records made, the free ones' chain, those in use */
    uint64_t spill_seq, write_epoch;
    uint64_t tseq; /* the buckets' seqlock: odd while they change */
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

/* A table file's own header: its sizes live with it, so that a growth publishes a new
 * table with one store (the index's tables, written last) and a holder killed at any
 * point of it leaves either the old table named, whole, or the new one, whole, beside
 * the old (a file made and not named is removed by the next growth). gen equals the
 * file's name; nbuckets == 2 * cap, a power of two <= 2 * MAX_RECS; INITIAL_RECS <= cap
 * (the records the table admits: the records file holds at least that many); the file
 * is at least table_bytes(nbuckets) long. A bucket is 0 (empty) or a 32-bit tag of the
 * key's hash above the record index + 1 (<= cap). spare[0] is PREMADE (table.c) in a
 * file made ahead of its growth and not yet taken by it, 0 otherwise. */
#define TABLE_MAGIC 0x3162617462647374ULL /* "tsdbtab1" */
typedef struct {
    uint64_t magic;
    uint32_t gen, pad;
    uint64_t nbuckets, cap;
    uint64_t spare[4];
} thdr_t; /* 64 bytes: the buckets after it stay aligned */
#define THDR_BYTES 64

/* An entry of the event ring: a neutral record of a block that entered or left the
 * store (type), where it is (medium), its key and its metadata, as they were written.
 * len is the entry's bytes (sizeof(evh_t) + klen + mlen, rounded up to 8); entries
 * never wrap (EVT_PAD fills the ring's end); klen <= KEYMAX, medium <= MED_STORAGE. A
 * reader that finds an entry breaking these takes it for an overrun. */
enum { EVT_STORED = 1, EVT_REMOVED = 2, EVT_CLEARED = 3, EVT_PAD = 255 };
enum { MED_CPU = 0, MED_STORAGE = 1 };
typedef struct {
    uint32_t len, mlen; /* the entry's bytes (a multiple of 8), its metadata's */
    uint8_t type, medium, klen, pad[5];
} evh_t;

_Static_assert(sizeof(thdr_t) == THDR_BYTES, "a table header is 64 bytes");
_Static_assert(sizeof(rec_t) == 152, "a record is 152 bytes (KV_VERSION)");
_Static_assert(sizeof(slab_t) == 48, "a slab slot is 48 bytes (KV_VERSION)");
_Static_assert(sizeof(evh_t) == 16, "an event entry's head is 16 bytes");
_Static_assert(KEYMAX <= 255 && INLINE_META % 8 == 0, "klen is a byte");

#endif
