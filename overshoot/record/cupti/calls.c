/* overshoot's launch-call recorder: CUPTI's callback API, in C, for the calls that put work on the GPU.

   Why not CUPTI's API activity records: they cover every runtime and driver call (on the H200, 2,770 calls
   a token for 85 kernels of an eager Triton engine, 49,000 for 3,600 kernels of eager torch), each one a
   record CUPTI writes on the engine thread and the drain thread parses; together 6 of the 7.5 points that
   kernel timing cost that engine. A callback enabled for the launch, graph launch, copy and set call ids
   only runs for those (~1 µs a launch, CUPTI's dispatch included).

   The callback runs on the launching thread, inside CUPTI, and never takes the GIL: on entry it pushes
   (correlation id, time) on a per-thread stack; on exit it pops the entry of the same correlation id (a
   runtime launch and the driver launch it makes share one, and only the outer, runtime call is kept) and
   appends a call to a growable array under a mutex held for the append only. The drain thread swaps the array out (ovs_calls_swap) and hands it back
   (ovs_calls_release). An exit whose entry was not seen (callbacks switched on mid-call) is counted, not
   recorded. Times are CLOCK_MONOTONIC, the clock of Python's time.perf_counter_ns(). */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <pthread.h>
#include <time.h>
#include <unistd.h>
#include <sys/syscall.h>

typedef struct {  /* numpy: records.CALL_DTYPE */
  uint32_t cbid, correlation, thread_id, driver;
  int64_t start, end;
} ovs_call;

typedef int (*ovs_enable_fn)(uint32_t enable, void *subscriber, int domain, uint32_t cbid);

#define STACK 16
#define MAX_IDS 128
static __thread struct { uint32_t corr[STACK]; int64_t t[STACK]; int n; uint32_t tid; } tls;

static pthread_mutex_t cmu = PTHREAD_MUTEX_INITIALIZER;
static ovs_call *calls = 0, *spare = 0;
static size_t n_calls = 0, cap_calls = 0, cap_spare = 0, max_calls = (size_t)1 << 22;
static int64_t lost = 0, unpaired = 0;
static ovs_enable_fn enable_fn = 0;
static void *subscriber = 0;
static int ids_domain[MAX_IDS];
static uint32_t ids[MAX_IDS];
static int n_ids = 0;

static int64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* CUpti_CallbackFunc. data is a CUpti_CallbackData: callbackSite (u32) at 0, correlationId (u32) at 64
   (offsetof against cupti_callbacks.h 13.0.85; the same in 12.x). Domain 1: driver API, 2: runtime API. */
void ovs_api_callback(void *userdata, int domain, uint32_t cbid, const void *data) {
  const uint8_t *d = (const uint8_t *)data;
  uint32_t site, corr;
  int64_t t = now_ns();
  (void)userdata;
  memcpy(&site, d, 4);
  memcpy(&corr, d + 64, 4);
  if (site == 0) {  /* CUPTI_API_ENTER */
    if (tls.n == STACK) {  /* stale entries (exits never seen) fill the stack: drop the oldest */
      memmove(tls.corr, tls.corr + 1, (STACK - 1) * sizeof(uint32_t));
      memmove(tls.t, tls.t + 1, (STACK - 1) * sizeof(int64_t));
      tls.n--;
    }
    tls.corr[tls.n] = corr;
    tls.t[tls.n] = t;
    tls.n++;
    return;
  }
  int i = tls.n - 1;
  while (i >= 0 && tls.corr[i] != corr) i--;
  if (i < 0) {
    __atomic_fetch_add(&unpaired, 1, __ATOMIC_RELAXED);
    return;
  }
  int64_t start = tls.t[i];
  tls.n = i;
  /* The driver launch a runtime launch makes carries its correlation id: the runtime call stands for both */
  if (i > 0 && tls.corr[i - 1] == corr) return;
  if (!tls.tid) tls.tid = (uint32_t)syscall(SYS_gettid);
  pthread_mutex_lock(&cmu);
  if (n_calls == cap_calls) {
    size_t nc = cap_calls ? cap_calls * 2 : 65536;
    void *p = nc <= max_calls ? realloc(calls, nc * sizeof(ovs_call)) : 0;
    if (!p) { lost++; pthread_mutex_unlock(&cmu); return; }
    calls = (ovs_call *)p;
    cap_calls = nc;
  }
  calls[n_calls++] = (ovs_call){cbid, corr, tls.tid, domain == 1, start, t};
  pthread_mutex_unlock(&cmu);
}

/* The call ids to switch: (domain, cbid) pairs, and CUPTI's cuptiEnableCallback with the subscriber. */
int ovs_calls_setup(ovs_enable_fn fn, void *sub, const int *domains, const uint32_t *cbids, int n) {
  if (n > MAX_IDS) return -1;
  enable_fn = fn;
  subscriber = sub;
  memcpy(ids_domain, domains, n * sizeof(int));
  memcpy(ids, cbids, n * sizeof(uint32_t));
  n_ids = n;
  return 0;
}

/* Every set-up call id on or off: one C loop, not a ctypes call an id. Returns CUPTI's first error. */
int ovs_calls_switch(int on) {
  int first = 0;
  for (int i = 0; i < n_ids; i++) {
    int rc = enable_fn ? enable_fn(on ? 1 : 0, subscriber, ids_domain[i], ids[i]) : -1;
    if (rc != 0 && first == 0) first = rc;
  }
  return first;
}

/* Hands the calls recorded so far to the caller (who owns them until ovs_calls_release); the recording goes
   on into the spare array, so the lock is held for two pointer swaps, not a copy. */
size_t ovs_calls_swap(ovs_call **out, size_t *capacity) {
  size_t n;
  pthread_mutex_lock(&cmu);
  *out = calls;
  *capacity = cap_calls;
  n = n_calls;
  calls = spare;
  cap_calls = cap_spare;
  spare = 0;
  cap_spare = 0;
  n_calls = 0;
  pthread_mutex_unlock(&cmu);
  return n;
}

void ovs_calls_release(ovs_call *taken, size_t capacity) {
  pthread_mutex_lock(&cmu);
  if (!spare) { spare = taken; cap_spare = capacity; taken = 0; }
  pthread_mutex_unlock(&cmu);
  free(taken);
}

void ovs_calls_stats(int64_t *out) {
  pthread_mutex_lock(&cmu);
  out[0] = lost;
  out[1] = __atomic_load_n(&unpaired, __ATOMIC_RELAXED);
  out[2] = (int64_t)n_calls;
  pthread_mutex_unlock(&cmu);
}
