/* smctl: green-context SM partitions through the CUDA driver API, resolved with dlopen/dlsym. */
#define _GNU_SOURCE
#include "smctl.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The few driver types we need, declared from the public CUDA 13.0 headers (cuda.h), so no CUDA
 * headers are needed to build. */
typedef int CUresult;
typedef int CUdevice;
typedef void* CUcontext;
typedef void* CUgreenCtx;
typedef void* CUstream;
typedef void* CUdevResourceDesc;
enum { CU_DEV_RESOURCE_TYPE_SM = 1 };
enum { CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16 };
enum { CU_GREEN_CTX_DEFAULT_STREAM = 1 };
enum { CU_STREAM_NON_BLOCKING = 1 };
typedef struct {
    unsigned int smCount;
    unsigned int minSmPartitionSize;
    unsigned int smCoscheduledAlignment;
} CUdevSmResource;
typedef struct {
    int type;
    unsigned char _internal_padding[92];
    union {
        CUdevSmResource sm;
        unsigned char _oversize[48];
    };
} CUdevResource; /* 144 bytes, RESOURCE_ABI_VERSION 1 */

typedef CUresult (*PFN_cuInit)(unsigned int);
typedef CUresult (*PFN_cuDriverGetVersion)(int*);
typedef CUresult (*PFN_cuDeviceGet)(CUdevice*, int);
typedef CUresult (*PFN_cuDeviceGetCount)(int*);
typedef CUresult (*PFN_cuDeviceGetAttribute)(int*, int, CUdevice);
typedef CUresult (*PFN_cuCtxGetCurrent)(CUcontext*);
typedef CUresult (*PFN_cuCtxSetCurrent)(CUcontext);
typedef CUresult (*PFN_cuDevicePrimaryCtxRetain)(CUcontext*, CUdevice);
typedef CUresult (*PFN_cuDeviceGetDevResource)(CUdevice, CUdevResource*, int);
typedef CUresult (*PFN_cuDevSmResourceSplitByCount)(CUdevResource*, unsigned int*, const CUdevResource*,
                                                    CUdevResource*, unsigned int, unsigned int);
typedef CUresult (*PFN_cuDevResourceGenerateDesc)(CUdevResourceDesc*, CUdevResource*, unsigned int);
typedef CUresult (*PFN_cuGreenCtxCreate)(CUgreenCtx*, CUdevResourceDesc, CUdevice, unsigned int);
typedef CUresult (*PFN_cuGreenCtxStreamCreate)(CUstream*, CUgreenCtx, unsigned int, int);
typedef CUresult (*PFN_cuGreenCtxDestroy)(CUgreenCtx);
typedef CUresult (*PFN_cuStreamDestroy)(CUstream);
typedef CUresult (*PFN_cuGetErrorString)(CUresult, const char**);

static struct {
    int loaded;  /* 0 not tried, 1 ok, <0 an SMCTL error */
    void* lib;
    PFN_cuInit cuInit;
    PFN_cuDriverGetVersion cuDriverGetVersion;
    PFN_cuDeviceGet cuDeviceGet;
    PFN_cuDeviceGetCount cuDeviceGetCount;
    PFN_cuDeviceGetAttribute cuDeviceGetAttribute;
    PFN_cuCtxGetCurrent cuCtxGetCurrent;
    PFN_cuCtxSetCurrent cuCtxSetCurrent;
    PFN_cuDevicePrimaryCtxRetain cuDevicePrimaryCtxRetain;
    PFN_cuDeviceGetDevResource cuDeviceGetDevResource;
    PFN_cuDevSmResourceSplitByCount cuDevSmResourceSplitByCount;
    PFN_cuDevResourceGenerateDesc cuDevResourceGenerateDesc;
    PFN_cuGreenCtxCreate cuGreenCtxCreate;
    PFN_cuGreenCtxStreamCreate cuGreenCtxStreamCreate;
    PFN_cuGreenCtxDestroy cuGreenCtxDestroy;
    PFN_cuStreamDestroy cuStreamDestroy;
    PFN_cuGetErrorString cuGetErrorString;
    int has_green;
    char reason[160];
} drv;

static pthread_mutex_t load_lock = PTHREAD_MUTEX_INITIALIZER;
static __thread int last_cuda;
static __thread char last_msg[256];

static int fail(int code, const char* fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(last_msg, sizeof last_msg, fmt, ap);
    va_end(ap);
    return code;
}

static int cuda_fail(CUresult r, const char* call) {
    const char* s = NULL;
    last_cuda = r;
    if (drv.cuGetErrorString) drv.cuGetErrorString(r, &s);
    return fail(SMCTL_ECUDA, "%s failed: CUresult %d (%s)", call, r, s ? s : "?");
}

#define SYM(name, required)                                                        \
    do {                                                                           \
        *(void**)(&drv.name) = dlsym(drv.lib, #name);                              \
        if (!drv.name && required) {                                               \
            snprintf(drv.reason, sizeof drv.reason, "libcuda lacks %s", #name);    \
            return SMCTL_ENODRIVER;                                                \
        }                                                                          \
    } while (0)

static int load_driver_locked(void) {
    drv.lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!drv.lib) {
        snprintf(drv.reason, sizeof drv.reason, "no CUDA driver: %s", dlerror());
        return SMCTL_ENODRIVER;
    }
    SYM(cuInit, 1);
    SYM(cuDriverGetVersion, 1);
    SYM(cuDeviceGet, 1);
    SYM(cuDeviceGetCount, 1);
    SYM(cuDeviceGetAttribute, 1);
    SYM(cuCtxGetCurrent, 1);
    SYM(cuCtxSetCurrent, 1);
    SYM(cuDevicePrimaryCtxRetain, 1);
    SYM(cuGetErrorString, 0);
    *(void**)(&drv.cuStreamDestroy) = dlsym(drv.lib, "cuStreamDestroy_v2");
    if (!drv.cuStreamDestroy) *(void**)(&drv.cuStreamDestroy) = dlsym(drv.lib, "cuStreamDestroy");
    SYM(cuDeviceGetDevResource, 0);
    SYM(cuDevSmResourceSplitByCount, 0);
    SYM(cuDevResourceGenerateDesc, 0);
    SYM(cuGreenCtxCreate, 0);
    SYM(cuGreenCtxStreamCreate, 0);
    SYM(cuGreenCtxDestroy, 0);
    drv.has_green = drv.cuDeviceGetDevResource && drv.cuDevSmResourceSplitByCount && drv.cuDevResourceGenerateDesc
                    && drv.cuGreenCtxCreate && drv.cuGreenCtxStreamCreate && drv.cuGreenCtxDestroy
                    && drv.cuStreamDestroy;
    CUresult r = drv.cuInit(0);
    if (r != 0) {
        snprintf(drv.reason, sizeof drv.reason, "cuInit failed with CUresult %d (no usable GPU)", r);
        return SMCTL_ENODRIVER;
    }
    if (!drv.has_green) snprintf(drv.reason, sizeof drv.reason, "driver lacks green contexts (needs CUDA 12.4+)");
    return 1;
}

static int load_driver(void) {
    pthread_mutex_lock(&load_lock);
    if (drv.loaded == 0) drv.loaded = load_driver_locked();
    int state = drv.loaded;
    pthread_mutex_unlock(&load_lock);
    if (state < 0) return fail(state, "%s", drv.reason);
    return SMCTL_OK;
}

static int get_device(int device, CUdevice* dev) {
    int count = 0;
    CUresult r = drv.cuDeviceGetCount(&count);
    if (r != 0) return cuda_fail(r, "cuDeviceGetCount");
    if (device < 0 || device >= count) return fail(SMCTL_EINVAL, "device %d out of range [0, %d)", device, count);
    r = drv.cuDeviceGet(dev, device);
    return r != 0 ? cuda_fail(r, "cuDeviceGet") : SMCTL_OK;
}

/* A green context needs a current context on the calling thread: use the primary one (torch's). */
static int ensure_context(CUdevice dev) {
    CUcontext cur = NULL;
    CUresult r = drv.cuCtxGetCurrent(&cur);
    if (r != 0) return cuda_fail(r, "cuCtxGetCurrent");
    if (cur) return SMCTL_OK;
    r = drv.cuDevicePrimaryCtxRetain(&cur, dev);
    if (r != 0) return cuda_fail(r, "cuDevicePrimaryCtxRetain");
    r = drv.cuCtxSetCurrent(cur);
    return r != 0 ? cuda_fail(r, "cuCtxSetCurrent") : SMCTL_OK;
}

int smctl_version(void) { return 100; }

int smctl_capabilities(int device, smctl_caps* out) {
    if (!out) return fail(SMCTL_EINVAL, "out is NULL");
    memset(out, 0, sizeof *out);
    int rc = load_driver();
    if (rc != SMCTL_OK) {
        snprintf(out->reason, sizeof out->reason, "%s", drv.reason);
        return rc;
    }
    drv.cuDriverGetVersion(&out->driver_version);
    CUdevice dev;
    if ((rc = get_device(device, &dev)) != SMCTL_OK) return rc;
    CUresult r = drv.cuDeviceGetAttribute(&out->sm_count, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev);
    if (r != 0) return cuda_fail(r, "cuDeviceGetAttribute");
    if (!drv.has_green) {
        snprintf(out->reason, sizeof out->reason, "%s", drv.reason);
        return SMCTL_OK;
    }
    CUdevResource res;
    memset(&res, 0, sizeof res);
    r = drv.cuDeviceGetDevResource(dev, &res, CU_DEV_RESOURCE_TYPE_SM);
    if (r != 0) {
        snprintf(out->reason, sizeof out->reason, "cuDeviceGetDevResource failed (CUresult %d)", r);
        return SMCTL_OK;
    }
    out->green_ctx_supported = 1;
    out->min_partition_sms = (int)res.sm.minSmPartitionSize;
    out->partition_alignment = (int)res.sm.smCoscheduledAlignment;
    return SMCTL_OK;
}

typedef struct {
    smctl_entry pub;
    CUgreenCtx decode_ctx, prefill_ctx;
} entry_t;

struct smctl_ladder {
    int n;
    entry_t* entries;
};

static int make_side(CUdevice dev, CUdevResource* res, int priority, CUgreenCtx* ctx, uintptr_t* stream) {
    CUdevResourceDesc desc = NULL;
    CUresult r = drv.cuDevResourceGenerateDesc(&desc, res, 1);
    if (r != 0) return cuda_fail(r, "cuDevResourceGenerateDesc");
    r = drv.cuGreenCtxCreate(ctx, desc, dev, CU_GREEN_CTX_DEFAULT_STREAM);
    if (r != 0) return cuda_fail(r, "cuGreenCtxCreate");
    CUstream s = NULL;
    r = drv.cuGreenCtxStreamCreate(&s, *ctx, CU_STREAM_NON_BLOCKING, priority);
    if (r != 0) return cuda_fail(r, "cuGreenCtxStreamCreate");
    *stream = (uintptr_t)s;
    return SMCTL_OK;
}

void smctl_ladder_destroy(smctl_ladder* ladder) {
    if (!ladder) return;
    for (int i = 0; i < ladder->n; i++) {
        entry_t* e = &ladder->entries[i];
        if (e->pub.decode_stream) drv.cuStreamDestroy((CUstream)e->pub.decode_stream);
        if (e->pub.prefill_stream) drv.cuStreamDestroy((CUstream)e->pub.prefill_stream);
        if (e->decode_ctx) drv.cuGreenCtxDestroy(e->decode_ctx);
        if (e->prefill_ctx) drv.cuGreenCtxDestroy(e->prefill_ctx);
    }
    free(ladder->entries);
    free(ladder);
}

int smctl_ladder_create(int device, const int* counts, int n, int side_mask, int decode_priority,
                        int prefill_priority, smctl_ladder** out) {
    if (!out) return fail(SMCTL_EINVAL, "out is NULL");
    *out = NULL;
    if (!counts || n <= 0) return fail(SMCTL_EINVAL, "the ladder needs at least one SM count (n=%d)", n);
    if (side_mask < 1 || side_mask > 3) return fail(SMCTL_EINVAL, "side_mask %d is not 1, 2 or 3", side_mask);
    int rc = load_driver();
    if (rc != SMCTL_OK) return rc;
    if (!drv.has_green) return fail(SMCTL_ENOTSUP, "%s", drv.reason);
    CUdevice dev;
    if ((rc = get_device(device, &dev)) != SMCTL_OK) return rc;
    int sm_count = 0;
    drv.cuDeviceGetAttribute(&sm_count, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev);
    for (int i = 0; i < n; i++)
        if (counts[i] < 1 || counts[i] >= sm_count)
            return fail(SMCTL_EINVAL, "decode SM count %d (entry %d) is outside [1, %d]", counts[i], i, sm_count - 1);
    if ((rc = ensure_context(dev)) != SMCTL_OK) return rc;
    CUdevResource all;
    memset(&all, 0, sizeof all);
    CUresult r = drv.cuDeviceGetDevResource(dev, &all, CU_DEV_RESOURCE_TYPE_SM);
    if (r != 0) return cuda_fail(r, "cuDeviceGetDevResource");
    smctl_ladder* ladder = calloc(1, sizeof *ladder);
    if (!ladder) return fail(SMCTL_ENOMEM, "out of host memory");
    ladder->entries = calloc((size_t)n, sizeof(entry_t));
    if (!ladder->entries) {
        free(ladder);
        return fail(SMCTL_ENOMEM, "out of host memory");
    }
    for (int i = 0; i < n; i++) {
        CUdevResource group, rest;
        unsigned int groups = 1;
        memset(&group, 0, sizeof group);
        memset(&rest, 0, sizeof rest);
        r = drv.cuDevSmResourceSplitByCount(&group, &groups, &all, &rest, 0, (unsigned int)counts[i]);
        if (r != 0 || groups < 1) {
            rc = r != 0 ? cuda_fail(r, "cuDevSmResourceSplitByCount")
                        : fail(SMCTL_EINVAL, "no group of %d SMs could be made", counts[i]);
            ladder->n = i;
            smctl_ladder_destroy(ladder);
            return rc;
        }
        entry_t* e = &ladder->entries[i];
        e->pub.decode_sms = (int)group.sm.smCount;
        e->pub.prefill_sms = (int)rest.sm.smCount;
        ladder->n = i + 1;
        if ((side_mask & SMCTL_SIDE_DECODE)
            && (rc = make_side(dev, &group, decode_priority, &e->decode_ctx, &e->pub.decode_stream)) != SMCTL_OK) {
            smctl_ladder_destroy(ladder);
            return rc;
        }
        if ((side_mask & SMCTL_SIDE_PREFILL) && rest.sm.smCount > 0
            && (rc = make_side(dev, &rest, prefill_priority, &e->prefill_ctx, &e->pub.prefill_stream)) != SMCTL_OK) {
            smctl_ladder_destroy(ladder);
            return rc;
        }
    }
    *out = ladder;
    return SMCTL_OK;
}

int smctl_ladder_size(const smctl_ladder* ladder) { return ladder ? ladder->n : 0; }

int smctl_ladder_entry(const smctl_ladder* ladder, int index, smctl_entry* out) {
    if (!ladder || !out) return fail(SMCTL_EINVAL, "NULL ladder or out");
    if (index < 0 || index >= ladder->n) return fail(SMCTL_EINVAL, "entry %d out of range [0, %d)", index, ladder->n);
    *out = ladder->entries[index].pub;
    return SMCTL_OK;
}

int smctl_last_cuda_error(void) { return last_cuda; }

const char* smctl_last_error(void) { return last_msg; }

const char* smctl_strerror(int code) {
    switch (code) {
        case SMCTL_OK: return "ok";
        case SMCTL_ENODRIVER: return "no CUDA driver or GPU";
        case SMCTL_ENOTSUP: return "green contexts not supported by this driver";
        case SMCTL_EINVAL: return "invalid argument";
        case SMCTL_ECUDA: return "CUDA driver call failed";
        case SMCTL_ENOMEM: return "out of host memory";
        default: return "unknown smctl error";
    }
}
