/* Fault injection for tests, as SQLite's test builds have: a named point in a step does
 * what a test asked of it (kill the process, or sleep) once its count of hits runs out. */
#include "kv.h"

/* ---------------------------------------------------------------------------------- */
/* fault injection (tests), as SQLite's test builds have: a named point in a step does
 * what a test asked of it, once its count of hits runs out. Compiled in always: while
 * no point is armed, a point costs one load of a flag that never changes. */

enum { FP_OFF = 0, FP_KILL = 1, FP_SLEEP = 2 };
typedef struct {
    const char *name;
    int action;
    long arg;   /* FP_SLEEP: microseconds */
    long after; /* hits before it acts (1: the next) */
} fpoint_t;
static fpoint_t fpoints[] = {
    {"put.reserved", 0, 0, 0},  /* a put's chunks reserved, under the lock */
    {"put.copied", 0, 0, 0},    /* its copies made, before the lock to publish */
    {"put.publish", 0, 0, 0},   /* the first of its records published, under the lock */
    {"read.copy", 0, 0, 0},     /* a batch read between its look-up and its copies */
    {"grow.made", 0, 0, 0},     /* a table growth's new file made, not published */
    {"grow.published", 0, 0, 0},/* the new table published beside the old, none moved */
    {"grow.rehash", 0, 0, 0},   /* one bucket moved to the new table, in the seqlock */
    {"evict", 0, 0, 0},         /* a victim's record taken out of its queue */
    {"spill.written", 0, 0, 0}, /* a victim's spill file written, its record not moved */
    {"promote.read", 0, 0, 0},  /* a spilled block read back into a chunk, not published */
    {"reclaim", 0, 0, 0},       /* a dead process's first chunk given back */
    {"slab.made", 0, 0, 0},     /* a new slab's file made outside the lock, not live */
};
#define NFPOINTS (sizeof fpoints / sizeof fpoints[0])
int faults_armed;

void fault_hit(const char *name) {
    for (size_t i = 0; i < NFPOINTS; i++) {
        fpoint_t *f = &fpoints[i];
        if (f->action == FP_OFF || strcmp(f->name, name) != 0)
            continue;
        if (__atomic_sub_fetch(&f->after, 1, __ATOMIC_RELAXED) > 0)
            return;
        if (f->action == FP_KILL)
            kill(getpid(), SIGKILL); /* a crash: nothing of this process runs on */
        else
            usleep((useconds_t)f->arg);
        if (f->after <= 0)
            f->after = 1; /* a sleep acts at every hit from then on */
        return;
    }
}


/* set_fault(point, action, arg=0, after=1): arm a fault point (tests) */
PyObject *py_set_fault(PyObject *self, PyObject *args) {
    (void)self;
    const char *name, *action;
    long arg = 0, after = 1;
    if (!PyArg_ParseTuple(args, "ss|ll", &name, &action, &arg, &after))
        return NULL;
    int a = strcmp(action, "off") == 0 ? FP_OFF : strcmp(action, "kill") == 0 ? FP_KILL
          : strcmp(action, "sleep") == 0 ? FP_SLEEP : -1;
    if (a < 0 || after < 1 || arg < 0) {
        PyErr_Format(PyExc_ValueError, "a fault is off, kill or sleep (microseconds >= 0), "
                     "after at least one hit: %s %ld after %ld", action, arg, after);
        return NULL;
    }
    fpoint_t *f = NULL;
    for (size_t i = 0; i < NFPOINTS; i++)
        if (strcmp(fpoints[i].name, name) == 0)
            f = &fpoints[i];
    if (f == NULL) {
        PyErr_Format(PyExc_ValueError, "no fault point %s", name);
        return NULL;
    }
    f->action = a;
    f->arg = arg;
    f->after = after;
    int armed = 0;
    for (size_t i = 0; i < NFPOINTS; i++)
        armed |= fpoints[i].action != FP_OFF;
    faults_armed = armed;
    Py_RETURN_NONE;
}

PyObject *py_fault_points(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    PyObject *t = PyTuple_New((Py_ssize_t)NFPOINTS);
    for (size_t i = 0; t != NULL && i < NFPOINTS; i++) {
        PyObject *u = PyUnicode_FromString(fpoints[i].name);
        if (u == NULL) {
            Py_CLEAR(t);
            break;
        }
        PyTuple_SET_ITEM(t, (Py_ssize_t)i, u);
    }
    return t;
}
