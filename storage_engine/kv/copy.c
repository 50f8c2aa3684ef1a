/* The copies of a batch step, outside the lock and the GIL, checksummed in the same pass
 * (copy_hash_one, _stream.c): on the calling thread, or on worker threads for large
 * batches. */
#include "kv.h"

/* the address of a batch entry's chunk, under the lock after slab_check: 0, or -1 (the
 * chunk lies outside the mapping: damage) */
int res_at(Idx *s, res_t *r, uint64_t nbytes) {
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
long ncpus;
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

void workers_atfork_child(void) {
    /* the parent's workers do not exist here */
    nworkers = 0;
    pthread_mutex_init(&workers_mu, NULL);
}

void copy_all(copy_job_t job, Py_ssize_t n) {
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
