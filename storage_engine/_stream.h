/* What the C files of storage_engine._stream share: the one-pass copy + xxh3 of
 * _stream.c, over the vendored xxHash (storage_engine/xxhash). */
#ifndef TENSORDB_STREAM_H
#define TENSORDB_STREAM_H

#include <stddef.h>
#include <stdint.h>

#define HIDDEN __attribute__((visibility("hidden")))

typedef struct { uint64_t low64, high64; } xxh128_t;
typedef xxh128_t (*oneshot128_fn)(const void *, size_t);

/* XXH3 (the vendored xxHash) */
HIDDEN extern oneshot128_fn xxh_oneshot128;
HIDDEN void *xxh_state_new(void);
HIDDEN void xxh_state_free(void *state);
HIDDEN int xxh_bound(void);

/* below STREAM_MIN a copy stays in cache: the caller is likely to touch it again. A
 * batch of STREAM_BATCH bytes or more is streamed whole, block by block from
 * STREAM_BLOCK_MIN up: it outgrows the caches, so that its destination's lines would
 * be read from memory before they are written (a full cache's victims are its coldest
 * lines), and the caller's next touch misses the cache anyway */
#define STREAM_MIN (64 * 1024)
#define STREAM_BATCH (4u << 20)
#define STREAM_BLOCK_MIN 1024

/* copy n bytes from s to d and return the xxh3-64 of s, in one pass (streamed around
 * the cache from stream_min up); fence() once after a run of them */
HIDDEN uint64_t copy_hash_one(void *state, char *d, const char *s, size_t n,
                              size_t stream_min);
/* the xxh3-64 of n bytes at s */
HIDDEN uint64_t hash_only(void *state, const char *s, size_t n);
HIDDEN void fence(void);
/* copy n bytes, streamed around the cache from stream_min up (fenced) */
HIDDEN void stream_copy(char *d, const char *s, size_t n, size_t stream_min);

/* the block index type (kv/module.c), added to the module by its init */
HIDDEN int kvindex_add_type(void *module);

#endif
