/* The table files (table-<gen>.kvx: a header and the buckets), the records file
 * (records-<gen>.kvx) and the hash table: open addressing, linear probing,
 * backward-shift deletion; 8-byte buckets holding a 32-bit tag and the record's index.
 * The table grows by doubling, incrementally, as Redis's dict.c rehashes: a growth
 * extends the records file (records never move: each process maps it into an address
 * range reserved for MAX_RECS records, and maps more of it where the last mapping
 * ended) and names a new, empty table beside the old one with one store (layout.h's
 * hdr_t.tables); from then on inserts go to the new table, lookups and deletes look in
 * both, and each record made moves the next REHASH_STEP buckets of the old table into
 * the new one, until it is empty and goes. No step of it is O(n) under the lock. Every
 * change of the mapped tables' buckets is a window of the header's seqlock (tseq),
 * which lookups without the lock read around their probes (read.c). */
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
/* the table files and the records file */

static size_t table_bytes(uint64_t nbuckets) { return (size_t)(THDR_BYTES + nbuckets * 8); }

static size_t records_bytes(uint64_t cap) { return (size_t)(cap * sizeof(rec_t)); }

/* the most bytes of files a put makes ahead of a growth (table_premake) */
#define PREMAKE_STEP ((size_t)8 << 20)

void table_path(Idx *s, uint32_t gen, char *out, size_t n) {
    snprintf(out, n, "%s/table-%u.kvx", s->root, gen);
}

void records_path(const char *root, uint32_t gen, char *out, size_t n) {
    snprintf(out, n, "%s/records-%u.kvx", root, gen);
}

/* the sizes a table can have: doubled from INITIAL_RECS, twice as many buckets as
 * records, at most MAX_RECS records (a bucket's tag holds 32 bits of the hash) */
static int table_sizes_ok(uint64_t nb, uint64_t cap) {
    return cap >= INITIAL_RECS && cap <= MAX_RECS && nb == cap * 2 && (nb & (nb - 1)) == 0;
}

/* the table file of generation gen, checked and mapped (a mapping past a file's end is
 * a SIGBUS at the first touch: its size is checked by fstat first); 0, or -1 (damage,
 * or errno) */
static int map_one(Idx *s, uint32_t gen, char **m_out, size_t *size_out, uint64_t *nb_out,
                   uint64_t *cap_out) {
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
    size_t size = table_bytes(nb);
    if ((uint64_t)st.st_size < size) {
        close(fd);
        return damaged(s, file, "it is %lld bytes; a table of %llu buckets is %zu",
                       (long long)st.st_size, (unsigned long long)nb, size);
    }
    void *m = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (m == MAP_FAILED)
        return -1;
    *m_out = (char *)m;
    *size_out = size;
    *nb_out = nb;
    *cap_out = cap;
    return 0;
}

/* this process's mapping of the records file, to cap records at least: the address
 * range of MAX_RECS records is reserved at the first call, and each call maps the file
 * on from the page where the last mapping ended (MAP_FIXED into the reservation), so a
 * record's address never changes while the handle is open. Checked by fstat first. */
static int map_records(Idx *s, uint64_t cap) {
    size_t want = records_bytes(cap);
    if (want <= s->recs_mapped)
        return 0;
    char path[4096], file[64];
    snprintf(file, sizeof file, "records-%u.kvx", s->hdr->rec_gen);
    records_path(s->root, s->hdr->rec_gen, path, sizeof path);
    int fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0) {
        if (errno == ENOENT)
            return damaged(s, file, "the records file the index names is missing");
        return -1;
    }
    struct stat st;
    if (fstat(fd, &st) != 0) {
        close(fd);
        return -1;
    }
    if ((uint64_t)st.st_size < want) {
        close(fd);
        return damaged(s, file, "it is %lld bytes; %llu records are %zu",
                       (long long)st.st_size, (unsigned long long)cap, want);
    }
    if (s->recs == NULL) {
        void *r = mmap(NULL, records_bytes(MAX_RECS), PROT_NONE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (r == MAP_FAILED) {
            close(fd);
            return -1;
        }
        s->recs = (rec_t *)r;
    }
    /* the page the last mapping ended in is mapped again: no thread of this process
     * reads records without the lock meanwhile */
    size_t from = s->recs_mapped / PAGE * PAGE;
    map_hold(s, 1);
    void *m = mmap((char *)s->recs + from, want - from, PROT_READ | PROT_WRITE,
                   MAP_SHARED | MAP_FIXED, fd, (off_t)from);
    if (m != MAP_FAILED)
        s->recs_mapped = want;
    map_let_go(s);
    close(fd);
    return m == MAP_FAILED ? -1 : 0;
}

void drop_old(Idx *s) {
    map_hold(s, 1);
    if (s->otable != NULL)
        munmap(s->otable, s->otable_size);
    s->otable = NULL;
    s->otable_size = 0;
    s->obuckets = NULL;
    s->onb = 0;
    s->old_gen = 0;
    s->tables = (uint64_t)s->table_gen;
    map_let_go(s);
}

/* every mapping of the tables and the records (close, or a child after a fork) */
void unmap_tables(Idx *s) {
    map_hold(s, 1);
    if (s->table != NULL)
        munmap(s->table, s->table_size);
    if (s->otable != NULL)
        munmap(s->otable, s->otable_size);
    if (s->recs != NULL)
        munmap(s->recs, records_bytes(MAX_RECS));
    s->table = s->otable = NULL;
    s->buckets = s->obuckets = NULL;
    s->recs = NULL;
    s->recs_mapped = 0;
    s->nb = s->onb = s->ncap = 0;
    s->tables = 0;
    s->table_gen = s->old_gen = 0;
    map_let_go(s);
}

/* this process's mappings of the tables the header names (under the lock): the table in
 * use, the one a growth moves buckets out of where there is one (of half its buckets),
 * and the records the table admits */
int map_table(Idx *s) {
    hdr_t *h = s->hdr;
    uint64_t tables = __atomic_load_n(&h->tables, __ATOMIC_ACQUIRE);
    uint32_t gen = (uint32_t)tables, old = (uint32_t)(tables >> 32);
    char *m = NULL, *om = NULL;
    size_t size = 0, osize = 0;
    uint64_t nb = s->nb, cap = s->ncap, onb = 0, ocap = 0;
    int fresh = gen != s->table_gen || s->table == NULL;
    if (fresh && map_one(s, gen, &m, &size, &nb, &cap) < 0)
        return -1;
    int ofresh = old != 0 && old != s->old_gen;
    if (ofresh && old != gen && map_one(s, old, &om, &osize, &onb, &ocap) < 0) {
        if (m != NULL)
            munmap(m, size);
        return -1;
    }
    if (old != 0 && !ofresh)
        onb = s->onb;
    if (old != 0 && (old == gen || onb * 2 != nb)) {
        if (om != NULL)
            munmap(om, osize);
        if (m != NULL)
            munmap(m, size);
        return damaged(s, "index.kvx", "table generation %u (%llu buckets) is moving out of "
                       "generation %u (%llu buckets)", gen, (unsigned long long)nb, old,
                       (unsigned long long)onb);
    }
    if (map_records(s, cap) < 0) {
        if (om != NULL)
            munmap(om, osize);
        if (m != NULL)
            munmap(m, size);
        return -1;
    }
    map_hold(s, 1);
    if (fresh) {
        if (s->table != NULL)
            munmap(s->table, s->table_size);
        s->table = m;
        s->table_size = size;
        s->buckets = (uint64_t *)(m + THDR_BYTES);
        s->table_gen = gen;
        s->nb = nb;
        s->ncap = cap;
    }
    if (ofresh || old == 0) {
        if (s->otable != NULL)
            munmap(s->otable, s->otable_size);
        s->otable = om;
        s->otable_size = osize;
        s->obuckets = om != NULL ? (uint64_t *)(om + THDR_BYTES) : NULL;
        s->onb = onb;
        s->old_gen = old;
    }
    s->tables = tables;
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
    int fd = create_file(path, table_bytes(nb));
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

/* the records file's room for cap records, at most `most` bytes of it allocated by this
 * call (its pages allocated: a full tmpfs is an error here, never a SIGBUS at a
 * record's first write): 1 (bytes allocated), 0 (the room was there), -1 (errno) */
static int records_room(Idx *s, uint64_t cap, size_t most) {
    char path[4096];
    records_path(s->root, s->hdr->rec_gen, path, sizeof path);
    int fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0)
        return -1;
    struct stat st;
    int r = fstat(fd, &st) != 0 ? errno : 0;
    size_t want = records_bytes(cap), have = r == 0 ? (size_t)st.st_size : 0;
    int made = 0;
    if (r == 0 && have < want) {
        size_t len = want - have < most ? want - have : most;
        r = posix_fallocate(fd, (off_t)have, (off_t)len);
        made = 1;
    }
    close(fd);
    if (r != 0) {
        errno = r;
        return -1;
    }
    return made;
}

/* the records file holds cap records at least: 0, or -1 (errno) */
static int extend_records(Idx *s, uint64_t cap) {
    return records_room(s, cap, SIZE_MAX) < 0 ? -1 : 0;
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

/* The next table's file and the records' room, made ahead of the growth outside the
 * lock: allocating their pages is most of a growth, which no lookup, read or other
 * writer should wait for, and made in steps, so that no put pays for all of it (made at
 * once, it was 50 ms of one put's time at 2^20 records). Each put from the table half
 * full on makes one step of at most PREMAKE_STEP bytes: first the records file's
 * extension to twice the records (a file longer than the table admits is harmless: its
 * end is unused), then table-<gen+1>.kvx, zeroed, under a name of this process's own,
 * which once whole gets its header, marked PREMADE, and is linked into place only where
 * no file has that name (a growth's, or another premaker's). The half of the table left
 * holds cap / 2 records, time for 184 bytes of files per record in 8 MiB steps at
 * batches of up to 22,000 blocks; a growth that comes first makes what is missing
 * itself. The growth takes the file where its header says it is that table, unused (a
 * partial file of a premaker killed meanwhile is never named). */
#define PREMADE 0x6564616d657270ULL /* "premade": thdr_t.spare[0] of an unused file */

void table_premake(Idx *s) {
    hdr_t *h = s->hdr;
    uint32_t gen = __atomic_load_n(&h->table_gen, __ATOMIC_ACQUIRE);
    uint64_t made = __atomic_load_n(&h->bump, __ATOMIC_RELAXED);
    uint64_t nb = s->nb * 2, cap = s->ncap * 2;
    if (gen != s->table_gen || s->premade == gen + 1 || made * 2 < s->ncap || cap > MAX_RECS)
        return;
    /* one step of at most PREMAKE_STEP bytes a call: the records' room first, then the
     * next table's file, which is named only once whole */
    int step = records_room(s, cap, PREMAKE_STEP);
    if (step != 0) {
        if (step < 0)
            s->premade = gen + 1; /* no room on the tmpfs: the growth reports it */
        return;
    }
    char path[4096], tmp[4200];
    table_path(s, gen + 1, path, sizeof path);
    if (access(path, F_OK) == 0) {
        s->premade = gen + 1;
        return;
    }
    snprintf(tmp, sizeof tmp, "%s.%d.tmp", path, (int)getpid());
    int fd = open(tmp, O_CREAT | O_RDWR | O_CLOEXEC, 0600);
    if (fd < 0) {
        s->premade = gen + 1;
        return;
    }
    struct stat st;
    size_t size = table_bytes(nb);
    int bad = fstat(fd, &st) != 0;
    size_t have = bad ? 0 : (size_t)st.st_size;
    if (!bad && have < size) {
        size_t len = size - have < PREMAKE_STEP ? size - have : PREMAKE_STEP;
        bad = posix_fallocate(fd, (off_t)have, (off_t)len) != 0;
        have += bad ? 0 : len;
    }
    if (bad || have < size) {
        close(fd);
        if (bad) {
            unlink(tmp);
            s->premade = gen + 1;
        }
        return; /* the next call goes on */
    }
    s->premade = gen + 1;
    thdr_t th;
    memset(&th, 0, sizeof th);
    th.magic = TABLE_MAGIC;
    th.gen = gen + 1;
    th.nbuckets = nb;
    th.cap = cap;
    th.spare[0] = PREMADE;
    int ok = pwrite(fd, &th, sizeof th, 0) == sizeof th;
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
    if (fstat(fd, &st) != 0 || (uint64_t)st.st_size < table_bytes(nb) ||
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

/* Double the records and the buckets (under the lock): the records file is extended
 * (made ahead, as a rule), the next table is a new empty file, and one store names it
 * beside the old one, whose buckets the records made from then on move over (rehash).
 * A move still under way is finished first (the steps make that rare: see REHASH_STEP). */
int grow(Idx *s) {
    hdr_t *h = s->hdr;
    if (s->onb != 0 && rehash(s, UINT64_MAX) < 0)
        return -1;
    uint64_t cap = s->ncap * 2, nb = s->nb * 2;
    if (cap > MAX_RECS) {
        errno = ENOSPC;
        return -1;
    }
    if (extend_records(s, cap) < 0 || map_records(s, cap) < 0)
        return -1;
    uint32_t gen = h->table_gen;
    char path[4096];
    table_path(s, gen + 1, path, sizeof path);
    size_t size = table_bytes(nb);
    int fd = take_premade(path, gen + 1, nb, cap);
    int premade = fd >= 0; /* its pages are there: map them all at once */
    if (fd < 0)
        fd = create_table(path, gen + 1, nb, cap);
    if (fd < 0)
        return -1;
    char *m = mmap(NULL, size, PROT_READ | PROT_WRITE,
                   MAP_SHARED | (premade ? MAP_POPULATE : 0), fd, 0);
    close(fd);
    if (m == MAP_FAILED) {
        unlink(path);
        return -1;
    }
    FAULT("grow.made");
    h->rehash_at = 0;
    uint64_t tables = (uint64_t)(gen + 1) | ((uint64_t)gen << 32);
    /* published: one store, after everything it names is written */
    __atomic_store_n(&h->tables, tables, __ATOMIC_RELEASE);
    map_hold(s, 1);
    if (s->otable != NULL)
        munmap(s->otable, s->otable_size);
    s->otable = s->table;
    s->otable_size = s->table_size;
    s->obuckets = s->buckets;
    s->onb = s->nb;
    s->old_gen = gen;
    s->table = m;
    s->table_size = size;
    s->buckets = (uint64_t *)(m + THDR_BYTES);
    s->table_gen = gen + 1;
    s->nb = nb;
    s->ncap = cap;
    s->tables = tables;
    map_let_go(s);
    FAULT("grow.published");
    return 0;
}

/* backward shift from a hole at bucket `hole` of a table: pull later entries of its run
 * into it. 0, or -1 where no bucket is empty (damage) */
static int shift_back(uint64_t *bk, uint64_t nb, uint64_t hole) {
    uint64_t mask = nb - 1, j = hole;
    for (uint64_t probes = 0;; probes++) {
        j = (j + 1) & mask;
        uint64_t v = bk[j];
        if (!v)
            break;
        if (probes >= nb)
            return -1;
        /* its home from its tag, the hash's low bits (the table has at most 2^32
         * buckets): no look at its record, which is cold */
        uint64_t home = (v >> 32) & mask;
        /* can the entry at j move to hole? only if its home is not in (hole, j] */
        int between = hole <= j ? (home > hole && home <= j) : (home > hole || home <= j);
        if (!between) {
            bk[hole] = v;
            hole = j;
        }
    }
    bk[hole] = 0;
    return 0;
}

/* Move the old table's buckets into the new one (under the lock), `budget` buckets on
 * from rehash_at (each step empties one, or moves its entry: the shift behind it may
 * fill it again), in one window of the seqlock. The old table stays a table of its own
 * throughout (only deletions with their backward shift change it, and every bucket
 * below rehash_at is empty, which no run crosses), so a lookup still finds in it what
 * it holds. Once it is empty it goes: one store names the new table alone. 0, or -1
 * (damage). */
int rehash(Idx *s, uint64_t budget) {
    hdr_t *h = s->hdr;
    if (s->onb == 0)
        return 0;
    uint64_t at = h->rehash_at, onb = s->onb, *ob = s->obuckets;
    if (at > onb)
        return gen_damaged(s, s->old_gen, "%llu of its %llu buckets moved",
                           (unsigned long long)at, (unsigned long long)onb);
    tseq_begin(h);
    for (uint64_t steps = 0; at < onb && steps < budget; steps++) {
        uint64_t v = ob[at];
        if (!v) {
            at++;
            continue;
        }
        uint32_t i = (uint32_t)(v & 0xffffffffu) - 1;
        if (i >= h->bump || h_insert_raw(s->buckets, s->nb, v >> 32, i) < 0 ||
                shift_back(ob, onb, at) < 0) {
            tseq_end(h);
            return gen_damaged(s, s->old_gen, "bucket %llu names record %u of %llu, or no "
                               "bucket is empty", (unsigned long long)at, i,
                               (unsigned long long)h->bump);
        }
        FAULT("grow.rehash");
    }
    h->rehash_at = at;
    tseq_end(h);
    if (at < onb)
        return 0;
    uint32_t old = s->old_gen;
    __atomic_store_n(&h->tables, (uint64_t)h->table_gen, __ATOMIC_RELEASE);
    h->rehash_at = 0;
    drop_old(s);
    char path[4096];
    table_path(s, old, path, sizeof path);
    unlink(path); /* the others' mappings keep its pages until they remap */
    return 0;
}

/* ---------------------------------------------------------------------------------- */
/* hash table */

/* the record of a key in one table, or -1 (absent), or -2 (damaged) */
static int64_t find_in(Idx *s, const uint64_t *bk, uint64_t nb, uint32_t gen, uint64_t hash,
                       const uint8_t *key, size_t klen) {
    hdr_t *h = s->hdr;
    uint64_t mask = nb - 1, b = hash & mask, tag = hash & 0xffffffffu;
    for (uint64_t probes = 0; probes < nb; probes++) {
        uint64_t v = bk[b];
        if (!v)
            return -1;
        if ((v >> 32) == tag) {
            uint32_t i = (uint32_t)(v & 0xffffffffu) - 1;
            if (i >= h->bump)
                return gen_damaged(s, gen, "bucket %llu names record %u of %llu",
                                   (unsigned long long)b, i, (unsigned long long)h->bump) * 2;
            rec_t *r = R(s, i);
            if (r->klen == klen && memcmp(r->key, key, klen) == 0)
                return i;
        }
        b = (b + 1) & mask;
    }
    return gen_damaged(s, gen, "no bucket of %llu is empty", (unsigned long long)nb) * 2;
}

/* the record of a key, or -1 (absent), or -2 (the table is damaged: see damaged()) */
int64_t h_find(Idx *s, const uint8_t *key, size_t klen) {
    uint64_t hash = khash(s->hdr, key, klen);
    int64_t f = find_in(s, s->buckets, s->nb, s->table_gen, hash, key, klen);
    if (f == -1 && s->onb != 0)
        f = find_in(s, s->obuckets, s->onb, s->old_gen, hash, key, klen);
    return f;
}

/* the bucket of record idx in one table, or -1 (not there), or -2 (damaged) */
static int64_t bucket_of(Idx *s, const uint64_t *bk, uint64_t nb, uint32_t gen,
                         uint64_t hash, uint32_t idx) {
    uint64_t mask = nb - 1, b = hash & mask;
    for (uint64_t probes = 0; (uint32_t)(bk[b] & 0xffffffffu) != idx + 1; probes++) {
        if (!bk[b])
            return -1;
        if (probes >= nb)
            return gen_damaged(s, gen, "no bucket of %llu is empty", (unsigned long long)nb) * 2;
        b = (b + 1) & mask;
    }
    return (int64_t)b;
}

void h_delete(Idx *s, uint32_t idx) {
    rec_t *r = R(s, idx);
    uint64_t hash = khash(s->hdr, r->key, r->klen);
    uint64_t *bk = s->buckets, nb = s->nb;
    uint32_t gen = s->table_gen;
    int64_t b = bucket_of(s, bk, nb, gen, hash, idx);
    if (b == -1 && s->onb != 0) {
        bk = s->obuckets;
        nb = s->onb;
        gen = s->old_gen;
        b = bucket_of(s, bk, nb, gen, hash, idx);
    }
    if (b < 0)
        return; /* not there (a repair in progress), or damage */
    /* backward shift (a window of the seqlock: a lookup without the lock that probed
     * meanwhile looks again) */
    tseq_begin(s->hdr);
    int bad = shift_back(bk, nb, (uint64_t)b) < 0;
    tseq_end(s->hdr);
    if (bad)
        gen_damaged(s, gen, "no bucket of %llu is empty", (unsigned long long)nb);
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
