/* The recorder's hot path in C: its per-call core and the hook wrapper (overshoot/record/hotpath.py builds it).

On a lent H200 host one busy begin/end pair cost 0.68 us in Python and a hooked step ~21 us, 0.9% of a
2.4 ms synchronous graph step: the per-call Python frames, not the clock (65 ns a read), were the cost; each
Python call cost 1-3 us inside the real step, several times its cost in a tight loop.
Here a span costs two clock reads and a few list stores, and a hooked step no Python frame of the recorder's.

- RecorderCore: the base type of Recorder. Its fields are the span stack, the open step, the span, step and
  GPU buffers, the flush timing and the CUDA ring's slot, which the Python recorder also reads and writes (as
  attributes `_depth`, `_s_start`, `_ring`, ...: the same objects, so either side may do any step). Its
  methods are record/core.py's, line for line: busy_begin / wait_begin / _end (busy_end, wait_end,
  idle_end), step_begin, step_facts, _boundary, gpu_begin, gpu_end. What runs seldom (a flush, spans split at
  a boundary, creating the ring, kernel timing's window switches) they call in Python. The ring's acquire and
  commit are CudaEventRing's (record/cuda_events.py), done on its attributes.
- Scope: `with rec.busy(label)` / `with rec.wait(label)` over the same calls.
- Hooked: the wrapper engine_hooks puts around an engine function. Per call: this thread's recorder (the
  threading.local `_tls` of engine_hooks.wrappers, read each call since a fork replaces it), step / idle /
  busy / wait / GPU begins, the call, the ends in reverse order, then the step's facts from the result (a
  dict, read without building keyword arguments). With GPU timing off or no CUDA the engine's stream is not
  looked up. Recorder failures go to Python callbacks that turn recording off; the engine's call always runs.
*/
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <string.h>
#include <time.h>

static PyObject *BUSY, *WAIT, *IDLE, *GPU_LABEL;        /* the kind strings of record/scopes.py */
static long long MAX_DEPTH = 64;
/* record/core.py's constants (configure() sets them) */
static long long WORK_IN_WAIT_NS = 200000, RESOLVE_WORK = 1, FLUSH_WORK = 2;
static double FLUSH_IN_WAIT_MARGIN = 1.25;
static PyObject *FIXED[3];                              /* batch_size, num_tokens, phase: the step's columns */
static PyObject *clock_override;                        /* tests: a fake clock; NULL: CLOCK_MONOTONIC */
static PyTypeObject *fast_type;                         /* Recorder: span calls on it skip method lookup */
static PyObject *s_flush, *s_work_in_wait, *s_step_begin, *s_idle_begin, *s_gpu_begin, *s_gpu_end,
    *s_step_facts, *s_busy_begin, *s_wait_begin, *s_busy_end, *s_wait_end, *s_idle_end, *s_tls, *s_rec,
    *s_write_head, *s_resolve_head, *s_size, *s_dropped, *s_slot_step, *s_record, *s_begin_events,
    *s_end_events, *s_at_step, *s_start_step, *s_end_step, *s_flush_between_steps, *s_init_gpu,
    *s_flush_detached, *empty_tuple, *ended_kwnames;

/* time.perf_counter_ns() reads CLOCK_MONOTONIC on Linux: the spans' times and Python's are one clock. */
static int now_ns(long long *t) {
    if (clock_override != NULL) {
        PyObject *r = PyObject_CallNoArgs(clock_override);
        if (r == NULL) return -1;
        *t = PyLong_AsLongLong(r);
        Py_DECREF(r);
        return (*t == -1 && PyErr_Occurred()) ? -1 : 0;
    }
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    *t = (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
    return 0;
}

static PyObject *fetch_exception(void) {   /* the pending exception as an instance (cleared) */
#if PY_VERSION_HEX >= 0x030C0000
    return PyErr_GetRaisedException();
#else
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    if (type == NULL) return NULL;
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb != NULL && value != NULL) PyException_SetTraceback(value, tb);
    Py_XDECREF(type);
    Py_XDECREF(tb);
    return value;
#endif
}

static void restore_exception(PyObject *exc) {   /* steals exc */
#if PY_VERSION_HEX >= 0x030C0000
    PyErr_SetRaisedException(exc);
#else
    if (exc == NULL) return;
    PyObject *type = Py_NewRef((PyObject *)Py_TYPE(exc));
    PyErr_Restore(type, exc, PyException_GetTraceback(exc));
#endif
}

/* ---- RecorderCore ---- */

typedef struct {
    PyObject_HEAD
    /* the span stack and the span buffer */
    long long depth, wait_depth, wait_start, step, step_wait, n_spans, spans_cap, wait_work;
    PyObject *st_kind, *st_label, *st_start, *p_step, *p_kind, *p_label, *p_start, *p_dur;
    /* the open step and the step buffer */
    long long next_step, step_start, n_steps, steps_cap, soft_steps, soft_spans, steps_recorded;
    PyObject *batch, *tokens, *phase, *facts, *s_step, *s_start, *s_end, *s_wait, *s_batch, *s_tokens, *s_phase,
        *s_facts;
    /* flush timing */
    long long flush_ns, last_flush_ns, flush_interval_ns;
    /* GPU: host-clock intervals, the CUDA ring's slot of the open step, kernel timing's sampler, NVTX */
    long long n_gpu, gpu_t0, gpu_t1, gpu_slot;
    char gpu_ended, gpu_detached;
    PyObject *g_step, *g_start, *g_end, *ring, *sampler, *nvtx, *nvtx_step;
} RecorderCore;

static int set_item(PyObject *list, long long i, PyObject *value) {   /* steals value */
    if (value == NULL) return -1;
    if (list == NULL || !PyList_Check(list) || i < 0 || i >= PyList_GET_SIZE(list)) {
        Py_DECREF(value);
        PyErr_SetString(PyExc_IndexError, "overshoot recorder: buffer index out of range");
        return -1;
    }
    PyObject *old = PyList_GET_ITEM(list, i);
    PyList_SET_ITEM(list, i, value);
    Py_XDECREF(old);
    return 0;
}

static int set_obj(PyObject *list, long long i, PyObject *value) {
    Py_INCREF(value);
    return set_item(list, i, value);
}

/* column[i] = v: the recorder's int64 buffers (memoryviews of format "q", recorder.int_buffer) take the 8
   bytes, no int object (a list slot allocates one and frees the one written a buffer's length ago, memory
   long out of the cache inside a real engine's step); any other column (a list) the int. */
static int set_ll(PyObject *column, long long i, long long v) {
    if (column != NULL && PyMemoryView_Check(column)) {
        Py_buffer *b = PyMemoryView_GET_BUFFER(column);
        if (b->buf == NULL || b->readonly || b->itemsize != 8 || b->ndim != 1 || b->format == NULL ||
            strcmp(b->format, "q") != 0 || (b->strides != NULL && b->strides[0] != 8) || i < 0 ||
            i >= b->len / 8) {
            PyErr_SetString(PyExc_IndexError, "overshoot recorder: int64 buffer index out of range");
            return -1;
        }
        ((long long *)b->buf)[i] = v;
        return 0;
    }
    return set_item(column, i, PyLong_FromLongLong(v));
}

static PyObject *get_item(PyObject *list, long long i) {   /* borrowed */
    if (list == NULL || !PyList_Check(list) || i < 0 || i >= PyList_GET_SIZE(list)) {
        PyErr_SetString(PyExc_IndexError, "overshoot recorder: index out of range");
        return NULL;
    }
    return PyList_GET_ITEM(list, i);
}

static int call_method(PyObject *self, PyObject *name) {   /* self.name(), its result dropped */
    PyObject *r = PyObject_CallMethodNoArgs(self, name);
    if (r == NULL) return -1;
    Py_DECREF(r);
    return 0;
}

static int call_method_one(PyObject *self, PyObject *name, PyObject *arg) {   /* self.name(arg), the same */
    PyObject *r = PyObject_CallMethodOneArg(self, name, arg);
    if (r == NULL) return -1;
    Py_DECREF(r);
    return 0;
}

static int span_busy_begin(RecorderCore *s, PyObject *label) {
    long long d = s->depth;
    s->depth = d + 1;
    if (d >= MAX_DEPTH) return 0;   /* deeper than the stack: counted, not recorded */
    long long t;
    if (set_obj(s->st_label, d, label) < 0 || set_obj(s->st_kind, d, BUSY) < 0 || now_ns(&t) < 0) return -1;
    return set_item(s->st_start, d, PyLong_FromLongLong(t));
}

static int span_wait_begin(RecorderCore *s, PyObject *label) {
    long long t;
    if (now_ns(&t) < 0) return -1;
    long long d = s->depth;
    s->depth = d + 1;
    if (d >= MAX_DEPTH) return 0;
    if (set_obj(s->st_label, d, label) < 0 || set_obj(s->st_kind, d, WAIT) < 0 ||
        set_item(s->st_start, d, PyLong_FromLongLong(t)) < 0) return -1;
    if (!s->wait_depth) {
        s->wait_start = t;
        if (s->wait_work && call_method((PyObject *)s, s_work_in_wait) < 0) return -1;
    }
    s->wait_depth += 1;
    return 0;
}

static int span_end(RecorderCore *s) {
    long long t;
    if (now_ns(&t) < 0) return -1;
    long long d = s->depth - 1;
    if (d < 0) return 0;   /* unmatched end: ignored rather than raised inside the engine */
    s->depth = d;
    if (d >= MAX_DEPTH) return 0;
    PyObject *kind = get_item(s->st_kind, d), *label = get_item(s->st_label, d), *start_obj = get_item(s->st_start, d);
    if (kind == NULL || label == NULL || start_obj == NULL) return -1;
    long long start = PyLong_AsLongLong(start_obj);
    if (start == -1 && PyErr_Occurred()) return -1;
    long long step = s->step;
    if (kind == WAIT) {
        s->wait_depth -= 1;
        if (!s->wait_depth && step >= 0) s->step_wait += t - s->wait_start;
    } else if (kind == IDLE) {
        step = -1;
    }
    long long n = s->n_spans;
    if (set_ll(s->p_step, n, step) < 0 || set_obj(s->p_kind, n, kind) < 0 || set_obj(s->p_label, n, label) < 0 ||
        set_ll(s->p_start, n, start) < 0 || set_ll(s->p_dur, n, t - start) < 0) return -1;
    s->n_spans = n + 1;
    if (n + 1 >= s->spans_cap) return call_method((PyObject *)s, s_flush);
    return 0;
}

/* ---- steps, step facts, the CUDA event calls ---- */

#define NZ(o) ((o) != NULL ? (o) : Py_None)   /* an object field, None while unset */


static int as_ll(PyObject *r, long long *out) {   /* steals r */
    if (r == NULL) return -1;
    *out = PyLong_AsLongLong(r);
    Py_DECREF(r);
    return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

static int get_ll_attr(PyObject *o, PyObject *name, long long *out) { return as_ll(PyObject_GetAttr(o, name), out); }

static int set_ll_attr(PyObject *o, PyObject *name, long long v) {
    PyObject *x = PyLong_FromLongLong(v);
    if (x == NULL) return -1;
    int rc = PyObject_SetAttr(o, name, x);
    Py_DECREF(x);
    return rc;
}

static int call_ll(PyObject *self, PyObject *name, long long arg, long long *out) {   /* out = self.name(arg) */
    PyObject *a = PyLong_FromLongLong(arg);
    if (a == NULL) return -1;
    PyObject *r = PyObject_CallMethodOneArg(self, name, a);
    Py_DECREF(a);
    return as_ll(r, out);
}

static int truthy(PyObject *o) { return o == NULL || o == Py_None || o == Py_False ? 0 : PyObject_IsTrue(o); }

/* CudaEventRing.acquire and .commit (record/cuda_events.py), line for line, on its attributes. */
static int ring_heads(PyObject *ring, long long *write_head, long long *resolve_head, long long *size) {
    if (get_ll_attr(ring, s_write_head, write_head) < 0 || get_ll_attr(ring, s_resolve_head, resolve_head) < 0 ||
        get_ll_attr(ring, s_size, size) < 0) return -1;
    if (*size <= 0 || *write_head < 0) {
        PyErr_SetString(PyExc_ValueError, "overshoot CUDA event ring: bad size or head");
        return -1;
    }
    return 0;
}

static int ring_acquire(PyObject *ring, long long *slot) {
    long long write_head, resolve_head, size, dropped;
    if (ring_heads(ring, &write_head, &resolve_head, &size) < 0) return -1;
    if (write_head - resolve_head >= size) {
        if (set_ll_attr(ring, s_resolve_head, resolve_head + 1) < 0 || get_ll_attr(ring, s_dropped, &dropped) < 0 ||
            set_ll_attr(ring, s_dropped, dropped + 1) < 0) return -1;
    }
    *slot = write_head % size;
    return 0;
}

static int ring_commit(PyObject *ring, long long slot, long long step) {
    PyObject *slot_step = PyObject_GetAttr(ring, s_slot_step);
    if (slot_step == NULL) return -1;
    int rc = set_ll(slot_step, slot, step);
    Py_DECREF(slot_step);
    long long write_head;
    if (rc < 0 || get_ll_attr(ring, s_write_head, &write_head) < 0) return -1;
    return set_ll_attr(ring, s_write_head, write_head + 1);
}

/* ring.record(events[slot], stream), or events[slot].record() on the current stream when stream is None. */
static int ring_record(PyObject *ring, PyObject *events_name, long long slot, PyObject *stream) {
    PyObject *events = PyObject_GetAttr(ring, events_name);
    if (events == NULL) return -1;
    PyObject *event = get_item(events, slot), *r = NULL;
    if (event != NULL) {
        Py_INCREF(event);
        if (stream == Py_None) {
            r = PyObject_CallMethodNoArgs(event, s_record);
        } else {
            PyObject *record = PyObject_GetAttr(ring, s_record);
            if (record != NULL) {
                PyObject *argv[2] = {event, stream};
                r = PyObject_Vectorcall(record, argv, 2, NULL);
                Py_DECREF(record);
            }
        }
        Py_DECREF(event);
    }
    Py_DECREF(events);
    if (r == NULL) return -1;
    Py_DECREF(r);
    return 0;
}

/* sampler.at_step(t, batch_size, phase[, ended=(phase, batch)]): the time the step starts. */
static int sampler_at_step(PyObject *sampler, long long t, PyObject *batch, PyObject *phase, PyObject *ended,
                           long long *out) {
    PyObject *tobj = PyLong_FromLongLong(t);
    if (tobj == NULL) return -1;
    Py_INCREF(sampler);
    PyObject *argv[5] = {sampler, tobj, batch, phase, ended};
    PyObject *r = PyObject_VectorcallMethod(s_at_step, argv, 4 | PY_VECTORCALL_ARGUMENTS_OFFSET,
                                            ended != NULL ? ended_kwnames : NULL);
    Py_DECREF(sampler);
    Py_DECREF(tobj);
    return out != NULL ? as_ll(r, out) : (r == NULL ? -1 : (Py_DECREF(r), 0));
}

static int core_boundary(RecorderCore *s, long long t, long long *out) {
    *out = t;
    long long old = s->step;
    if (s->wait_depth) {
        if (old >= 0) s->step_wait += t - s->wait_start;
        s->wait_start = t;
    }
    if (s->depth) {
        PyObject *r = PyObject_CallMethod((PyObject *)s, "_split_open_spans", "LL", old, t);
        if (r == NULL) return -1;
        Py_DECREF(r);
    }
    if (old < 0) return 0;
    long long n = s->n_steps, waited = s->step_wait;
    if (set_ll(s->s_step, n, old) < 0 || set_ll(s->s_start, n, s->step_start) < 0 || set_ll(s->s_end, n, t) < 0 ||
        set_ll(s->s_wait, n, waited) < 0 || set_obj(s->s_batch, n, NZ(s->batch)) < 0 ||
        set_obj(s->s_tokens, n, NZ(s->tokens)) < 0 || set_obj(s->s_phase, n, NZ(s->phase)) < 0 ||
        set_obj(s->s_facts, n, NZ(s->facts)) < 0) return -1;
    if (s->gpu_t0 >= 0) {
        long long g = s->n_gpu;
        if (set_ll(s->g_step, g, old) < 0 || set_ll(s->g_start, g, s->gpu_t0) < 0 || set_ll(s->g_end, g, s->gpu_t1) < 0)
            return -1;
        s->n_gpu = g + 1;
        s->gpu_t0 = s->gpu_t1 = -1;
    }
    if (s->gpu_slot >= 0) {
        if (s->gpu_ended && ring_commit(NZ(s->ring), s->gpu_slot, old) < 0) return -1;
        s->gpu_slot = -1;
        s->gpu_ended = s->gpu_detached = 0;
    }
    s->n_steps = n + 1;
    s->step = -1;
    s->steps_recorded += 1;
    if (s->nvtx != NULL && s->nvtx != Py_None && call_method_one(s->nvtx, s_end_step, NZ(s->nvtx_step)) < 0)
        return -1;
    int long_wait = waited >= WORK_IN_WAIT_NS;
    int full = n + 1 >= s->steps_cap;   /* (a full span buffer flushes itself, in span_end) */
    int timed_out = t - s->last_flush_ns >= s->flush_interval_ns;
    if (full || timed_out || n + 1 >= s->soft_steps || s->n_spans >= s->soft_spans) {
        if (!full && long_wait && (double)waited >= FLUSH_IN_WAIT_MARGIN * (double)s->flush_ns) {
            s->wait_work = FLUSH_WORK;
            return 0;
        }
        if (full || timed_out) {
            s->wait_work = 0;
            return call_ll((PyObject *)s, s_flush_between_steps, t, out);
        }
    }
    int ring = long_wait ? truthy(s->ring) : 0;
    if (ring < 0) return -1;
    s->wait_work = ring ? RESOLVE_WORK : 0;
    return 0;
}

/* The keyword names of step_begin / step_facts that are columns; the rest are the step's extra facts. */
static int fixed_index(PyObject *name) {
    for (int k = 0; k < 3; k++)
        if (name == FIXED[k]) return k;
    for (int k = 0; k < 3; k++)
        if (PyUnicode_Check(name) && PyUnicode_Compare(name, FIXED[k]) == 0) return k;
    return -1;
}

static int add_fact(PyObject *fixed[3], int given, PyObject **extras, PyObject *name, PyObject *value) {
    if (!PyUnicode_Check(name)) {
        PyErr_SetString(PyExc_TypeError, "step facts must be named by strings");
        return -1;
    }
    int k = fixed_index(name);
    if (k >= 0) {
        if (k < given) {
            PyErr_Format(PyExc_TypeError, "got multiple values for argument '%U'", name);
            return -1;
        }
        fixed[k] = value;
        return 0;
    }
    if (*extras == NULL && (*extras = PyDict_New()) == NULL) return -1;
    return PyDict_SetItem(*extras, name, value);
}

/* (batch_size=None, num_tokens=None, phase=None, **facts) -> fixed (borrowed), extras (a new dict or NULL) */
static int parse_facts(PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames, PyObject *fixed[3],
                       PyObject **extras) {
    fixed[0] = fixed[1] = fixed[2] = Py_None;
    *extras = NULL;
    if (nargs > 3) {
        PyErr_SetString(PyExc_TypeError, "takes at most 3 positional arguments (batch_size, num_tokens, phase)");
        return -1;
    }
    for (Py_ssize_t i = 0; i < nargs; i++) fixed[i] = args[i];
    Py_ssize_t nkw = kwnames != NULL ? PyTuple_GET_SIZE(kwnames) : 0;
    for (Py_ssize_t j = 0; j < nkw; j++) {
        if (add_fact(fixed, (int)nargs, extras, PyTuple_GET_ITEM(kwnames, j), args[nargs + j]) < 0) {
            Py_CLEAR(*extras);
            return -1;
        }
    }
    return 0;
}

static int core_step_begin(RecorderCore *s, PyObject *fixed[3], PyObject *extras) {   /* steals extras */
    long long t;
    if (now_ns(&t) < 0 || ((s->step >= 0 || s->depth) && core_boundary(s, t, &t) < 0)) goto fail;
    long long step = s->step = s->next_step;
    s->next_step = step + 1;
    if (s->sampler != NULL && s->sampler != Py_None) {   /* kernel timing windows open and close here */
        PyObject *ended = PyTuple_Pack(2, NZ(s->phase), NZ(s->batch));
        if (ended == NULL) goto fail;
        int rc = sampler_at_step(s->sampler, t, fixed[0], fixed[2], ended, &t);
        Py_DECREF(ended);
        if (rc < 0) goto fail;
    }
    s->step_start = t;
    s->step_wait = 0;
    Py_XSETREF(s->batch, Py_NewRef(fixed[0]));
    Py_XSETREF(s->tokens, Py_NewRef(fixed[1]));
    Py_XSETREF(s->phase, Py_NewRef(fixed[2]));
    Py_XSETREF(s->facts, extras != NULL ? extras : Py_NewRef(Py_None));
    if (s->nvtx != NULL && s->nvtx != Py_None) {
        PyObject *n = PyLong_FromLongLong(step);
        PyObject *r = n != NULL ? PyObject_CallMethodOneArg(s->nvtx, s_start_step, n) : NULL;
        Py_XDECREF(n);
        if (r == NULL) return -1;
        Py_XSETREF(s->nvtx_step, r);
    }
    return 0;
fail:
    Py_XDECREF(extras);
    return -1;
}

static int core_step_facts(RecorderCore *s, PyObject *fixed[3], PyObject *extras) {   /* steals extras */
    if (s->step < 0) {   /* no-op outside a step */
        Py_XDECREF(extras);
        return 0;
    }
    if (fixed[0] != Py_None) Py_XSETREF(s->batch, Py_NewRef(fixed[0]));
    if (fixed[1] != Py_None) Py_XSETREF(s->tokens, Py_NewRef(fixed[1]));
    if (fixed[2] != Py_None) Py_XSETREF(s->phase, Py_NewRef(fixed[2]));
    if (extras == NULL) return 0;
    int merge = truthy(s->facts);
    if (merge < 0) goto fail;
    if (merge) {   /* {**facts, **extras}: a new dict, as the step rows already written may hold the old one */
        PyObject *merged = PyDict_New();
        if (merged == NULL || PyDict_Merge(merged, s->facts, 1) < 0 || PyDict_Update(merged, extras) < 0) {
            Py_XDECREF(merged);
            goto fail;
        }
        Py_DECREF(extras);
        extras = merged;
    }
    Py_XSETREF(s->facts, extras);
    return 0;
fail:
    Py_DECREF(extras);
    return -1;
}

/* rec.step_facts(**found) for a dict from a facts function, without building keyword arguments. */
static int core_step_facts_from(RecorderCore *s, PyObject *found) {
    PyObject *fixed[3] = {Py_None, Py_None, Py_None}, *extras = NULL, *key, *value;
    Py_ssize_t pos = 0;
    Py_INCREF(found);   /* the values stay alive while this call holds the dict */
    while (PyDict_Next(found, &pos, &key, &value)) {
        if (add_fact(fixed, 0, &extras, key, value) < 0) {
            Py_XDECREF(extras);
            Py_DECREF(found);
            return -1;
        }
    }
    int rc = core_step_facts(s, fixed, extras);
    Py_DECREF(found);
    return rc;
}

static int core_gpu_begin(RecorderCore *s, PyObject *stream) {
    if (s->gpu_slot >= 0) return 0;
    int ready = truthy(s->ring);
    if (ready < 0) return -1;
    if (!ready) {   /* None: not tried yet (creating the ring imports torch); False: no CUDA */
        if (s->ring == Py_False) return 0;
        PyObject *r = PyObject_CallMethodNoArgs((PyObject *)s, s_init_gpu);
        if (r == NULL) return -1;
        ready = PyObject_IsTrue(r);
        Py_DECREF(r);
        if (ready <= 0) return ready;
    }
    PyObject *ring = Py_NewRef(NZ(s->ring));   /* the calls below may run code that replaces it */
    long long t, slot = 0;
    int rc = 0;
    if (s->step < 0 && s->sampler != NULL && s->sampler != Py_None)
        rc = now_ns(&t) < 0 ? -1 : sampler_at_step(s->sampler, t, Py_None, Py_None, NULL, NULL);
    if (rc == 0) rc = ring_acquire(ring, &slot);
    if (rc == 0) rc = ring_record(ring, s_begin_events, slot, stream);
    Py_DECREF(ring);
    if (rc < 0) return -1;
    s->gpu_slot = slot;
    s->gpu_detached = s->step < 0;
    return 0;
}

static int core_gpu_end(RecorderCore *s, PyObject *stream) {
    long long slot = s->gpu_slot;
    if (slot < 0) return 0;
    PyObject *ring = Py_NewRef(NZ(s->ring));
    int rc = ring_record(ring, s_end_events, slot, stream);
    if (rc == 0) {
        s->gpu_ended = 1;
        if (s->gpu_detached) {   /* no step will end it: commit now */
            s->gpu_slot = -1;
            s->gpu_ended = s->gpu_detached = 0;
            long long write_head, resolve_head, size;
            rc = ring_commit(ring, slot, -1);
            if (rc == 0) rc = ring_heads(ring, &write_head, &resolve_head, &size);
            if (rc == 0 && write_head - resolve_head >= size / 2) rc = call_method((PyObject *)s, s_flush_detached);
        }
    }
    Py_DECREF(ring);
    return rc;
}

/* ---- RecorderCore's methods and type ---- */

static PyObject *done(int rc) {
    if (rc < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *RecorderCore_busy_begin(RecorderCore *s, PyObject *label) { return done(span_busy_begin(s, label)); }

static PyObject *RecorderCore_wait_begin(RecorderCore *s, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs > 1) {
        PyErr_SetString(PyExc_TypeError, "wait_begin(label='gpu') takes at most one argument");
        return NULL;
    }
    return done(span_wait_begin(s, nargs ? args[0] : GPU_LABEL));
}

static PyObject *RecorderCore_end(RecorderCore *s, PyObject *Py_UNUSED(ignored)) { return done(span_end(s)); }

static PyObject *RecorderCore_step_begin(RecorderCore *s, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    PyObject *fixed[3], *extras;
    if (parse_facts(args, PyVectorcall_NARGS(nargsf), kwnames, fixed, &extras) < 0) return NULL;
    return done(core_step_begin(s, fixed, extras));
}

static PyObject *RecorderCore_step_facts(RecorderCore *s, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    PyObject *fixed[3], *extras;
    if (parse_facts(args, PyVectorcall_NARGS(nargsf), kwnames, fixed, &extras) < 0) return NULL;
    return done(core_step_facts(s, fixed, extras));
}

static PyObject *RecorderCore_boundary(RecorderCore *s, PyObject *t_obj) {
    long long t = PyLong_AsLongLong(t_obj);
    if ((t == -1 && PyErr_Occurred()) || core_boundary(s, t, &t) < 0) return NULL;
    return PyLong_FromLongLong(t);
}

static PyObject *RecorderCore_gpu_begin(RecorderCore *s, PyObject *stream) { return done(core_gpu_begin(s, stream)); }

static PyObject *RecorderCore_gpu_end(RecorderCore *s, PyObject *stream) { return done(core_gpu_end(s, stream)); }

#define OBJECT_FIELDS(X) \
    X(st_kind) X(st_label) X(st_start) X(p_step) X(p_kind) X(p_label) X(p_start) X(p_dur) X(batch) X(tokens) \
    X(phase) X(facts) X(s_step) X(s_start) X(s_end) X(s_wait) X(s_batch) X(s_tokens) X(s_phase) X(s_facts) \
    X(g_step) X(g_start) X(g_end) X(ring) X(sampler) X(nvtx) X(nvtx_step)

static int RecorderCore_traverse(RecorderCore *s, visitproc visit, void *arg) {
#define VISIT(field) Py_VISIT(s->field);
    OBJECT_FIELDS(VISIT)
#undef VISIT
    return 0;
}

static int RecorderCore_clear(RecorderCore *s) {
#define CLEAR(field) Py_CLEAR(s->field);
    OBJECT_FIELDS(CLEAR)
#undef CLEAR
    return 0;
}

static void RecorderCore_dealloc(RecorderCore *s) {
    PyObject_GC_UnTrack(s);
    RecorderCore_clear(s);
    Py_TYPE(s)->tp_free((PyObject *)s);
}

static PyObject *RecorderCore_new(PyTypeObject *type, PyObject *Py_UNUSED(args), PyObject *Py_UNUSED(kw)) {
    RecorderCore *s = (RecorderCore *)type->tp_alloc(type, 0);   /* zeroed; Recorder.__init__ sets the rest */
    if (s == NULL) return NULL;
    s->step = s->gpu_slot = s->gpu_t0 = s->gpu_t1 = -1;
#define NONE(field) s->field = Py_NewRef(Py_None);
    OBJECT_FIELDS(NONE)
#undef NONE
    return (PyObject *)s;
}

#define FAST(name, fn, doc) {name, (PyCFunction)(void (*)(void))fn, METH_FASTCALL | METH_KEYWORDS, doc}
static PyMethodDef RecorderCore_methods[] = {
    {"busy_begin", (PyCFunction)RecorderCore_busy_begin, METH_O, "Open a busy span labelled `label`."},
    {"wait_begin", (PyCFunction)(void (*)(void))RecorderCore_wait_begin, METH_FASTCALL,
     "Open a wait span (the thread blocked on GPU results)."},
    {"_end", (PyCFunction)RecorderCore_end, METH_NOARGS, "End the innermost open span (any kind)."},
    {"busy_end", (PyCFunction)RecorderCore_end, METH_NOARGS, "End the innermost open span."},
    {"wait_end", (PyCFunction)RecorderCore_end, METH_NOARGS, "End the innermost open span."},
    {"idle_end", (PyCFunction)RecorderCore_end, METH_NOARGS, "End the innermost open span."},
    FAST("step_begin", RecorderCore_step_begin,
         "step_begin(batch_size=None, num_tokens=None, phase=None, **facts): end the open step, start one."),
    FAST("step_facts", RecorderCore_step_facts, "Set or override facts of the open step (no-op outside a step)."),
    {"_boundary", (PyCFunction)RecorderCore_boundary, METH_O,
     "End the open step at t; maybe flush. Returns the time the next step may start."},
    {"gpu_begin", (PyCFunction)RecorderCore_gpu_begin, METH_O,
     "Record the step's GPU-start CUDA event on `stream` (first call per step only)."},
    {"gpu_end", (PyCFunction)RecorderCore_gpu_end, METH_O,
     "(Re-)record the step's GPU-end CUDA event on `stream`: the last call of the step wins."},
    {NULL}
};

#define LL(name, field) {name, T_LONGLONG, offsetof(RecorderCore, field), 0, NULL}
#define BOOL(name, field) {name, T_BOOL, offsetof(RecorderCore, field), 0, NULL}
#define OBJ(name, field) {name, T_OBJECT_EX, offsetof(RecorderCore, field), 0, NULL}
static PyMemberDef RecorderCore_members[] = {   /* record/core.py's CORE_FIELDS */
    LL("_depth", depth), LL("_wait_depth", wait_depth), LL("_wait_start", wait_start), LL("_step", step),
    LL("_step_wait", step_wait), LL("_n_spans", n_spans), LL("_spans_cap", spans_cap),
    LL("_wait_work", wait_work),
    OBJ("_st_kind", st_kind), OBJ("_st_label", st_label), OBJ("_st_start", st_start), OBJ("_p_step", p_step),
    OBJ("_p_kind", p_kind), OBJ("_p_label", p_label), OBJ("_p_start", p_start), OBJ("_p_dur", p_dur),
    LL("_next_step", next_step), LL("_step_start", step_start), LL("_n_steps", n_steps),
    LL("_steps_cap", steps_cap), LL("_soft_steps", soft_steps), LL("_soft_spans", soft_spans),
    LL("steps_recorded", steps_recorded),
    OBJ("_batch", batch), OBJ("_tokens", tokens), OBJ("_phase", phase), OBJ("_facts", facts),
    OBJ("_s_step", s_step), OBJ("_s_start", s_start), OBJ("_s_end", s_end), OBJ("_s_wait", s_wait),
    OBJ("_s_batch", s_batch), OBJ("_s_tokens", s_tokens), OBJ("_s_phase", s_phase), OBJ("_s_facts", s_facts),
    LL("_flush_ns", flush_ns), LL("_last_flush_ns", last_flush_ns), LL("_flush_interval_ns", flush_interval_ns),
    LL("_n_gpu", n_gpu), OBJ("_g_step", g_step), OBJ("_g_start", g_start), OBJ("_g_end", g_end),
    LL("_gpu_t0", gpu_t0), LL("_gpu_t1", gpu_t1), LL("_gpu_slot", gpu_slot), BOOL("_gpu_ended", gpu_ended),
    BOOL("_gpu_detached", gpu_detached), OBJ("_ring", ring), OBJ("_sampler", sampler), OBJ("_nvtx", nvtx),
    OBJ("_nvtx_step", nvtx_step),
    {NULL}
};

static PyTypeObject RecorderCoreType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "overshoot.record._hot.RecorderCore",
    .tp_basicsize = sizeof(RecorderCore),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "The per-call core of a Recorder (record/core.py in C).",
    .tp_new = RecorderCore_new,
    .tp_dealloc = (destructor)RecorderCore_dealloc,
    .tp_traverse = (traverseproc)RecorderCore_traverse,
    .tp_clear = (inquiry)RecorderCore_clear,
    .tp_methods = RecorderCore_methods,
    .tp_members = RecorderCore_members,
};

/* The span calls on any recorder: in C on a plain Recorder, else through its (overriding) methods. */
static int rec_begin(PyObject *rec, int fast, PyObject *label, int wait) {
    if (fast) return wait ? span_wait_begin((RecorderCore *)rec, label) : span_busy_begin((RecorderCore *)rec, label);
    return call_method_one(rec, wait ? s_wait_begin : s_busy_begin, label);
}

static int rec_end(PyObject *rec, int fast, PyObject *name) {
    return fast ? span_end((RecorderCore *)rec) : call_method(rec, name);
}

/* ---- Scope: `with rec.busy(label)` ---- */

typedef struct {
    PyObject_HEAD
    PyObject *rec;
    PyObject *label;
    int wait;
} Scope;

static PyObject *Scope_enter(Scope *sc, PyObject *Py_UNUSED(ignored)) {
    if (rec_begin(sc->rec, Py_IS_TYPE(sc->rec, fast_type), sc->label, sc->wait) < 0) return NULL;
    Py_INCREF(sc);
    return (PyObject *)sc;
}

static PyObject *Scope_exit(Scope *sc, PyObject *const *Py_UNUSED(args), Py_ssize_t Py_UNUSED(nargs)) {
    if (rec_end(sc->rec, Py_IS_TYPE(sc->rec, fast_type), sc->wait ? s_wait_end : s_busy_end) < 0) return NULL;
    Py_RETURN_FALSE;
}

static int Scope_traverse(Scope *sc, visitproc visit, void *arg) {
    Py_VISIT(sc->rec);
    Py_VISIT(sc->label);
    return 0;
}

static int Scope_clear(Scope *sc) {
    Py_CLEAR(sc->rec);
    Py_CLEAR(sc->label);
    return 0;
}

static void Scope_dealloc(Scope *sc) {
    PyObject_GC_UnTrack(sc);
    Scope_clear(sc);
    Py_TYPE(sc)->tp_free((PyObject *)sc);
}

static PyObject *Scope_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    PyObject *rec, *label;
    int wait;
    static char *names[] = {"rec", "label", "wait", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOp", names, &rec, &label, &wait)) return NULL;
    Scope *sc = (Scope *)type->tp_alloc(type, 0);
    if (sc == NULL) return NULL;
    Py_INCREF(rec);
    Py_INCREF(label);
    sc->rec = rec;
    sc->label = label;
    sc->wait = wait;
    return (PyObject *)sc;
}

static PyObject *Scope_repr(Scope *sc) {
    return PyUnicode_FromFormat("<overshoot %s[%S] scope>", sc->wait ? "wait" : "busy", sc->label);
}

static PyMethodDef Scope_methods[] = {
    {"__enter__", (PyCFunction)Scope_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)(void (*)(void))Scope_exit, METH_FASTCALL, NULL},
    {NULL}
};

static PyTypeObject ScopeType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "overshoot.record._hot.Scope",
    .tp_basicsize = sizeof(Scope),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "Scope(rec, label, wait): the cached `with` object of one busy or wait label.",
    .tp_new = Scope_new,
    .tp_dealloc = (destructor)Scope_dealloc,
    .tp_traverse = (traverseproc)Scope_traverse,
    .tp_clear = (inquiry)Scope_clear,
    .tp_methods = Scope_methods,
    .tp_repr = (reprfunc)Scope_repr,
};

/* ---- Hooked: the wrapper around one engine function ---- */

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *dict;
    PyObject *weakrefs;                  /* like a function: weakref-able (WeakMethod of a hooked method) */
    PyObject *func;
    PyObject *busy_label, *wait_label;   /* None: no such role */
    int step, idle;
    PyObject *stream_of;                 /* the gpu role: stream_of(first argument) -> stream or None */
    PyObject *facts;                     /* facts(result, *args, **kwargs) -> dict of step facts */
    PyObject *attrs;                     /* or these facts' ((name, attribute), ...) of the result (C) */
    PyObject *globals;                   /* engine_hooks.wrappers's namespace: its `_tls` */
    PyObject *open;                      /* open() -> this thread's recorder (or None), on first use */
    PyObject *failed;                    /* failed(exc): recording off in this thread */
    PyObject *facts_failed;              /* facts_failed(exc): logged; facts off */
    PyObject *gpu_failed;                /* gpu_failed(exc): logged; GPU events off */
} Hooked;

static void report(PyObject *callback) {   /* the pending exception to a Python callback */
    PyObject *exc = fetch_exception();
    PyObject *r = PyObject_CallOneArg(callback, exc ? exc : Py_None);
    Py_XDECREF(exc);
    if (r == NULL) PyErr_Clear();   /* measuring must never break the engine */
    Py_XDECREF(r);
}

static PyObject *this_thread_recorder(Hooked *h) {   /* new reference; NULL with an exception set */
    PyObject *tls = PyDict_GetItemWithError(h->globals, s_tls);
    if (tls != NULL) {
        PyObject *rec = PyObject_GetAttr(tls, s_rec);
        if (rec != NULL) return rec;
        if (!PyErr_ExceptionMatches(PyExc_AttributeError)) return NULL;
        PyErr_Clear();
    } else if (PyErr_Occurred()) {
        return NULL;
    }
    return PyObject_CallNoArgs(h->open);
}

static int begin_all(Hooked *h, PyObject *rec, int fast, PyObject *first, PyObject **stream) {
    RecorderCore *core = (RecorderCore *)rec;   /* used only when fast */
    if (h->step) {
        PyObject *none3[3] = {Py_None, Py_None, Py_None};
        if ((fast ? core_step_begin(core, none3, NULL) : call_method(rec, s_step_begin)) < 0) return -1;
    }
    if (h->idle && call_method(rec, s_idle_begin) < 0) return -1;
    if (h->busy_label != Py_None && rec_begin(rec, fast, h->busy_label, 0) < 0) return -1;
    if (h->wait_label != Py_None && rec_begin(rec, fast, h->wait_label, 1) < 0) return -1;
    /* GPU timing off, or no CUDA (the recorder's ring is False): no stream to look up */
    if (h->stream_of != Py_None && !(fast && core->ring == Py_False)) {
        PyObject *stream_of = Py_NewRef(h->stream_of);   /* the call may run code that turns it off */
        PyObject *found = PyObject_CallOneArg(stream_of, first);
        Py_DECREF(stream_of);
        if (found == NULL) {   /* a renamed engine field: GPU events off, the rest goes on */
            report(h->gpu_failed);
            Py_SETREF(h->stream_of, Py_NewRef(Py_None));
        } else if (found == Py_None) {
            Py_DECREF(found);
        } else {
            *stream = found;
            return fast ? core_gpu_begin(core, found) : call_method_one(rec, s_gpu_begin, found);
        }
    }
    return 0;
}

static int end_all(Hooked *h, PyObject *rec, int fast, PyObject *stream) {
    if (stream != NULL &&
        (fast ? core_gpu_end((RecorderCore *)rec, stream) : call_method_one(rec, s_gpu_end, stream)) < 0)
        return -1;
    if (h->wait_label != Py_None && rec_end(rec, fast, s_wait_end) < 0) return -1;
    if (h->busy_label != Py_None && rec_end(rec, fast, s_busy_end) < 0) return -1;
    if (h->idle && rec_end(rec, fast, s_idle_end) < 0) return -1;
    return 0;
}

/* engine_hooks.spec.AttributeFacts: {name: getattr(result, attr) or result itself for ""}; {} for None. */
static PyObject *facts_from_attributes(PyObject *fields, PyObject *result) {
    PyObject *found = PyDict_New();
    if (found == NULL || result == Py_None) return found;
    Py_ssize_t n = PyTuple_GET_SIZE(fields);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *pair = PyTuple_GET_ITEM(fields, i);
        PyObject *attr = PyTuple_GET_ITEM(pair, 1);
        PyObject *value = PyUnicode_GET_LENGTH(attr) ? PyObject_GetAttr(result, attr) : Py_NewRef(result);
        int rc = value != NULL ? PyDict_SetItem(found, PyTuple_GET_ITEM(pair, 0), value) : -1;
        Py_XDECREF(value);
        if (rc < 0) {
            Py_DECREF(found);
            return NULL;
        }
    }
    return found;
}

static void apply_facts(Hooked *h, PyObject *rec, int fast, PyObject *result, PyObject *const *args,
                        size_t nargsf, PyObject *kwnames) {
    PyObject *found;
    if (h->attrs != Py_None) {
        found = facts_from_attributes(h->attrs, result);
    } else {   /* facts(result, *args, **kwargs) */
        Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
        Py_ssize_t total = nargs + (kwnames ? PyTuple_GET_SIZE(kwnames) : 0);
        PyObject *small[9];
        PyObject **call = total < 8 ? small : PyMem_Malloc((total + 1) * sizeof(PyObject *));
        if (call == NULL) {
            PyErr_NoMemory();
            report(h->facts_failed);
            return;
        }
        call[0] = result;
        for (Py_ssize_t i = 0; i < total; i++) call[i + 1] = args[i];
        PyObject *facts = Py_NewRef(h->facts);   /* the call may run code that turns it off */
        found = PyObject_Vectorcall(facts, call, nargs + 1, kwnames);
        Py_DECREF(facts);
        if (call != small) PyMem_Free(call);
    }
    int ok = found != NULL;
    if (ok) {
        int truth = PyObject_IsTrue(found);
        if (truth > 0 && !PyDict_Check(found)) {   /* another mapping: as `**found` would, or TypeError */
            PyObject *copy = PyDict_New();
            if (copy == NULL || PyDict_Merge(copy, found, 1) < 0) {
                Py_CLEAR(copy);
                truth = -1;
            }
            Py_SETREF(found, copy != NULL ? copy : Py_NewRef(Py_None));
        }
        if (truth < 0) {
            ok = 0;
        } else if (truth && fast) {
            ok = core_step_facts_from((RecorderCore *)rec, found) == 0;
        } else if (truth) {
            PyObject *method = PyObject_GetAttr(rec, s_step_facts);
            PyObject *r = method ? PyObject_Call(method, empty_tuple, found) : NULL;
            Py_XDECREF(method);
            ok = r != NULL;
            Py_XDECREF(r);
        }
        Py_DECREF(found);
    }
    if (!ok) {   /* a renamed field in the engine must not break it: these facts go off */
        report(h->facts_failed);
        Py_SETREF(h->facts, Py_NewRef(Py_None));
        Py_SETREF(h->attrs, Py_NewRef(Py_None));
    }
}

static PyObject *Hooked_vectorcall(Hooked *h, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    PyObject *rec = this_thread_recorder(h);
    if (rec == NULL) return NULL;
    if (rec == Py_None) {
        Py_DECREF(rec);
        return PyObject_Vectorcall(h->func, args, nargsf, kwnames);
    }
    int fast = Py_IS_TYPE(rec, fast_type);
    PyObject *stream = NULL;
    PyObject *first = PyVectorcall_NARGS(nargsf) ? args[0] : Py_None;
    if (begin_all(h, rec, fast, first, &stream) < 0) {
        report(h->failed);
        Py_XDECREF(stream);
        Py_DECREF(rec);
        return PyObject_Vectorcall(h->func, args, nargsf, kwnames);
    }
    PyObject *result = PyObject_Vectorcall(h->func, args, nargsf, kwnames);
    PyObject *raised = result == NULL ? fetch_exception() : NULL;
    if (end_all(h, rec, fast, stream) < 0) report(h->failed);
    if (raised != NULL) {
        restore_exception(raised);
    } else if (result != NULL && h->facts != Py_None) {
        apply_facts(h, rec, fast, result, args, nargsf, kwnames);
    }
    Py_XDECREF(stream);
    Py_DECREF(rec);
    return result;
}

static PyObject *Hooked_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    static char *names[] = {"func", "busy", "wait", "step", "idle", "stream_of", "facts", "attrs", "globals",
                            "open", "failed", "facts_failed", "gpu_failed", NULL};
    PyObject *func, *busy = Py_None, *wait = Py_None, *stream_of = Py_None, *facts = Py_None, *attrs = Py_None;
    PyObject *globals = NULL, *open = NULL, *failed = NULL, *facts_failed = NULL, *gpu_failed = NULL;
    int step = 0, idle = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|$OOppOOOO!OOOO", names, &func, &busy, &wait, &step, &idle,
                                     &stream_of, &facts, &attrs, &PyDict_Type, &globals, &open, &failed,
                                     &facts_failed, &gpu_failed))
        return NULL;
    if (!globals || !open || !failed || !facts_failed || !gpu_failed) {
        PyErr_SetString(PyExc_TypeError, "Hooked() needs globals, open, failed, facts_failed and gpu_failed");
        return NULL;
    }
    if (attrs != Py_None) {   /* ((name, attribute), ...), both str: read without checks per call */
        int valid = PyTuple_Check(attrs) && facts != Py_None;
        for (Py_ssize_t i = 0; valid && i < PyTuple_GET_SIZE(attrs); i++) {
            PyObject *pair = PyTuple_GET_ITEM(attrs, i);
            valid = PyTuple_Check(pair) && PyTuple_GET_SIZE(pair) == 2 &&
                    PyUnicode_Check(PyTuple_GET_ITEM(pair, 0)) && PyUnicode_Check(PyTuple_GET_ITEM(pair, 1));
        }
        if (!valid) {
            PyErr_SetString(PyExc_TypeError, "Hooked(attrs=) takes ((name, attribute), ...) of str, with facts");
            return NULL;
        }
    }
    Hooked *h = (Hooked *)type->tp_alloc(type, 0);
    if (h == NULL) return NULL;
    h->vectorcall = (vectorcallfunc)Hooked_vectorcall;
    h->func = Py_NewRef(func);
    h->busy_label = Py_NewRef(busy);
    h->wait_label = Py_NewRef(wait);
    h->step = step;
    h->idle = idle;
    h->stream_of = Py_NewRef(stream_of);
    h->facts = Py_NewRef(facts);
    h->attrs = Py_NewRef(attrs);
    h->globals = Py_NewRef(globals);
    h->open = Py_NewRef(open);
    h->failed = Py_NewRef(failed);
    h->facts_failed = Py_NewRef(facts_failed);
    h->gpu_failed = Py_NewRef(gpu_failed);
    return (PyObject *)h;
}

static int Hooked_traverse(Hooked *h, visitproc visit, void *arg) {
    Py_VISIT(h->dict); Py_VISIT(h->func); Py_VISIT(h->busy_label); Py_VISIT(h->wait_label);
    Py_VISIT(h->stream_of); Py_VISIT(h->facts); Py_VISIT(h->attrs); Py_VISIT(h->globals); Py_VISIT(h->open);
    Py_VISIT(h->failed); Py_VISIT(h->facts_failed); Py_VISIT(h->gpu_failed);
    return 0;
}

static int Hooked_clear(Hooked *h) {
    Py_CLEAR(h->dict); Py_CLEAR(h->func); Py_CLEAR(h->busy_label); Py_CLEAR(h->wait_label);
    Py_CLEAR(h->stream_of); Py_CLEAR(h->facts); Py_CLEAR(h->attrs); Py_CLEAR(h->globals); Py_CLEAR(h->open);
    Py_CLEAR(h->failed); Py_CLEAR(h->facts_failed); Py_CLEAR(h->gpu_failed);
    return 0;
}

static void Hooked_dealloc(Hooked *h) {
    PyObject_GC_UnTrack(h);
    if (h->weakrefs != NULL) PyObject_ClearWeakRefs((PyObject *)h);
    Hooked_clear(h);
    Py_TYPE(h)->tp_free((PyObject *)h);
}

/* A method of the engine's class: bound like a function (with METHOD_DESCRIPTOR, `obj.f()` binds nothing). */
static PyObject *Hooked_get(PyObject *self, PyObject *obj, PyObject *Py_UNUSED(type)) {
    if (obj == NULL || obj == Py_None) return Py_NewRef(self);
    return PyMethod_New(self, obj);
}

static PyObject *Hooked_repr(Hooked *h) {
    return PyUnicode_FromFormat("<overshoot hook of %R>", h->func);
}

/* Pickled by reference, as the function it stands for is: its module and qualified name (copied from the
   wrapped function by functools.update_wrapper) find this very object again. */
static PyObject *Hooked_reduce(PyObject *self, PyObject *Py_UNUSED(ignored)) {
    return PyObject_GetAttrString(self, "__qualname__");
}

static PyMethodDef Hooked_methods[] = {
    {"__reduce__", Hooked_reduce, METH_NOARGS, NULL},
    {NULL}
};

static PyGetSetDef Hooked_getset[] = {
    {"__dict__", PyObject_GenericGetDict, PyObject_GenericSetDict, NULL, NULL},
    {NULL}
};

static PyTypeObject HookedType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "overshoot.record._hot.Hooked",
    .tp_basicsize = sizeof(Hooked),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL |
                Py_TPFLAGS_METHOD_DESCRIPTOR,
    .tp_doc = "An engine function timed by the recorder of the thread that calls it (engine_hooks).",
    .tp_new = Hooked_new,
    .tp_dealloc = (destructor)Hooked_dealloc,
    .tp_traverse = (traverseproc)Hooked_traverse,
    .tp_clear = (inquiry)Hooked_clear,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(Hooked, vectorcall),
    .tp_dictoffset = offsetof(Hooked, dict),
    .tp_weaklistoffset = offsetof(Hooked, weakrefs),
    .tp_methods = Hooked_methods,
    .tp_descr_get = Hooked_get,
    .tp_getattro = PyObject_GenericGetAttr,
    .tp_setattro = PyObject_GenericSetAttr,
    .tp_getset = Hooked_getset,
    .tp_repr = (reprfunc)Hooked_repr,
};

/* ---- module ---- */

static PyObject *configure(PyObject *Py_UNUSED(m), PyObject *args, PyObject *kw) {
    static char *names[] = {"busy", "wait", "idle", "max_depth", "recorder", "work_in_wait_ns", "flush_margin",
                            "resolve", "flush", NULL};
    PyObject *busy = NULL, *wait = NULL, *idle = NULL, *recorder = NULL;
    long long max_depth = -1, work_in_wait = -1, resolve = -1, flush = -1;
    double margin = -1;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|$OOOLO!LdLL", names, &busy, &wait, &idle, &max_depth,
                                     &PyType_Type, &recorder, &work_in_wait, &margin, &resolve, &flush))
        return NULL;
    if (!busy || !wait || !idle || !recorder || max_depth < 0 || work_in_wait < 0 || margin < 0 || resolve < 0 ||
        flush < 0) {
        PyErr_SetString(PyExc_TypeError, "configure() needs busy, wait, idle, max_depth, recorder, "
                                         "work_in_wait_ns, flush_margin, resolve and flush");
        return NULL;
    }
    Py_XSETREF(BUSY, Py_NewRef(busy));
    Py_XSETREF(WAIT, Py_NewRef(wait));
    Py_XSETREF(IDLE, Py_NewRef(idle));
    Py_XSETREF(fast_type, (PyTypeObject *)Py_NewRef(recorder));
    MAX_DEPTH = max_depth;
    WORK_IN_WAIT_NS = work_in_wait;
    FLUSH_IN_WAIT_MARGIN = margin;
    RESOLVE_WORK = resolve;
    FLUSH_WORK = flush;
    Py_RETURN_NONE;
}

static PyObject *set_clock(PyObject *Py_UNUSED(m), PyObject *clock) {
    Py_XSETREF(clock_override, clock == Py_None ? NULL : Py_NewRef(clock));
    Py_RETURN_NONE;
}

static PyObject *clock_ns(PyObject *Py_UNUSED(m), PyObject *Py_UNUSED(ignored)) {
    long long t;
    if (now_ns(&t) < 0) return NULL;
    return PyLong_FromLongLong(t);
}

static PyMethodDef module_methods[] = {
    {"configure", (PyCFunction)(void (*)(void))configure, METH_VARARGS | METH_KEYWORDS,
     "configure(*, busy, wait, idle, max_depth, recorder, work_in_wait_ns, flush_margin, resolve, flush): "
     "record/core.py's constants and the Recorder class."},
    {"set_clock", set_clock, METH_O, "set_clock(callable or None): a fake clock for tests."},
    {"clock_ns", clock_ns, METH_NOARGS, "The spans' clock (perf_counter_ns's) read from C."},
    {NULL}
};

static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_hot", "The recorder's hot path in C.", -1,
                                        module_methods};

PyMODINIT_FUNC PyInit__hot(void) {
#define INTERN(var, text) if ((var = PyUnicode_InternFromString(text)) == NULL) return NULL
    INTERN(s_flush, "flush"); INTERN(s_work_in_wait, "_work_in_wait"); INTERN(s_step_begin, "step_begin");
    INTERN(s_idle_begin, "idle_begin"); INTERN(s_gpu_begin, "gpu_begin"); INTERN(s_gpu_end, "gpu_end");
    INTERN(s_step_facts, "step_facts"); INTERN(s_busy_begin, "busy_begin"); INTERN(s_wait_begin, "wait_begin");
    INTERN(s_busy_end, "busy_end"); INTERN(s_wait_end, "wait_end"); INTERN(s_idle_end, "idle_end");
    INTERN(s_tls, "_tls"); INTERN(s_rec, "rec"); INTERN(GPU_LABEL, "gpu");
    INTERN(BUSY, "busy"); INTERN(WAIT, "wait"); INTERN(IDLE, "idle");
    INTERN(s_write_head, "write_head"); INTERN(s_resolve_head, "resolve_head"); INTERN(s_size, "size");
    INTERN(s_dropped, "dropped"); INTERN(s_slot_step, "slot_step"); INTERN(s_record, "record");
    INTERN(s_begin_events, "begin_events"); INTERN(s_end_events, "end_events"); INTERN(s_at_step, "at_step");
    INTERN(s_start_step, "start_step"); INTERN(s_end_step, "end_step");
    INTERN(s_flush_between_steps, "_flush_between_steps"); INTERN(s_init_gpu, "_init_gpu");
    INTERN(s_flush_detached, "_flush_detached");
    INTERN(FIXED[0], "batch_size"); INTERN(FIXED[1], "num_tokens"); INTERN(FIXED[2], "phase");
#undef INTERN
    if ((empty_tuple = PyTuple_New(0)) == NULL) return NULL;
    if ((ended_kwnames = Py_BuildValue("(s)", "ended")) == NULL) return NULL;
    if (PyType_Ready(&RecorderCoreType) < 0 || PyType_Ready(&ScopeType) < 0 || PyType_Ready(&HookedType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module_def);
    if (m == NULL) return NULL;
    if (PyModule_AddObjectRef(m, "RecorderCore", (PyObject *)&RecorderCoreType) < 0 ||
        PyModule_AddObjectRef(m, "Scope", (PyObject *)&ScopeType) < 0 ||
        PyModule_AddObjectRef(m, "Hooked", (PyObject *)&HookedType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
