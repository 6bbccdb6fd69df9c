/* onecall_struct_layout: this compiler's layout of the structs kernels.h declares, so that the loader
 * (kernels/cpu/native_abi.py) can hold Python's ctypes mirrors to the sizes and offsets the C code
 * really uses. A field named here that the struct lacks does not compile; a struct or field of the
 * header missing here is a load-time error there. Add a struct to kernels.h, add its rows here. */
#include <stddef.h>
#include <stdint.h>

#include "kernels.h"

typedef struct {
    const char *name; /* "Struct" or "Struct.field" */
    int64_t a, b;     /* sizeof and alignof, or offsetof and sizeof */
} Row;

#define STRUCT(S) {#S, (int64_t)sizeof(S), (int64_t)_Alignof(S)}
#define FIELD(S, f) {#S "." #f, (int64_t)offsetof(S, f), (int64_t)sizeof(((S *)0)->f)}

static const Row ROWS[] = {
    STRUCT(Q4Weight),
    FIELD(Q4Weight, qs),
    FIELD(Q4Weight, scale),
    FIELD(Q4Weight, offset),
    FIELD(Q4Weight, bias),
    FIELD(Q4Weight, n),
    FIELD(Q4Weight, k),
    FIELD(Q4Weight, f16),
    FIELD(Q4Weight, q8_group),
    FIELD(Q4Weight, act8),
    FIELD(Q4Weight, q5),
    FIELD(Q4Weight, half),
    FIELD(Q4Weight, iq4),
    FIELD(Q4Weight, next),
    FIELD(Q4Weight, kbits),
    STRUCT(DecodeLayer),
    FIELD(DecodeLayer, input_norm),
    FIELD(DecodeLayer, post_norm),
    FIELD(DecodeLayer, q_norm),
    FIELD(DecodeLayer, k_norm),
    FIELD(DecodeLayer, window),
    FIELD(DecodeLayer, softcap),
    FIELD(DecodeLayer, qkv),
    FIELD(DecodeLayer, o),
    FIELD(DecodeLayer, gate_up),
    FIELD(DecodeLayer, down),
};

int64_t onecall_struct_layout(const char **names, int64_t *values, int64_t capacity) {
    const int64_t n = (int64_t)(sizeof ROWS / sizeof ROWS[0]);
    for (int64_t i = 0; i < n && i < capacity; i++) {
        names[i] = ROWS[i].name;
        values[2 * i] = ROWS[i].a;
        values[2 * i + 1] = ROWS[i].b;
    }
    return n;
}
