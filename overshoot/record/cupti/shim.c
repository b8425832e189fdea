/* overshoot's CUPTI shim: activity-buffer and timestamp callbacks in C.

   CUPTI calls the buffer callbacks on its own threads while holding its own lock; a Python callback there
   would take the GIL and can deadlock against an engine thread that holds the GIL and waits on CUPTI. So no
   Python runs inside any CUPTI callback: buffers come from a pool of pre-zeroed ones, full buffers are queued,
   and Python takes them (ovs_take_completed) on its own drain thread, parses them with numpy and recycles
   them. ovs_monotonic_ns is registered as CUPTI's timestamp source: records come out on CLOCK_MONOTONIC,
   the clock of Python's time.perf_counter_ns(). */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <pthread.h>
#include <time.h>
#include <unistd.h>
#include <sys/syscall.h>

typedef int (*ovs_dropped_fn)(void *ctx, uint32_t stream_id, size_t *dropped);
typedef int (*ovs_ts_fn)(uint64_t *ts);

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static size_t buf_size = (size_t)8 << 20;
static uint8_t **free_list = 0; static size_t n_free = 0, cap_free = 0;
static uint8_t **done_buf = 0; static size_t *done_valid = 0;
static size_t n_done = 0, cap_done = 0;
static ovs_dropped_fn dropped_fn = 0;
static int64_t st[12];
enum { S_REQ, S_DONE, S_ALLOC, S_ALLOC_FAIL, S_DROPPED, S_OUTSTANDING, S_REQ_TID,
       S_DONE_TID, S_LOST, S_NULL_DONE, S_DONE_TIDS_DIFFER, S_FIRST_DONE_TID };

static int64_t my_tid(void) { return (int64_t)syscall(SYS_gettid); }

static uint8_t *alloc_zeroed(size_t n) {
  void *p = 0;
  if (posix_memalign(&p, 64, n) != 0) return 0;
  memset(p, 0, n);          /* also pre-faults the pages */
  return (uint8_t *)p;
}

static int push_free(uint8_t *b) {
  if (n_free == cap_free) {
    size_t nc = cap_free ? cap_free * 2 : 16;
    void *p = realloc(free_list, nc * sizeof(*free_list));
    if (!p) return -1;
    free_list = (uint8_t **)p; cap_free = nc;
  }
  free_list[n_free++] = b;
  return 0;
}

uint64_t ovs_monotonic_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* Returns number of free buffers, or -1 if the size can no longer change. */
long ovs_configure(size_t size, size_t prealloc) {
  long r;
  pthread_mutex_lock(&mu);
  if (size != buf_size) {
    if (st[S_OUTSTANDING] != 0 || n_done != 0) { pthread_mutex_unlock(&mu); return -1; }
    for (size_t i = 0; i < n_free; i++) free(free_list[i]);
    n_free = 0; buf_size = size;
  }
  while (n_free < prealloc) {
    uint8_t *b = alloc_zeroed(buf_size);
    if (!b || push_free(b) != 0) { free(b); break; }
    st[S_ALLOC]++;
  }
  r = (long)n_free;
  pthread_mutex_unlock(&mu);
  return r;
}

void ovs_set_dropped_fn(ovs_dropped_fn f) { dropped_fn = f; }

void ovs_buffer_requested(uint8_t **buffer, size_t *size, size_t *max_records) {
  uint8_t *b = 0;
  size_t sz;
  pthread_mutex_lock(&mu);
  sz = buf_size;
  if (n_free) b = free_list[--n_free];
  pthread_mutex_unlock(&mu);
  if (!b) b = alloc_zeroed(sz);   /* slow path: pool exhausted */
  pthread_mutex_lock(&mu);
  st[S_REQ]++;
  st[S_REQ_TID] = my_tid();
  if (b) st[S_OUTSTANDING]++; else st[S_ALLOC_FAIL]++;
  pthread_mutex_unlock(&mu);
  *buffer = b;
  *size = b ? sz : 0;
  *max_records = 0;
}

void ovs_buffer_completed(void *ctx, uint32_t stream_id, uint8_t *buffer,
                          size_t size, size_t valid) {
  size_t dropped = 0;
  int64_t tid = my_tid();
  (void)size;
  if (dropped_fn && dropped_fn(ctx, stream_id, &dropped) != 0) dropped = 0;
  pthread_mutex_lock(&mu);
  st[S_DONE]++;
  st[S_DROPPED] += (int64_t)dropped;
  if (st[S_FIRST_DONE_TID] == 0) st[S_FIRST_DONE_TID] = tid;
  else if (st[S_FIRST_DONE_TID] != tid) st[S_DONE_TIDS_DIFFER] = 1;
  st[S_DONE_TID] = tid;
  if (!buffer) { st[S_NULL_DONE]++; pthread_mutex_unlock(&mu); return; }
  st[S_OUTSTANDING]--;
  if (n_done == cap_done) {
    size_t nc = cap_done ? cap_done * 2 : 64;
    void *p1 = realloc(done_buf, nc * sizeof(*done_buf));
    if (p1) done_buf = (uint8_t **)p1;
    void *p2 = p1 ? realloc(done_valid, nc * sizeof(*done_valid)) : 0;
    if (p2) done_valid = (size_t *)p2;
    if (!p1 || !p2) { st[S_LOST]++; pthread_mutex_unlock(&mu); return; }
    cap_done = nc;
  }
  done_buf[n_done] = buffer;
  done_valid[n_done] = valid;
  n_done++;
  pthread_mutex_unlock(&mu);
}

size_t ovs_take_completed(uint8_t **bufs, size_t *valid, size_t max) {
  size_t n;
  pthread_mutex_lock(&mu);
  n = n_done < max ? n_done : max;
  for (size_t i = 0; i < n; i++) { bufs[i] = done_buf[i]; valid[i] = done_valid[i]; }
  memmove(done_buf, done_buf + n, (n_done - n) * sizeof(*done_buf));
  memmove(done_valid, done_valid + n, (n_done - n) * sizeof(*done_valid));
  n_done -= n;
  pthread_mutex_unlock(&mu);
  return n;
}

size_t ovs_num_completed(void) {
  size_t n;
  pthread_mutex_lock(&mu); n = n_done; pthread_mutex_unlock(&mu);
  return n;
}

size_t ovs_buffer_size(void) { return buf_size; }

void ovs_recycle(uint8_t *buf) {
  memset(buf, 0, buf_size);   /* zeroed buffers: CUPTI need not memset on the app thread */
  pthread_mutex_lock(&mu);
  if (push_free(buf) != 0) free(buf);
  pthread_mutex_unlock(&mu);
}

/* Frees only idle buffers; buffers CUPTI still owns are never freed. */
size_t ovs_release_free(void) {
  size_t n;
  pthread_mutex_lock(&mu);
  n = n_free;
  for (size_t i = 0; i < n_free; i++) free(free_list[i]);
  n_free = 0;
  pthread_mutex_unlock(&mu);
  return n;
}

void ovs_stats(int64_t *out, int n) {
  pthread_mutex_lock(&mu);
  for (int i = 0; i < n && i < 12; i++) out[i] = st[i];
  pthread_mutex_unlock(&mu);
}

/* Tight (monotonic, cupti, monotonic) brackets; fn is cuptiGetTimestamp. */
int ovs_clock_pairs(ovs_ts_fn fn, int n, int64_t *before, uint64_t *cupti, int64_t *after) {
  for (int i = 0; i < n; i++) {
    uint64_t c = 0;
    int64_t b = (int64_t)ovs_monotonic_ns();
    int rc = fn(&c);
    int64_t a = (int64_t)ovs_monotonic_ns();
    if (rc != 0) return rc;
    before[i] = b; cupti[i] = c; after[i] = a;
  }
  return 0;
}

/* Record walk with a kind->size table (kinds < 64).  Returns count, or
   -(pos+1) on an unknown kind / overrun at byte pos. */
long ovs_walk(const uint8_t *buf, size_t valid, const uint32_t *sizes, int n_sizes,
              int64_t *offs, int32_t *kinds, size_t max) {
  size_t pos = 0, n = 0;
  while (pos + 4 <= valid && n < max) {
    uint32_t k;
    memcpy(&k, buf + pos, 4);
    if (k == 0) break;
    if ((int)k >= n_sizes || sizes[k] == 0 || pos + sizes[k] > valid) return -(long)pos - 1;
    offs[n] = (int64_t)pos; kinds[n] = (int32_t)k; n++;
    pos += sizes[k];
  }
  return (long)n;
}

/* One field of every record: `size` bytes at offs[i] + field_off, packed into out (n * size bytes). The
   numpy byte gather this replaces built an index a byte and held the GIL the engine thread needs. */
void ovs_gather(const uint8_t *buf, const int64_t *offs, size_t n, size_t field_off, size_t size,
                uint8_t *out) {
  for (size_t i = 0; i < n; i++) memcpy(out + i * size, buf + offs[i] + field_off, size);
}
