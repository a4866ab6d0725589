/* The span's token arrays at C speed: a JSON int array as OTLP `ArrayValue.values` entries.
 *
 * int_array_elements(data) -> (elements: bytes, count: int) | None
 *
 * `data` is the engine's JSON text of a token-ID array (`[1,2,3]`, whitespace anywhere JSON allows
 * it). Each ID 0 <= v < 2**21 becomes the six bytes otlp._fixed_element writes for it:
 * 0a 04 18, then v's three 7-bit groups as a fixed-width varint. None for anything else (an ID out
 * of that range, a float spelling, a leading zero, a string, a cut array): the pure-Python path
 * (token_arrays.py) then decides, as it does where this module is not built. So the extension only
 * ever answers what the Python path answers with the same bytes, and never refuses what it reads.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#define TABLE_LIMIT (1u << 21)
#define MAX_DIGITS 7 /* 2**21 - 1 = 2097151 */

static int is_ws(unsigned char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

static PyObject *int_array_elements(PyObject *module, PyObject *arg) {
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    const unsigned char *p = (const unsigned char *)view.buf;
    const unsigned char *last = p + view.len - 1;
    /* The text must end in `]` (after optional whitespace): it then stops every scan below, so the
     * loops need no bounds checks. */
    while (last >= p && is_ws(*last)) last--;
    while (p <= last && is_ws(*p)) p++;
    if (last <= p || *p != '[' || *last != ']') {
        PyBuffer_Release(&view);
        Py_RETURN_NONE;
    }
    /* At most one ID per two bytes of text ("1,"), so (len / 2 + 1) * 6 bytes always suffice. */
    PyObject *out = PyBytes_FromStringAndSize(NULL, ((last - p) / 2 + 1) * 6);
    if (out == NULL) {
        PyBuffer_Release(&view);
        return NULL;
    }
    unsigned char *o = (unsigned char *)PyBytes_AS_STRING(out);
    int ok = 0;
    p++;
    while (is_ws(*p)) p++;
    if (p == last) { /* the empty array */
        ok = 1;
        goto done;
    }
    for (;;) {
        const unsigned char *first = p;
        unsigned long value = 0;
        while (*p >= '0' && *p <= '9') {
            value = value * 10 + (unsigned long)(*p - '0');
            p++;
        }
        Py_ssize_t digits = p - first;
        if (digits == 0 || digits > MAX_DIGITS || value >= TABLE_LIMIT) goto done;
        if (*first == '0' && digits > 1) goto done; /* a leading zero */
        o[0] = 0x0a;
        o[1] = 0x04;
        o[2] = 0x18;
        o[3] = (unsigned char)((value & 0x7f) | 0x80);
        o[4] = (unsigned char)(((value >> 7) & 0x7f) | 0x80);
        o[5] = (unsigned char)(value >> 14);
        o += 6;
        while (is_ws(*p)) p++;
        if (*p == ',') {
            if (p == last) goto done;
            p++;
            while (is_ws(*p)) p++;
            continue;
        }
        if (p == last) ok = 1; /* `]`: the array's end (a float's `.` or `e`, or `]` inside, fail) */
        goto done;
    }
done:
    PyBuffer_Release(&view);
    if (!ok) {
        Py_DECREF(out);
        Py_RETURN_NONE;
    }
    Py_ssize_t size = o - (unsigned char *)PyBytes_AS_STRING(out);
    if (_PyBytes_Resize(&out, size) < 0) {
        return NULL;
    }
    return Py_BuildValue("(Nn)", out, size / 6);
}

static PyMethodDef methods[] = {
    {"int_array_elements", int_array_elements, METH_O,
     "int_array_elements(data) -> (elements, count) | None: a JSON int array of IDs below 2**21 as "
     "OTLP ArrayValue entries (six bytes each); None for anything else."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "agl_sidecar._token_elements",
    "The span's token arrays at C speed (optional: token_arrays.py falls back to Python).", -1, methods,
};

PyMODINIT_FUNC PyInit__token_elements(void) { return PyModule_Create(&module); }
