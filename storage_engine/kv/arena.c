/* Records, slabs and chunks: the arena of fixed-size chunks of one size class per slab
 * file (slabs/<slot>-<gen>.slab), each slab's free chain, and the process's kept mappings
 * of pooled slab files (a new slab takes a freed file's pages instead of faulting new ones). */
#include "kv.h"

int64_t rec_new(Idx *s) {
    hdr_t *h = s->hdr;
    uint32_t i;
    /* a growth's move of buckets into the new table goes on a few at each record made */
    if (s->onb != 0 && rehash(s, REHASH_STEP) < 0) {
        errno = EIO;
        return -1;
    }
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

void rec_free(Idx *s, uint32_t i) {
    hdr_t *h = s->hdr;
    rec_t *r = R(s, i);
    r->state = S_FREE;
    r->gen++;
    r->readers = 0;
    r->writer = 0;
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
int slab_ok(const hdr_t *h, const slab_t *sl) {
    uint64_t bytes;
    if (sl->csize < MIN_CHUNK || sl->csize > (1ULL << 40) || size_class(sl->csize) != sl->csize ||
            sl->nchunks == 0 || __builtin_mul_overflow(sl->csize, (uint64_t)sl->nchunks, &bytes))
        return 0;
    uint64_t most = sl->meta ? (sl->csize > (256u << 10) ? sl->csize : 256u << 10) : h->capacity;
    return bytes <= most && sl->used <= sl->nchunks && sl->bump <= sl->nchunks &&
           sl->free_head <= sl->nchunks;
}

int slab_damaged(Idx *s, uint32_t slot) {
    const slab_t *sl = &s->hdr->slabs[slot];
    return damaged(s, "index.kvx", "slab %u: %llu chunks of %llu bytes, %u used, %u made, "
                   "free from %u", slot, (unsigned long long)sl->nchunks,
                   (unsigned long long)sl->csize, sl->used, sl->bump, sl->free_head);
}

/* record i, reached by a key, a queue or a lease, can be what its fields say: 0, or -1
 * (the table is damaged: see damaged()). What match and contains read of it (its key
 * and state) needs no check; everything that leads to an address or a length does. */
int rec_check(Idx *s, uint32_t i) {
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
    else if (r->state == S_DISK && r->writer && !chunk_ok(h, r->pslab, r->pchunk, 0))
        bad = "promotion's chunk";
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

void slab_path(Idx *s, uint32_t slot, uint32_t gen, char *out, size_t n) {
    snprintf(out, n, "%s/slabs/%04x-%u.slab", s->root, slot, gen);
}

void unmap_slab(Idx *s, uint32_t slot) {
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
char *slab_base(Idx *s, uint32_t slot) {
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
int slab_check(Idx *s, uint32_t slot) {
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

int take_free(Idx *s, uint64_t csize, uint32_t *slot, uint32_t *chunk,
                     int *untouched, uint32_t meta) {
    hdr_t *h = s->hdr;
    /* the slab the last allocation used first: a batch's chunks come from one slab, and
     * a scan of the slab table per block costs what the table holds */
    uint32_t hint = s->hint < h->nslabs ? s->hint : 0;
    for (uint32_t k = 0; k < h->nslabs; k++) {
        uint32_t i = k == 0 ? hint : (k <= hint ? k - 1 : k);
        slab_t *sl = &h->slabs[i];
        if (sl->live != SLAB_LIVE || sl->csize != csize || sl->used == sl->nchunks ||
                sl->meta != meta)
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

void release_chunk(Idx *s, uint32_t slot, uint32_t chunk) {
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
pid_t kept_pid;
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

void kv_atfork_child(void) {
    pthread_mutex_init(&kept_mu, NULL);
    workers_atfork_child();
}

/* keep a slab's mapping (base, size, its file open as fd); takes both over */
void kept_add(char *base, size_t size, int fd) {
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
    sl->live = SLAB_LIVE;
    sl->maker = 0;
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
int allocate_meta(Idx *s, uint64_t csize, uint32_t *slot, uint32_t *chunk) {
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

/* a new slab's size in chunks of csize, where the capacity allows (0: no room), and
 * the table slot it takes (under the lock) */
static uint64_t slab_plan(Idx *s, uint64_t csize, uint32_t *slot) {
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
    *slot = free_slab_slot(h);
    return *slot == MAX_SLABS ? 0 : n;
}

/* a new slab's file, of at least *n and at most `most` chunks of csize: a pooled file
 * first (its pages are there; *n becomes the chunks it holds, *kept_map this process's
 * kept mapping of it, if any), else a new file, allocated whole (*fresh). Touches no
 * shared state: it runs in the lock or outside it. 0, or -1 (errno) */
static int slab_file(Idx *s, uint32_t slot, uint32_t gen, uint64_t csize, uint64_t *n,
                     uint64_t most, int *fresh, char **kept_map, int *kept_fd) {
    char path[4096];
    slab_path(s, slot, gen, path, sizeof path);
    *kept_map = NULL;
    *kept_fd = -1;
    size_t got = claim_pooled(s, path, (size_t)(csize * *n), (size_t)(csize * most), csize,
                              kept_map, kept_fd);
    *fresh = got == 0;
    if (got) {
        *n = got / csize;
        return 0;
    }
    int fd = create_file(path, (size_t)(csize * *n));
    if (fd < 0)
        return -1;
    close(fd);
    return 0;
}

/* this process's mapping of a slab that took a pooled file it kept mapped (under the
 * lock: the slab's slot is this process's to map) */
static void slab_take_map(Idx *s, uint32_t slot, uint32_t gen, size_t size, char *map,
                          int fd) {
    unmap_slab(s, slot);
    s->maps[slot].base = map;
    s->maps[slot].size = size;
    s->maps[slot].gen = gen;
    s->maps[slot].fd = fd;
}

/* a new slab of chunks of csize where the capacity allows, its file made in the lock:
 * 1, 0 (no room), -1 (errno). A batch makes the slabs it needs outside the lock first
 * (make_slab); this is for what that did not foresee. */
int new_slab(Idx *s, uint64_t csize) {
    hdr_t *h = s->hdr;
    uint32_t slot;
    uint64_t n = slab_plan(s, csize, &slot);
    if (n == 0)
        return 0;
    uint32_t gen = h->slabs[slot].gen + 1;
    uint64_t most = (h->capacity - h->count[C_ARENA_BYTES]) / csize;
    int fresh, kept_fd;
    char *kept_map;
    if (slab_file(s, slot, gen, csize, &n, most, &fresh, &kept_map, &kept_fd) < 0)
        return -1;
    if (kept_map != NULL)
        slab_take_map(s, slot, gen, (size_t)(csize * n), kept_map, kept_fd);
    init_slab(h, slot, csize, n, fresh, 0);
    return 1;
}

/* (under the lock) a new slab of chunks of csize made with the lock let go: its slot
 * is taken as SLAB_MAKING and its bytes counted in the arena, then the file is made
 * outside the lock (allocating a fresh slab's pages is the I/O of a filling arena:
 * 40-50 ms for 64 MiB of tmpfs, which no lookup, read or other writer should wait for),
 * and the slab goes live under the lock again. Returns with the lock held: 1 (a slab
 * made), 0 (no room, or its file could not be made: the caller's allocation tries in
 * the lock and reports why), or -1 (the lock could not be taken again: damage,
 * unlocked). */
int make_slab(Idx *s, uint64_t csize) {
    hdr_t *h = s->hdr;
    uint32_t slot;
    uint64_t n = slab_plan(s, csize, &slot);
    if (n == 0)
        return 0;
    uint32_t me = (uint32_t)s->slot + 1;
    init_slab(h, slot, csize, n, 1, 0); /* counted now: two makers never pass the capacity */
    slab_t *sl = &h->slabs[slot];
    sl->live = SLAB_MAKING;
    sl->maker = me;
    uint32_t gen = sl->gen;
    unlock(s);
    int fresh, kept_fd;
    char *kept_map;
    uint64_t got = n;
    int made = slab_file(s, slot, gen, csize, &got, n, &fresh, &kept_map, &kept_fd) == 0;
    FAULT("slab.made");
    int locked = lock(s) == 0;
    sl = &h->slabs[slot];
    /* not ours any more where it is not as we left it: only damage repaired meanwhile */
    int ours = locked && sl->live == SLAB_MAKING && sl->maker == me && sl->gen == gen;
    if (made && kept_map != NULL && !ours) {
        munmap(kept_map, (size_t)(csize * n));
        close(kept_fd);
    }
    if (!locked)
        return -1;
    if (!ours)
        return 0;
    if (!made) {
        drop_making(s, slot);
        return 0;
    }
    if (kept_map != NULL)
        slab_take_map(s, slot, gen, (size_t)(csize * n), kept_map, kept_fd);
    sl->fresh = (uint32_t)fresh;
    sl->maker = 0;
    sl->live = SLAB_LIVE;
    return 1;
}

/* (under the lock) a slab a dead process was making: its file removed, its bytes given
 * back to the arena */
void drop_making(Idx *s, uint32_t slot) {
    hdr_t *h = s->hdr;
    slab_t *sl = &h->slabs[slot];
    char path[4096];
    slab_path(s, slot, sl->gen, path, sizeof path);
    unlink(path);
    uint64_t bytes = slab_ok(h, sl) ? sl->csize * sl->nchunks : 0;
    h->count[C_ARENA_BYTES] -= bytes < h->count[C_ARENA_BYTES] ? bytes
                                                               : h->count[C_ARENA_BYTES];
    sl->live = SLAB_FREE;
    sl->maker = 0;
}

int drop_empty_slab(Idx *s, uint64_t keep) {
    hdr_t *h = s->hdr;
    for (uint32_t i = 0; i < h->nslabs; i++) {
        slab_t *sl = &h->slabs[i];
        if (sl->live == SLAB_LIVE && sl->used == 0 && sl->csize != keep && !sl->meta) {
            char path[4096];
            slab_path(s, i, sl->gen, path, sizeof path);
            unmap_slab(s, i);
            unlink(path); /* readers' mappings keep their pages */
            h->count[C_ARENA_BYTES] -= sl->csize * sl->nchunks;
            h->count[C_SLAB_DROPS]++;
            sl->live = SLAB_FREE;
            return 1;
        }
    }
    return 0;
}

/* ---------------------------------------------------------------------------------- */
/* spill files */

/* kept_maps(prune=True) -> (mappings, bytes, kept, reused): this process's kept
 * mappings of pooled slab files (kept_t) after closing those of files gone, and how many
 * were ever kept and taken back by a new slab */
PyObject *py_kept_maps(PyObject *self, PyObject *args) {
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
