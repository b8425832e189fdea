/* A stand-in libcupti for CPU tests of the collector's GPU-only glue (session.py, collector.py): the
   functions native.Cupti binds, with CUPTI 13.0's record layout (records.CUPTI_13_0) and callback data
   (callbackSite at 0, correlationId at 64). Records go into the buffers the shim hands out and come back
   through its completion callback at a flush; launch callbacks fire on entry and exit of fake_launch.
   Only what the collector uses; checked against the real library on the H200 (cupti_probe.py). */
#include <stdint.h>
#include <string.h>
#include <time.h>

typedef void (*req_fn)(uint8_t **, size_t *, size_t *);
typedef void (*done_fn)(void *, uint32_t, uint8_t *, size_t, size_t);
typedef void (*cb_fn)(void *, int, uint32_t, const void *);
typedef uint64_t (*ts_fn)(void);

static req_fn req; static done_fn done; static cb_fn sub; static ts_fn ts;
static int kind_on[64]; static uint8_t cb_on[3][1024];
static uint8_t *buf; static size_t buf_size, used;
static uint32_t next_corr = 1;

static uint64_t now(void) {
  struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t);
  return ts ? ts() : (uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec;
}
static uint8_t *reserve(size_t n) {
  if (!buf) { size_t max = 0; req(&buf, &buf_size, &max); used = 0; }
  if (!buf || used + n > buf_size) return 0;
  uint8_t *r = buf + used; used += n; return r;
}
static void put32(uint8_t *r, size_t at, uint32_t v) { memcpy(r + at, &v, 4); }
static void put64(uint8_t *r, size_t at, uint64_t v) { memcpy(r + at, &v, 8); }
static void fire(int domain, uint32_t cbid, uint32_t corr, uint32_t site) {
  uint8_t data[72] = {0};
  if (!sub || !cb_on[domain][cbid & 1023]) return;
  put32(data, 0, site); put32(data, 64, corr);
  sub(0, domain, cbid, data);
}

int cuptiGetVersion(uint32_t *v) { *v = 130001; return 0; }
int cuptiGetResultString(int r, const char **s) { (void)r; *s = "fake"; return 0; }
int cuptiGetTimestamp(uint64_t *t) { *t = now(); return 0; }
int cuptiSetThreadIdType(int t) { (void)t; return 0; }
int cuptiActivityEnable(int k) { kind_on[k & 63] = 1; return 0; }
int cuptiActivityDisable(int k) { kind_on[k & 63] = 0; return 0; }
int cuptiActivityEnableRuntimeApi(uint32_t c, uint8_t e) { (void)c; (void)e; return 0; }
int cuptiActivityEnableDriverApi(uint32_t c, uint8_t e) { (void)c; (void)e; return 0; }
int cuptiActivityRegisterCallbacks(req_fn r, done_fn d) { req = r; done = d; return 0; }
int cuptiActivityRegisterTimestampCallback(ts_fn f) { ts = f; return 0; }
int cuptiActivitySetAttribute(int a, size_t *s, void *v) { (void)a; (void)s; (void)v; return 0; }
int cuptiActivityGetNumDroppedRecords(void *c, uint32_t s, size_t *d) { (void)c; (void)s; *d = 0; return 0; }
int cuptiFinalize(void) { return 0; }
int cuptiSubscribe(void **h, cb_fn f, void *u) { (void)u; sub = f; *h = (void *)0x1; return 0; }
int cuptiEnableCallback(uint32_t e, void *h, int d, uint32_t c) { (void)h; cb_on[d & 3][c & 1023] = e; return 0; }
int cuptiActivityFlushAll(uint32_t flag) {
  (void)flag;
  if (buf) { uint8_t *b = buf; size_t n = used; buf = 0; done(0, 0, b, buf_size, n); }
  return 0;
}
int cuptiActivityGetNextRecord(uint8_t *b, size_t valid, uint8_t **rec) {
  size_t at = 0;
  if (*rec) { uint32_t k; memcpy(&k, *rec, 4); at = (size_t)(*rec - b) + (k == 10 ? 216 : 40); }
  if (at >= valid) return 12;  /* CUPTI_ERROR_MAX_LIMIT_REACHED */
  *rec = b + at; return 0;
}

/* A launch through the runtime (cudaLaunchKernel, which calls cuLaunchKernel) or the driver (Triton's
   cuLaunchKernel): callbacks, an API record when API activity is on, a kernel record of 2 us 1 us after
   the call when kernels are on. Returns the correlation id. */
uint32_t fake_launch(int runtime, uint64_t name) {
  uint32_t corr = next_corr++;
  uint64_t t0 = now();
  if (runtime) fire(2, 211, corr, 0);
  fire(1, 307, corr, 0);
  uint64_t t1 = now() + 500;
  fire(1, 307, corr, 1);
  if (runtime) fire(2, 211, corr, 1);
  for (int driver = 0; driver < 2; driver++) {
    if ((!driver && !runtime) || !kind_on[driver ? 4 : 5]) continue;
    uint8_t *a = reserve(40);
    if (a) { put32(a, 0, driver ? 4 : 5); put32(a, 4, driver ? 307 : 211); put64(a, 8, t0);
             put64(a, 16, t1); put32(a, 32, corr); }
  }
  if (kind_on[10]) {
    uint8_t *k = reserve(216);
    if (k) { put32(k, 0, 10); put64(k, 16, t1 + 1000); put64(k, 24, t1 + 3000); put32(k, 48, 7);
             put32(k, 92, corr); put64(k, 104, name); }
  }
  return corr;
}
