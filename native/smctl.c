/* smctl: green-context SM partitions through the CUDA driver API, resolved at run time (see smctl.h). */
#define _GNU_SOURCE
#include "smctl.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stddef.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The few driver types we need, declared from the public CUDA headers (cuda.h 12.4 and 13.0), so the
 * library builds without them. */
typedef int CUresult;
typedef int CUdevice;
typedef void* CUcontext;
typedef void* CUgreenCtx;
typedef void* CUstream;
typedef void* CUdevResourceDesc;
enum { CUDA_SUCCESS = 0 };
enum { CU_DEV_RESOURCE_TYPE_SM = 1 };
enum { CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16 };
enum { CU_GREEN_CTX_DEFAULT_STREAM = 0x1 };
enum { CU_STREAM_NON_BLOCKING = 0x1 };
enum { CU_GET_PROC_ADDRESS_DEFAULT = 0 };
enum { SMCTL_CUDA_ABI = 12040 }; /* the CUDA version whose function signatures we declare */

/* CUdevSmResource: 12.4 declares smCount only; 12.8+/13.0 add minSmPartitionSize,
 * smCoscheduledAlignment and flags after it (zero where the driver does not fill them). */
typedef struct {
    unsigned int smCount;
    unsigned int minSmPartitionSize;
    unsigned int smCoscheduledAlignment;
    unsigned int flags;
} CUdevSmResource;

/* CUdevResource (RESOURCE_ABI_VERSION 1): type at 0, 92 bytes of driver-internal padding, the union at
 * offset 96. 12.4: union of 48 bytes (RESOURCE_ABI_EXTERNAL_BYTES). 13.0: union of 40 bytes followed by
 * `struct CUdevResource_st* nextResource`. Both are 144 bytes; we zero the whole struct before use. */
typedef struct {
    int type;
    unsigned char _internal_padding[92];
    union {
        CUdevSmResource sm;
        unsigned char _oversize[40];
    };
    void* nextResource;
} CUdevResource;
_Static_assert(sizeof(CUdevResource) == 144, "CUdevResource must be 144 bytes (cuda.h, RESOURCE_ABI_VERSION 1)");
_Static_assert(offsetof(CUdevResource, sm) == 96, "CUdevResource.sm must sit at offset 96");

typedef CUresult (*PFN_cuGetProcAddress_v2)(const char*, void**, int, unsigned long long, int*);
typedef CUresult (*PFN_cuGetProcAddress_v1)(const char*, void**, int, unsigned long long);
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
    int loaded; /* 0 not tried, 1 ok, < 0 an SMCTL error */
    void* lib;
    PFN_cuGetProcAddress_v2 getproc_v2;
    PFN_cuGetProcAddress_v1 getproc_v1;
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
    PFN_cuGetErrorString cuGetErrorName;
    int driver_version;
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

const char* smctl_cuda_error_name(int cuda_result) {
    const char* s = NULL;
    if (drv.cuGetErrorName && drv.cuGetErrorName(cuda_result, &s) == CUDA_SUCCESS && s) return s;
    return "?";
}

static int cuda_fail(CUresult r, const char* call) {
    const char* s = NULL;
    last_cuda = r;
    if (drv.cuGetErrorString) drv.cuGetErrorString(r, &s);
    return fail(SMCTL_ECUDA, "%s failed: CUresult %d %s (%s)", call, r, smctl_cuda_error_name(r), s ? s : "?");
}

static void* resolve_at(const char* name, int version) {
    void* fn = NULL;
    CUresult r;
    if (drv.getproc_v2) {
        int status = 0;
        r = drv.getproc_v2(name, &fn, version, CU_GET_PROC_ADDRESS_DEFAULT, &status);
    } else {
        r = drv.getproc_v1(name, &fn, version, CU_GET_PROC_ADDRESS_DEFAULT);
    }
    return r == CUDA_SUCCESS ? fn : NULL;
}

/* One driver entry point at the CUDA 12.4 ABI, else at the version that introduced it (up to the
 * driver's own: cuGreenCtxStreamCreate came in 12.5); NULL if this driver lacks it. */
static void* resolve(const char* name) {
    void* fn = resolve_at(name, SMCTL_CUDA_ABI);
    for (int v = 12050; !fn && v <= drv.driver_version; v += v % 1000 >= 90 ? 1000 - v % 1000 : 10)
        fn = resolve_at(name, v);
    return fn;
}

#define RESOLVE(field, name, required)                                                   \
    do {                                                                                 \
        *(void**)(&drv.field) = resolve(name);                                           \
        if (!drv.field && (required)) {                                                  \
            snprintf(drv.reason, sizeof drv.reason, "the CUDA driver lacks %s", name);   \
            return SMCTL_ENODRIVER;                                                      \
        }                                                                                \
    } while (0)

static int load_driver_locked(void) {
    drv.lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!drv.lib) {
        snprintf(drv.reason, sizeof drv.reason, "no CUDA driver: %s", dlerror());
        return SMCTL_ENODRIVER;
    }
    /* cuGetProcAddress_v2 (CUDA 12.0+) takes a status out-parameter; the plain name is the 11.3 form */
    *(void**)(&drv.getproc_v2) = dlsym(drv.lib, "cuGetProcAddress_v2");
    if (!drv.getproc_v2) *(void**)(&drv.getproc_v1) = dlsym(drv.lib, "cuGetProcAddress");
    if (!drv.getproc_v2 && !drv.getproc_v1) {
        snprintf(drv.reason, sizeof drv.reason, "the CUDA driver lacks cuGetProcAddress (older than CUDA 11.3)");
        return SMCTL_ENODRIVER;
    }
    RESOLVE(cuGetErrorString, "cuGetErrorString", 0);
    RESOLVE(cuGetErrorName, "cuGetErrorName", 0);
    RESOLVE(cuDriverGetVersion, "cuDriverGetVersion", 1);
    drv.cuDriverGetVersion(&drv.driver_version); /* needs no cuInit */
    RESOLVE(cuInit, "cuInit", 1);
    RESOLVE(cuDeviceGet, "cuDeviceGet", 1);
    RESOLVE(cuDeviceGetCount, "cuDeviceGetCount", 1);
    RESOLVE(cuDeviceGetAttribute, "cuDeviceGetAttribute", 1);
    RESOLVE(cuCtxGetCurrent, "cuCtxGetCurrent", 1);
    RESOLVE(cuCtxSetCurrent, "cuCtxSetCurrent", 1);
    RESOLVE(cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain", 1);
    RESOLVE(cuStreamDestroy, "cuStreamDestroy", 1);
    CUresult r = drv.cuInit(0);
    if (r != CUDA_SUCCESS) {
        const char* name = smctl_cuda_error_name(r);
        snprintf(drv.reason, sizeof drv.reason, "cuInit failed: CUresult %d %s (no usable GPU)", r, name);
        return SMCTL_ENODRIVER;
    }
    RESOLVE(cuDeviceGetDevResource, "cuDeviceGetDevResource", 0);
    RESOLVE(cuDevSmResourceSplitByCount, "cuDevSmResourceSplitByCount", 0);
    RESOLVE(cuDevResourceGenerateDesc, "cuDevResourceGenerateDesc", 0);
    RESOLVE(cuGreenCtxCreate, "cuGreenCtxCreate", 0);
    RESOLVE(cuGreenCtxStreamCreate, "cuGreenCtxStreamCreate", 0);
    RESOLVE(cuGreenCtxDestroy, "cuGreenCtxDestroy", 0);
    drv.has_green = drv.cuDeviceGetDevResource && drv.cuDevSmResourceSplitByCount && drv.cuDevResourceGenerateDesc
                    && drv.cuGreenCtxCreate && drv.cuGreenCtxStreamCreate && drv.cuGreenCtxDestroy;
    if (!drv.has_green)
        snprintf(drv.reason, sizeof drv.reason, "driver %d.%d lacks green contexts (needs CUDA 12.4+, R550+)",
                 drv.driver_version / 1000, drv.driver_version % 1000 / 10);
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

static int get_device(int device, CUdevice* dev, int* sm_count) {
    int count = 0;
    CUresult r = drv.cuDeviceGetCount(&count);
    if (r != CUDA_SUCCESS) return cuda_fail(r, "cuDeviceGetCount");
    if (device < 0 || device >= count) return fail(SMCTL_EINVAL, "device %d out of range [0, %d)", device, count);
    r = drv.cuDeviceGet(dev, device);
    if (r != CUDA_SUCCESS) return cuda_fail(r, "cuDeviceGet");
    r = drv.cuDeviceGetAttribute(sm_count, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, *dev);
    return r != CUDA_SUCCESS ? cuda_fail(r, "cuDeviceGetAttribute(MULTIPROCESSOR_COUNT)") : SMCTL_OK;
}

/* Green contexts need a current context on the calling thread: use the primary one (torch's). */
static int ensure_context(CUdevice dev) {
    CUcontext cur = NULL;
    CUresult r = drv.cuCtxGetCurrent(&cur);
    if (r != CUDA_SUCCESS) return cuda_fail(r, "cuCtxGetCurrent");
    if (cur) return SMCTL_OK;
    r = drv.cuDevicePrimaryCtxRetain(&cur, dev);
    if (r != CUDA_SUCCESS) return cuda_fail(r, "cuDevicePrimaryCtxRetain");
    r = drv.cuCtxSetCurrent(cur);
    return r != CUDA_SUCCESS ? cuda_fail(r, "cuCtxSetCurrent") : SMCTL_OK;
}

int smctl_version(void) { return SMCTL_VERSION; }

int smctl_capabilities(int device, smctl_caps* out) {
    if (!out) return fail(SMCTL_EINVAL, "out is NULL");
    memset(out, 0, sizeof *out);
    int rc = load_driver();
    if (rc != SMCTL_OK) {
        snprintf(out->reason, sizeof out->reason, "%s", drv.reason);
        return rc;
    }
    out->driver_version = drv.driver_version;
    CUdevice dev;
    if ((rc = get_device(device, &dev, &out->sm_count)) != SMCTL_OK) return rc;
    if (!drv.has_green) {
        snprintf(out->reason, sizeof out->reason, "%s", drv.reason);
        return SMCTL_OK;
    }
    CUdevResource res;
    memset(&res, 0, sizeof res);
    CUresult r = drv.cuDeviceGetDevResource(dev, &res, CU_DEV_RESOURCE_TYPE_SM);
    if (r != CUDA_SUCCESS) {
        snprintf(out->reason, sizeof out->reason, "cuDeviceGetDevResource(SM) failed: CUresult %d %s", r,
                 smctl_cuda_error_name(r));
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
    if (r != CUDA_SUCCESS) return cuda_fail(r, "cuDevResourceGenerateDesc");
    r = drv.cuGreenCtxCreate(ctx, desc, dev, CU_GREEN_CTX_DEFAULT_STREAM);
    if (r != CUDA_SUCCESS) return cuda_fail(r, "cuGreenCtxCreate");
    CUstream s = NULL;
    r = drv.cuGreenCtxStreamCreate(&s, *ctx, CU_STREAM_NON_BLOCKING, priority);
    if (r != CUDA_SUCCESS) return cuda_fail(r, "cuGreenCtxStreamCreate");
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
    if (!counts || n <= 0) return fail(SMCTL_EINVAL, "the ladder needs at least one decode SM count (n=%d)", n);
    if (side_mask < SMCTL_SIDE_DECODE || side_mask > SMCTL_SIDE_BOTH)
        return fail(SMCTL_EINVAL, "side_mask %d is not 1 (decode), 2 (prefill) or 3 (both)", side_mask);
    for (int i = 0; i < n; i++)
        if (counts[i] < 1) return fail(SMCTL_EINVAL, "decode SM count %d (entry %d) must be >= 1", counts[i], i);
    int rc = load_driver();
    if (rc != SMCTL_OK) return rc;
    if (!drv.has_green) return fail(SMCTL_ENOTSUP, "%s", drv.reason);
    CUdevice dev;
    int sm_count = 0;
    if ((rc = get_device(device, &dev, &sm_count)) != SMCTL_OK) return rc;
    for (int i = 0; i < n; i++)
        if (counts[i] >= sm_count)
            return fail(SMCTL_EINVAL, "decode SM count %d (entry %d) is outside [1, %d] (the GPU has %d SMs)",
                        counts[i], i, sm_count - 1, sm_count);
    if ((rc = ensure_context(dev)) != SMCTL_OK) return rc;
    CUdevResource all;
    memset(&all, 0, sizeof all);
    CUresult r = drv.cuDeviceGetDevResource(dev, &all, CU_DEV_RESOURCE_TYPE_SM);
    if (r != CUDA_SUCCESS) return cuda_fail(r, "cuDeviceGetDevResource");
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
        if (r != CUDA_SUCCESS || groups < 1) {
            rc = r != CUDA_SUCCESS ? cuda_fail(r, "cuDevSmResourceSplitByCount")
                                   : fail(SMCTL_EINVAL, "no group of %d SMs could be made", counts[i]);
            smctl_ladder_destroy(ladder);
            return rc;
        }
        entry_t* e = &ladder->entries[i];
        ladder->n = i + 1;
        e->pub.decode_sms = (int)group.sm.smCount;
        e->pub.prefill_sms = (int)rest.sm.smCount;
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
