/* An NVTX injection library for scripts/gpu_check.sh: with NVTX_INJECTION64_PATH naming this
 * library, every NVTX range a process pushes (torch.cuda.nvtx.range_push, so hvdtrain's
 * nvtx_range) is written to the file $HVDTRAIN_NVTX_LOG as "push NAME" / "pop" lines. It stands in
 * for Nsight Systems, which attaches the same way, where no nsys is installed.
 * Self-contained: the few NVTX v3 injection types are restated here (nvtx3/nvtxDetail/nvtxTypes.h).
 *   gcc -shared -fPIC -o nvtx_recorder.so nvtx_recorder.c */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

typedef void (*nvtx_fn)(void);
typedef nvtx_fn **nvtx_table;
typedef struct {
    size_t struct_size;
    int (*GetModuleFunctionTable)(int module, nvtx_table *out_table, unsigned int *out_size);
} nvtx_callbacks;
typedef const void *(*nvtx_get_export_table)(uint32_t id);

enum { ETID_CALLBACKS = 1, MODULE_CORE = 1, CBID_RANGE_PUSH_A = 9, CBID_RANGE_POP = 11 };

static FILE *out;

static int range_push_a(const char *message) {
    if (out) { fprintf(out, "push %s\n", message ? message : ""); fflush(out); }
    return 0;
}

static int range_pop(void) {
    if (out) { fputs("pop\n", out); fflush(out); }
    return 0;
}

int InitializeInjectionNvtx2(nvtx_get_export_table get) {
    const nvtx_callbacks *cb = (const nvtx_callbacks *)get(ETID_CALLBACKS);
    nvtx_table table = 0;
    unsigned int size = 0;
    const char *path = getenv("HVDTRAIN_NVTX_LOG");
    if (!cb || !path || !cb->GetModuleFunctionTable(MODULE_CORE, &table, &size) || size <= CBID_RANGE_POP)
        return 0;
    out = fopen(path, "a");
    *table[CBID_RANGE_PUSH_A] = (nvtx_fn)range_push_a;
    *table[CBID_RANGE_POP] = (nvtx_fn)range_pop;
    return out != 0;
}
