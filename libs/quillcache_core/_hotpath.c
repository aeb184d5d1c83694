/* The planner's per-block passes in C: quillcache_core.hotpath's compiled half.

   Each function does exactly what its pure-Python twin in hotpath.py does (the tests
   run both on the same inputs), one C loop instead of several Python passes over a
   prompt's blocks. Anything it does not expect (a record that is not a tuple, a cell
   shape it does not know) is left to Python: placeholders, or None for "no answer".
   Built by setuptools from pyproject.toml's ext-modules, as an optional extension.
*/
#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* locate(by_hash, hashes, stop_at_miss, pending) -> (found, todo)

   found[i] for hashes[i]: [record] for a one-record cell; the values of the one
   records-dict of a dict cell holding one key (several copies of one key); None for
   any other dict cell (a pending chain, or several keys under one hash) - todo then
   lists those positions for the caller. A hash held nowhere ends found when
   stop_at_miss, else gets []. */
static PyObject *
hot_locate(PyObject *self, PyObject *args)
{
    PyObject *by_hash, *hashes, *pending;
    int stop;
    if (!PyArg_ParseTuple(args, "O!O!pO", &PyDict_Type, &by_hash, &PyList_Type, &hashes,
                          &stop, &pending)) {
        return NULL;
    }
    PyObject *found = PyList_New(0);
    PyObject *todo = NULL;
    if (found == NULL) {
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(hashes);
    for (Py_ssize_t i = 0; i < n && i < PyList_GET_SIZE(hashes); i++) {
        PyObject *cell = PyDict_GetItemWithError(by_hash, PyList_GET_ITEM(hashes, i));
        PyObject *item = NULL;
        if (cell == NULL) {
            if (PyErr_Occurred()) {
                goto error;
            }
            if (stop) {
                break;
            }
            item = PyList_New(0);
        }
        else if (PyDict_CheckExact(cell)) {
            int is_pending = PyDict_Contains(cell, pending);
            if (is_pending < 0) {
                goto error;
            }
            PyObject *key, *records = NULL;
            Py_ssize_t pos = 0;
            if (!is_pending && PyDict_GET_SIZE(cell) == 1 &&
                PyDict_Next(cell, &pos, &key, &records) && PyDict_CheckExact(records)) {
                item = PyDict_Values(records);
            }
            else {
                if (todo == NULL && (todo = PyList_New(0)) == NULL) {
                    goto error;
                }
                PyObject *index = PyLong_FromSsize_t(i);
                if (index == NULL) {
                    goto error;
                }
                int failed = PyList_Append(todo, index);
                Py_DECREF(index);
                if (failed) {
                    goto error;
                }
                item = Py_NewRef(Py_None);
            }
        }
        else {
            item = PyList_New(1);
            if (item != NULL) {
                PyList_SET_ITEM(item, 0, Py_NewRef(cell));
            }
        }
        if (item == NULL) {
            goto error;
        }
        int failed = PyList_Append(found, item);
        Py_DECREF(item);
        if (failed) {
            goto error;
        }
    }
    return Py_BuildValue("(NN)", found, todo == NULL ? Py_NewRef(Py_None) : todo);
error:
    Py_DECREF(found);
    Py_XDECREF(todo);
    return NULL;
}

/* same_scope(located, want) -> True, False, or None (not lists of tuples: ask Python)

   Whether every record's key (record[0]) has want's four identity fields first. */
static PyObject *
hot_same_scope(PyObject *self, PyObject *args)
{
    PyObject *located, *want;
    if (!PyArg_ParseTuple(args, "O!O!", &PyList_Type, &located, &PyTuple_Type, &want)) {
        return NULL;
    }
    if (PyTuple_GET_SIZE(want) != 4) {
        Py_RETURN_NONE;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(located); i++) {
        PyObject *found = PyList_GET_ITEM(located, i);
        if (!PyList_Check(found)) {
            Py_RETURN_NONE;
        }
        for (Py_ssize_t j = 0; j < PyList_GET_SIZE(found); j++) {
            PyObject *record = PyList_GET_ITEM(found, j);
            if (!PyTuple_Check(record) || PyTuple_GET_SIZE(record) < 1) {
                Py_RETURN_NONE;
            }
            PyObject *key = PyTuple_GET_ITEM(record, 0);
            if (!PyTuple_Check(key) || PyTuple_GET_SIZE(key) < 4) {
                Py_RETURN_NONE;
            }
            Py_INCREF(key);  /* an __eq__ in Python could drop the record meanwhile */
            int same = 1;
            for (Py_ssize_t f = 0; f < 4 && same > 0; f++) {
                same = PyObject_RichCompareBool(PyTuple_GET_ITEM(key, f),
                                                PyTuple_GET_ITEM(want, f), Py_EQ);
            }
            Py_DECREF(key);
            if (same < 0) {
                return NULL;
            }
            if (!same) {
                Py_RETURN_FALSE;
            }
            if (!PyList_Check(found) || j >= PyList_GET_SIZE(found)) {
                Py_RETURN_NONE;  /* a comparison changed the list */
            }
        }
    }
    Py_RETURN_TRUE;
}

/* 1 when blocks a and b (lists of records) hold the same (worker, tier, bytes) copies
   in the same order, 0 when not, -1 on error, -2 when a record is no 4+-tuple. */
static int
same_copies(PyObject *a, PyObject *b)
{
    Py_ssize_t n = PyList_GET_SIZE(a);
    if (n != PyList_GET_SIZE(b)) {
        return 0;
    }
    for (Py_ssize_t j = 0; j < n; j++) {
        PyObject *ra = PyList_GET_ITEM(a, j), *rb = PyList_GET_ITEM(b, j);
        if (!PyTuple_Check(ra) || !PyTuple_Check(rb) || PyTuple_GET_SIZE(ra) < 4 ||
            PyTuple_GET_SIZE(rb) < 4) {
            return -2;
        }
        Py_INCREF(ra);  /* an __eq__ in Python could drop them meanwhile */
        Py_INCREF(rb);
        int same = 1;
        for (Py_ssize_t f = 1; f < 4 && same > 0; f++) {
            same = PyObject_RichCompareBool(PyTuple_GET_ITEM(ra, f), PyTuple_GET_ITEM(rb, f),
                                            Py_EQ);
        }
        Py_DECREF(ra);
        Py_DECREF(rb);
        if (same <= 0) {
            return same;
        }
        if (PyList_GET_SIZE(a) != n || PyList_GET_SIZE(b) != n) {
            return -2;  /* a comparison changed a list */
        }
    }
    return 1;
}

/* block_runs(usable) -> [(first, count), ...], or None (not lists of tuples: ask Python) */
static PyObject *
hot_block_runs(PyObject *self, PyObject *args)
{
    PyObject *usable;
    if (!PyArg_ParseTuple(args, "O!", &PyList_Type, &usable)) {
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(usable);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!PyList_Check(PyList_GET_ITEM(usable, i))) {
            Py_RETURN_NONE;
        }
    }
    PyObject *runs = PyList_New(0);
    if (runs == NULL) {
        return NULL;
    }
    Py_ssize_t first = 0;
    for (Py_ssize_t i = 1; i <= n; i++) {
        if (i < n) {
            if (n != PyList_GET_SIZE(usable)) {
                Py_DECREF(runs);
                Py_RETURN_NONE;
            }
            int same = same_copies(PyList_GET_ITEM(usable, i - 1), PyList_GET_ITEM(usable, i));
            if (same == -1) {
                Py_DECREF(runs);
                return NULL;
            }
            if (same == -2) {
                Py_DECREF(runs);
                Py_RETURN_NONE;
            }
            if (same) {
                continue;
            }
        }
        PyObject *run = Py_BuildValue("(nn)", first, i - first);
        if (run == NULL || PyList_Append(runs, run) < 0) {
            Py_XDECREF(run);
            Py_DECREF(runs);
            return NULL;
        }
        Py_DECREF(run);
        first = i;
    }
    return runs;
}

static PyMethodDef hot_methods[] = {
    {"locate", hot_locate, METH_VARARGS, "locate(by_hash, hashes, stop_at_miss, pending)"},
    {"same_scope", hot_same_scope, METH_VARARGS, "same_scope(located, want)"},
    {"block_runs", hot_block_runs, METH_VARARGS, "block_runs(usable)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef hot_module = {
    PyModuleDef_HEAD_INIT, "_hotpath", "The planner's per-block passes in C.", -1, hot_methods,
};

PyMODINIT_FUNC
PyInit__hotpath(void)
{
    return PyModule_Create(&hot_module);
}
