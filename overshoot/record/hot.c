/* The recorder's hot path in C: the span stack and the hook wrapper (overshoot/record/hotpath.py builds it).

On a lent H200 host one busy begin/end pair cost 0.68 us in Python and a hooked step ~21 us, 0.9% of a
2.4 ms synchronous graph step: the per-call Python frames, not the clock (65 ns a read), were the cost.
Here a span costs two clock reads and a few list stores, and a hooked call no Python frame of its own.

- SpanStack: the base type of Recorder. Its fields are the span stack and span buffers the Python recorder
  also reads and writes (as attributes `_depth`, `_p_start`, ...: the same objects, so either side may do
  any step); busy_begin / wait_begin / _end (busy_end, wait_end, idle_end) are the methods of
  record/spans.py, line for line.
- Scope: `with rec.busy(label)` / `with rec.wait(label)` over the same calls.
- Hooked: the wrapper engine_hooks puts around an engine function. Per call: this thread's recorder (the
  threading.local `_tls` of engine_hooks.wrappers, read each call since a fork replaces it), step / idle /
  busy / wait / GPU begins, the call, the ends in reverse order, then the step's facts from the result.
  Recorder failures go to Python callbacks that turn recording off; the engine's call always runs.
*/
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <time.h>

static PyObject *BUSY, *WAIT, *IDLE, *GPU_LABEL;        /* the kind strings of record/spans.py */
static long long MAX_DEPTH = 64;
static PyObject *clock_override;                        /* tests: a fake clock; NULL: CLOCK_MONOTONIC */
static PyTypeObject *fast_type;                         /* Recorder: span calls on it skip method lookup */
static PyObject *s_flush, *s_work_in_wait, *s_step_begin, *s_idle_begin, *s_gpu_begin, *s_gpu_end,
    *s_step_facts, *s_busy_begin, *s_wait_begin, *s_busy_end, *s_wait_end, *s_idle_end, *s_tls, *s_rec,
    *empty_tuple;

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

/* ---- SpanStack ---- */

typedef struct {
    PyObject_HEAD
    long long depth, wait_depth, wait_start, step, step_wait, n_spans, spans_cap, wait_work;
    PyObject *st_kind, *st_label, *st_start, *p_step, *p_kind, *p_label, *p_start, *p_dur;
} SpanStack;

static int set_item(PyObject *list, long long i, PyObject *value) {   /* steals value */
    if (value == NULL) return -1;
    if (list == NULL || !PyList_Check(list) || i < 0 || i >= PyList_GET_SIZE(list)) {
        Py_DECREF(value);
        PyErr_SetString(PyExc_IndexError, "overshoot span buffer index out of range");
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

static PyObject *get_item(PyObject *list, long long i) {   /* borrowed */
    if (list == NULL || !PyList_Check(list) || i < 0 || i >= PyList_GET_SIZE(list)) {
        PyErr_SetString(PyExc_IndexError, "overshoot span stack index out of range");
        return NULL;
    }
    return PyList_GET_ITEM(list, i);
}

static int call_method(PyObject *self, PyObject *name) {
    PyObject *r = PyObject_CallMethodNoArgs(self, name);
    if (r == NULL) return -1;
    Py_DECREF(r);
    return 0;
}

static int span_busy_begin(SpanStack *s, PyObject *label) {
    long long d = s->depth;
    s->depth = d + 1;
    if (d >= MAX_DEPTH) return 0;   /* deeper than the stack: counted, not recorded */
    long long t;
    if (set_obj(s->st_label, d, label) < 0 || set_obj(s->st_kind, d, BUSY) < 0 || now_ns(&t) < 0) return -1;
    return set_item(s->st_start, d, PyLong_FromLongLong(t));
}

static int span_wait_begin(SpanStack *s, PyObject *label) {
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

static int span_end(SpanStack *s) {
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
    if (set_item(s->p_step, n, PyLong_FromLongLong(step)) < 0 || set_obj(s->p_kind, n, kind) < 0 ||
        set_obj(s->p_label, n, label) < 0 || set_item(s->p_start, n, PyLong_FromLongLong(start)) < 0 ||
        set_item(s->p_dur, n, PyLong_FromLongLong(t - start)) < 0) return -1;
    s->n_spans = n + 1;
    if (n + 1 >= s->spans_cap) return call_method((PyObject *)s, s_flush);
    return 0;
}

static PyObject *done(int rc) {
    if (rc < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *SpanStack_busy_begin(SpanStack *s, PyObject *label) { return done(span_busy_begin(s, label)); }

static PyObject *SpanStack_wait_begin(SpanStack *s, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs > 1) {
        PyErr_SetString(PyExc_TypeError, "wait_begin(label='gpu') takes at most one argument");
        return NULL;
    }
    return done(span_wait_begin(s, nargs ? args[0] : GPU_LABEL));
}

static PyObject *SpanStack_end(SpanStack *s, PyObject *Py_UNUSED(ignored)) { return done(span_end(s)); }

static int SpanStack_traverse(SpanStack *s, visitproc visit, void *arg) {
    Py_VISIT(s->st_kind); Py_VISIT(s->st_label); Py_VISIT(s->st_start); Py_VISIT(s->p_step);
    Py_VISIT(s->p_kind); Py_VISIT(s->p_label); Py_VISIT(s->p_start); Py_VISIT(s->p_dur);
    return 0;
}

static int SpanStack_clear(SpanStack *s) {
    Py_CLEAR(s->st_kind); Py_CLEAR(s->st_label); Py_CLEAR(s->st_start); Py_CLEAR(s->p_step);
    Py_CLEAR(s->p_kind); Py_CLEAR(s->p_label); Py_CLEAR(s->p_start); Py_CLEAR(s->p_dur);
    return 0;
}

static void SpanStack_dealloc(SpanStack *s) {
    PyObject_GC_UnTrack(s);
    SpanStack_clear(s);
    Py_TYPE(s)->tp_free((PyObject *)s);
}

static PyObject *SpanStack_new(PyTypeObject *type, PyObject *Py_UNUSED(args), PyObject *Py_UNUSED(kw)) {
    SpanStack *s = (SpanStack *)type->tp_alloc(type, 0);   /* zeroed; Recorder.__init__ sets the rest */
    if (s != NULL) s->step = -1;
    return (PyObject *)s;
}

static PyMethodDef SpanStack_methods[] = {
    {"busy_begin", (PyCFunction)SpanStack_busy_begin, METH_O, "Open a busy span labelled `label`."},
    {"wait_begin", (PyCFunction)(void (*)(void))SpanStack_wait_begin, METH_FASTCALL,
     "Open a wait span (the thread blocked on GPU results)."},
    {"_end", (PyCFunction)SpanStack_end, METH_NOARGS, "End the innermost open span (any kind)."},
    {"busy_end", (PyCFunction)SpanStack_end, METH_NOARGS, "End the innermost open span."},
    {"wait_end", (PyCFunction)SpanStack_end, METH_NOARGS, "End the innermost open span."},
    {"idle_end", (PyCFunction)SpanStack_end, METH_NOARGS, "End the innermost open span."},
    {NULL}
};

#define LL(name, field) {name, T_LONGLONG, offsetof(SpanStack, field), 0, NULL}
#define OBJ(name, field) {name, T_OBJECT_EX, offsetof(SpanStack, field), 0, NULL}
static PyMemberDef SpanStack_members[] = {
    LL("_depth", depth), LL("_wait_depth", wait_depth), LL("_wait_start", wait_start), LL("_step", step),
    LL("_step_wait", step_wait), LL("_n_spans", n_spans), LL("_spans_cap", spans_cap),
    LL("_wait_work", wait_work),
    OBJ("_st_kind", st_kind), OBJ("_st_label", st_label), OBJ("_st_start", st_start), OBJ("_p_step", p_step),
    OBJ("_p_kind", p_kind), OBJ("_p_label", p_label), OBJ("_p_start", p_start), OBJ("_p_dur", p_dur),
    {NULL}
};

static PyTypeObject SpanStackType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "overshoot.record._hot.SpanStack",
    .tp_basicsize = sizeof(SpanStack),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "The span stack and span buffers of a Recorder (record/spans.py in C).",
    .tp_new = SpanStack_new,
    .tp_dealloc = (destructor)SpanStack_dealloc,
    .tp_traverse = (traverseproc)SpanStack_traverse,
    .tp_clear = (inquiry)SpanStack_clear,
    .tp_methods = SpanStack_methods,
    .tp_members = SpanStack_members,
};

/* The span calls on any recorder: in C on a plain Recorder, else through its (overriding) methods. */
static int rec_begin(PyObject *rec, int fast, PyObject *label, int wait) {
    if (fast) return wait ? span_wait_begin((SpanStack *)rec, label) : span_busy_begin((SpanStack *)rec, label);
    PyObject *r = PyObject_CallMethodOneArg(rec, wait ? s_wait_begin : s_busy_begin, label);
    if (r == NULL) return -1;
    Py_DECREF(r);
    return 0;
}

static int rec_end(PyObject *rec, int fast, PyObject *name) {
    return fast ? span_end((SpanStack *)rec) : call_method(rec, name);
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
    if (h->step && call_method(rec, s_step_begin) < 0) return -1;
    if (h->idle && call_method(rec, s_idle_begin) < 0) return -1;
    if (h->busy_label != Py_None && rec_begin(rec, fast, h->busy_label, 0) < 0) return -1;
    if (h->wait_label != Py_None && rec_begin(rec, fast, h->wait_label, 1) < 0) return -1;
    if (h->stream_of != Py_None) {
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
            PyObject *r = PyObject_CallMethodOneArg(rec, s_gpu_begin, found);
            if (r == NULL) return -1;
            Py_DECREF(r);
        }
    }
    return 0;
}

static int end_all(Hooked *h, PyObject *rec, int fast, PyObject *stream) {
    if (stream != NULL) {
        PyObject *r = PyObject_CallMethodOneArg(rec, s_gpu_end, stream);
        if (r == NULL) return -1;
        Py_DECREF(r);
    }
    if (h->wait_label != Py_None && rec_end(rec, fast, s_wait_end) < 0) return -1;
    if (h->busy_label != Py_None && rec_end(rec, fast, s_busy_end) < 0) return -1;
    if (h->idle && rec_end(rec, fast, s_idle_end) < 0) return -1;
    return 0;
}

static void apply_facts(Hooked *h, PyObject *rec, PyObject *result, PyObject *const *args, size_t nargsf,
                        PyObject *kwnames) {
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
    PyObject *found = PyObject_Vectorcall(facts, call, nargs + 1, kwnames);
    Py_DECREF(facts);
    if (call != small) PyMem_Free(call);
    int ok = found != NULL;
    if (ok) {
        int truth = PyObject_IsTrue(found);
        if (truth < 0) {
            ok = 0;
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
        apply_facts(h, rec, result, args, nargsf, kwnames);
    }
    Py_XDECREF(stream);
    Py_DECREF(rec);
    return result;
}

static PyObject *Hooked_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    static char *names[] = {"func", "busy", "wait", "step", "idle", "stream_of", "facts", "globals", "open",
                            "failed", "facts_failed", "gpu_failed", NULL};
    PyObject *func, *busy = Py_None, *wait = Py_None, *stream_of = Py_None, *facts = Py_None;
    PyObject *globals = NULL, *open = NULL, *failed = NULL, *facts_failed = NULL, *gpu_failed = NULL;
    int step = 0, idle = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|$OOppOOO!OOOO", names, &func, &busy, &wait, &step, &idle,
                                     &stream_of, &facts, &PyDict_Type, &globals, &open, &failed,
                                     &facts_failed, &gpu_failed))
        return NULL;
    if (!globals || !open || !failed || !facts_failed || !gpu_failed) {
        PyErr_SetString(PyExc_TypeError, "Hooked() needs globals, open, failed, facts_failed and gpu_failed");
        return NULL;
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
    h->globals = Py_NewRef(globals);
    h->open = Py_NewRef(open);
    h->failed = Py_NewRef(failed);
    h->facts_failed = Py_NewRef(facts_failed);
    h->gpu_failed = Py_NewRef(gpu_failed);
    return (PyObject *)h;
}

static int Hooked_traverse(Hooked *h, visitproc visit, void *arg) {
    Py_VISIT(h->dict); Py_VISIT(h->func); Py_VISIT(h->busy_label); Py_VISIT(h->wait_label);
    Py_VISIT(h->stream_of); Py_VISIT(h->facts); Py_VISIT(h->globals); Py_VISIT(h->open); Py_VISIT(h->failed);
    Py_VISIT(h->facts_failed); Py_VISIT(h->gpu_failed);
    return 0;
}

static int Hooked_clear(Hooked *h) {
    Py_CLEAR(h->dict); Py_CLEAR(h->func); Py_CLEAR(h->busy_label); Py_CLEAR(h->wait_label);
    Py_CLEAR(h->stream_of); Py_CLEAR(h->facts); Py_CLEAR(h->globals); Py_CLEAR(h->open); Py_CLEAR(h->failed);
    Py_CLEAR(h->facts_failed); Py_CLEAR(h->gpu_failed);
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
    static char *names[] = {"busy", "wait", "idle", "max_depth", "recorder", NULL};
    PyObject *busy = NULL, *wait = NULL, *idle = NULL, *recorder = NULL;
    long long max_depth = -1;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|$OOOLO!", names, &busy, &wait, &idle, &max_depth,
                                     &PyType_Type, &recorder))
        return NULL;
    if (!busy || !wait || !idle || !recorder || max_depth < 0) {
        PyErr_SetString(PyExc_TypeError, "configure() needs busy, wait, idle, max_depth and recorder");
        return NULL;
    }
    Py_XSETREF(BUSY, Py_NewRef(busy));
    Py_XSETREF(WAIT, Py_NewRef(wait));
    Py_XSETREF(IDLE, Py_NewRef(idle));
    Py_XSETREF(fast_type, (PyTypeObject *)Py_NewRef(recorder));
    MAX_DEPTH = max_depth;
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
     "configure(*, busy, wait, idle, max_depth, recorder): the kind strings, stack depth, Recorder class."},
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
#undef INTERN
    if ((empty_tuple = PyTuple_New(0)) == NULL) return NULL;
    if (PyType_Ready(&SpanStackType) < 0 || PyType_Ready(&ScopeType) < 0 || PyType_Ready(&HookedType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module_def);
    if (m == NULL) return NULL;
    if (PyModule_AddObjectRef(m, "SpanStack", (PyObject *)&SpanStackType) < 0 ||
        PyModule_AddObjectRef(m, "Scope", (PyObject *)&ScopeType) < 0 ||
        PyModule_AddObjectRef(m, "Hooked", (PyObject *)&HookedType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
