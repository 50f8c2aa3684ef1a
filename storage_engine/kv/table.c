/* The table file (table-<gen>.kvx) and its hash table: open addressing, linear probing,
 * backward-shift deletion; 8-byte buckets holding a 32-bit tag and the record's index,
 * grown by doubling into a new file whose generation every process notices at its next
 * lock (published with one store: layout.h's thdr_t). Every change of the mapped
 * table's buckets is a window of the header's seqlock (tseq), which lookups without
 * the lock read around their probes (read.c). */
#include "kv.h"

/* a keyed hash of a key: the seeds are random per store, so that chosen keys cannot
 * pile into one run of buckets without knowing them */
uint64_t khash(const hdr_t *h, const uint8_t *key, size_t klen) {
    uint64_t acc = h->seed0 ^ (klen * 0x9e3779b97f4a7c15ULL);
    uint64_t w[4] = {0, 0, 0, 0};
    memcpy(w, key, klen <= KEYMAX ? klen : KEYMAX); /* a record's klen is a shared byte */
    for (int i = 0; i < 4; i++)
        acc = mix64(acc ^ w[i] ^ (h->seed1 + (uint64_t)i));
    return acc;
}

/* ---------------------------------------------------------------------------------- */
/* the table file */

static size_t table_bytes(uint64_t nbuckets, uint64_t cap) {
    return (size_t)(THDR_BYTES + nbuckets * 8 + cap * sizeof(rec_t));
}

void table_path(Idx *s, uint32_t gen, char *out, size_t n) {
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
int map_table(Idx *s) {
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
    map_hold(s, 1);
    if (s->table != NULL)
        munmap(s->table, s->table_size);
    s->table = (char *)m;
    s->table_size = size;
    s->buckets = (uint64_t *)((char *)m + THDR_BYTES);
    s->recs = (rec_t *)((char *)m + THDR_BYTES + nb * 8);
    s->table_gen = gen;
    s->nb = nb;
    s->ncap = cap;
    map_let_go(s);
    return 0;
}

int create_file(const char *path, size_t size) {
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

int create_table(const char *path, uint32_t gen, uint64_t nb, uint64_t cap) {
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
int h_insert_raw(uint64_t *buckets, uint64_t nb, uint64_t hash, uint32_t idx) {
    uint64_t mask = nb - 1, b = hash & mask;
    for (uint64_t probes = 0; buckets[b]; probes++) {
        if (probes >= nb)
            return -1;
        b = (b + 1) & mask;
    }
    buckets[b] = (hash << 32) | (uint64_t)(idx + 1); /* the tag: the hash's low 32 bits */
    return 0;
}

/* The next table's file, made ahead of its growth outside the lock: allocating its
 * pages is most of a growth (at 10^6 records, 80 of its 140 ms), which no lookup, read
 * or other writer should wait for. A put that leaves the table three quarters full
 * makes table-<gen+1>.kvx, zeroed, its header marked PREMADE, under a name of its own
 * and linked into place only where no file has that name (a growth's, or another
 * premaker's); the growth takes it where its header says it is that table, unused. */
#define PREMADE 0x6564616d657270ULL /* "premade": thdr_t.spare[0] of an unused file */

void table_premake(Idx *s) {
    hdr_t *h = s->hdr;
    uint32_t gen = __atomic_load_n(&h->table_gen, __ATOMIC_ACQUIRE);
    uint64_t made = __atomic_load_n(&h->bump, __ATOMIC_RELAXED);
    uint64_t nb = s->nb * 2, cap = s->ncap * 2;
    if (gen != s->table_gen || s->premade == gen + 1 || made * 4 < s->ncap * 3 ||
            nb > (1ULL << 32))
        return;
    s->premade = gen + 1;
    char path[4096], tmp[4200];
    table_path(s, gen + 1, path, sizeof path);
    if (access(path, F_OK) == 0)
        return;
    snprintf(tmp, sizeof tmp, "%s.%d.tmp", path, (int)getpid());
    int fd = create_table(tmp, gen + 1, nb, cap);
    if (fd < 0)
        return;
    uint64_t mark = PREMADE;
    int ok = pwrite(fd, &mark, sizeof mark, offsetof(thdr_t, spare)) == sizeof mark;
    close(fd);
    if (ok)
        (void)link(tmp, path); /* EEXIST: a growth's file, or another premaker's */
    unlink(tmp);
}

/* (under the lock) a premade file for the table of generation gen (nb buckets, cap
 * records), unused and whole, open; -1 where there is none */
static int take_premade(const char *path, uint32_t gen, uint64_t nb, uint64_t cap) {
    int fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0)
        return -1;
    thdr_t th;
    struct stat st;
    if (fstat(fd, &st) != 0 || (uint64_t)st.st_size < table_bytes(nb, cap) ||
            pread(fd, &th, sizeof th, 0) != sizeof th || th.magic != TABLE_MAGIC ||
            th.gen != gen || th.nbuckets != nb || th.cap != cap || th.spare[0] != PREMADE) {
        close(fd);
        return -1;
    }
    th.spare[0] = 0; /* used from now on: a growth killed after this leaves it unmarked */
    if (pwrite(fd, &th, sizeof th, 0) != sizeof th) {
        close(fd);
        return -1;
    }
    return fd;
}

/* double the records (and the buckets with them) into a new table file */
int grow(Idx *s) {
    hdr_t *h = s->hdr;
    uint64_t cap = s->ncap * 2, nb = s->nb * 2;
    if (nb > (1ULL << 32)) { /* a bucket's tag holds 32 bits of the hash: its home */
        errno = ENOSPC;
        return -1;
    }
    char path[4096];
    table_path(s, h->table_gen + 1, path, sizeof path);
    size_t size = table_bytes(nb, cap);
    int fd = take_premade(path, h->table_gen + 1, nb, cap);
    int premade = fd >= 0; /* its pages are there: map them all at once */
    if (fd < 0)
        fd = create_table(path, h->table_gen + 1, nb, cap);
    if (fd < 0)
        return -1;
    char *m = mmap(NULL, size, PROT_READ | PROT_WRITE,
                   MAP_SHARED | (premade ? MAP_POPULATE : 0), fd, 0);
    close(fd);
    if (m == MAP_FAILED) {
        unlink(path);
        return -1;
    }
    uint64_t *buckets = (uint64_t *)(m + THDR_BYTES);
    rec_t *recs = (rec_t *)(m + THDR_BYTES + nb * 8);
    memcpy(recs, s->recs, h->bump * sizeof(rec_t));
    /* each entry's new home from its tag, the hash's low 32 bits (the table has at most
     * 2^32 buckets): one pass over the old buckets, no record read (reading each
     * record's key to hash it again, a cache miss a record, was most of a growth) */
    for (uint64_t b = 0; b < s->nb; b++) {
        uint64_t v = s->buckets[b];
        if (v) {
            uint32_t i = (uint32_t)(v & 0xffffffffu) - 1;
            if (i >= h->bump || h_insert_raw(buckets, nb, v >> 32, i) < 0) {
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
    map_hold(s, 1);
    munmap(s->table, s->table_size);
    s->table = m;
    s->table_size = size;
    s->buckets = buckets;
    s->recs = recs;
    s->table_gen = h->table_gen;
    s->nb = nb;
    s->ncap = cap;
    map_let_go(s);
    FAULT("grow.published");
    unlink(old); /* the others' mappings keep its pages until they remap */
    return 0;
}

/* ---------------------------------------------------------------------------------- */
/* hash table */

/* the record of a key, or -1 (absent), or -2 (the table is damaged: see damaged()) */
int64_t h_find(Idx *s, const uint8_t *key, size_t klen) {
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

void h_delete(Idx *s, uint32_t idx) {
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
    /* backward shift: pull later entries of the run into the hole (a window of the
     * seqlock: a lookup without the lock that probed meanwhile looks again) */
    tseq_begin(h);
    uint64_t hole = b, j = b;
    for (probes = 0;; probes++) {
        j = (j + 1) & mask;
        uint64_t v = s->buckets[j];
        if (!v)
            break;
        if (probes >= s->nb) {
            tseq_end(h);
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
    tseq_end(h);
}

/* an insert into the mapped table (under the lock), a window of the seqlock */
int h_insert(Idx *s, uint64_t hash, uint32_t idx) {
    tseq_begin(s->hdr);
    int r = h_insert_raw(s->buckets, s->nb, hash, idx);
    tseq_end(s->hdr);
    return r;
}

/* ---------------------------------------------------------------------------------- */
/* queues */
