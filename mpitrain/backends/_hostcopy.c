/* Gather and scatter between one flat host buffer and many host arrays, in one call.
 *
 * A fusion bucket of many small arrays is copied into and out of flat buffers (the
 * shared-memory allreduce's stages, a packed fusion buffer). numpy needs one call per
 * array for the scatter and spends about half a microsecond per array inside
 * concatenate for the gather, which for 10 KiB arrays costs more than the copy
 * itself. These functions take the whole list and copy each array's bytes with one
 * memmove (the GPU path does the same with one kernel: kernels/pack.cu).
 *
 *   gather(flat, parts)  -> flat's bytes = parts' bytes, one part after the other
 *   scatter(flat, parts) -> each part's bytes = its range of flat's bytes
 *
 * Both return True after copying, or False without copying anything if they cannot
 * copy bytes for bytes: a buffer that is not C-contiguous or whose item format is not
 * flat's (or that has none, such as ml_dtypes' bfloat16), a destination that is
 * read-only, or parts whose sizes do not add up to flat's. The caller (the numpy
 * backend, mpitrain/backends/hostcopy.py) then copies with numpy.
 *
 * The GIL is released for the copies when they move at least RELEASE_BYTES, as numpy
 * does for large copies, so that other threads run meanwhile.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

#ifndef SOURCE_SHA256
#define SOURCE_SHA256 ""
#endif

#define STACK_PARTS 128
#define RELEASE_BYTES (1 << 16)

static int same_format(const Py_buffer *a, const Py_buffer *b) {
    return a->itemsize == b->itemsize && a->format != NULL && b->format != NULL &&
           strcmp(a->format, b->format) == 0;
}

/* 1 after copying, 0 if it cannot copy (nothing copied, no exception), -1 on error. */
static int copy_parts(PyObject *flat, PyObject *parts, int gather) {
    PyObject *seq = PySequence_Fast(parts, "parts must be a sequence of arrays");
    if (seq == NULL)
        return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), held = 0, total = 0, i;
    PyObject **items = PySequence_Fast_ITEMS(seq);
    Py_buffer whole, stack[STACK_PARTS];
    Py_buffer *views = n <= STACK_PARTS ? stack : PyMem_New(Py_buffer, n);
    int flat_flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (gather ? PyBUF_WRITABLE : 0);
    int part_flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (gather ? 0 : PyBUF_WRITABLE);
    int result = 0;
    if (views == NULL) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return -1;
    }
    if (PyObject_GetBuffer(flat, &whole, flat_flags) < 0) {
        PyErr_Clear();
        goto done;
    }
    for (held = 0; held < n; held++) {
        if (PyObject_GetBuffer(items[held], &views[held], part_flags) < 0) {
            PyErr_Clear();
            goto release;
        }
        if (!same_format(&views[held], &whole)) {
            held++;
            goto release;
        }
        total += views[held].len;
    }
    if (total == whole.len) {
        char *at = whole.buf;
        PyThreadState *saved = total >= RELEASE_BYTES ? PyEval_SaveThread() : NULL;
        for (i = 0; i < n; i++) {
            if (gather)
                memmove(at, views[i].buf, (size_t)views[i].len);
            else
                memmove(views[i].buf, at, (size_t)views[i].len);
            at += views[i].len;
        }
        if (saved != NULL)
            PyEval_RestoreThread(saved);
        result = 1;
    }
release:
    for (i = 0; i < held; i++)
        PyBuffer_Release(&views[i]);
    PyBuffer_Release(&whole);
done:
    if (views != stack)
        PyMem_Free(views);
    Py_DECREF(seq);
    return result;
}

static PyObject *call(PyObject *args, int gather) {
    PyObject *flat, *parts;
    if (!PyArg_ParseTuple(args, gather ? "OO:gather" : "OO:scatter", &flat, &parts))
        return NULL;
    int done = copy_parts(flat, parts, gather);
    if (done < 0)
        return NULL;
    return PyBool_FromLong(done);
}

static PyObject *gather(PyObject *self, PyObject *args) {
    (void)self;
    return call(args, 1);
}

static PyObject *scatter(PyObject *self, PyObject *args) {
    (void)self;
    return call(args, 0);
}

static PyMethodDef methods[] = {
    {"gather", gather, METH_VARARGS,
     "gather(flat, parts) -> bool: copy the parts' bytes one after the other into flat "
     "(False, copying nothing, if they cannot be copied byte for byte)."},
    {"scatter", scatter, METH_VARARGS,
     "scatter(flat, parts) -> bool: copy consecutive ranges of flat's bytes into the "
     "parts (False, copying nothing, if they cannot be copied byte for byte)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_hostcopy",
    "Gather and scatter between one flat host buffer and many arrays (see hostcopy.py).",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__hostcopy(void) {
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddStringConstant(m, "SOURCE_SHA256", SOURCE_SHA256) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
