/* smctl: split one GPU's SMs into complementary partitions (green contexts) for prefill and decode.
 *
 * The library dlopens the CUDA driver (libcuda.so.1) at run time and resolves its entry points through
 * cuGetProcAddress (at the CUDA 12.4 ABI, the first with green contexts): it builds with gcc alone,
 * loads on machines without CUDA, and reports SMCTL_ENODRIVER there. Handles are opaque; streams come
 * back as uintptr_t values of CUstream, usable from Python by torch.cuda.ExternalStream.
 *
 * Every function that can fail returns 0 (SMCTL_OK) or a negative SMCTL_E* code; none exits or aborts.
 * After SMCTL_ECUDA, smctl_last_cuda_error() gives the CUresult and smctl_cuda_error_name() its name;
 * smctl_last_error() gives a message for any failure (per thread).
 *
 * Tested on: driver 580 / CUDA 13.0, H100 SXM (132 SMs; groups of >= 8 SMs in steps of 8).
 * Green contexts need a driver of CUDA 12.4+ (R550+); older drivers give green_ctx_supported = 0.
 */
#ifndef SMCTL_H
#define SMCTL_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define SMCTL_VERSION 200 /* 0.2.0 */

#define SMCTL_OK 0
#define SMCTL_ENODRIVER (-1) /* libcuda.so.1 not found, lacks cuGetProcAddress, or cuInit failed (no GPU) */
#define SMCTL_ENOTSUP (-2)   /* the driver lacks green contexts (needs CUDA 12.4+) */
#define SMCTL_EINVAL (-3)    /* a bad argument: smctl_last_error() names it */
#define SMCTL_ECUDA (-4)     /* a driver call failed: smctl_last_cuda_error() has the CUresult */
#define SMCTL_ENOMEM (-5)    /* host allocation failed */

/* Sides, as bits of side_mask: a process makes the streams of the sides it asks for only. */
#define SMCTL_SIDE_DECODE 1
#define SMCTL_SIDE_PREFILL 2
#define SMCTL_SIDE_BOTH 3

typedef struct smctl_caps {
    int driver_version;      /* cuDriverGetVersion, e.g. 13000 for CUDA 13.0 (0 without a driver) */
    int sm_count;            /* SMs of the device */
    int green_ctx_supported; /* 1 if green contexts can be created on this device */
    int min_partition_sms;   /* smallest SM group the driver grants (0: the driver does not say) */
    int partition_alignment; /* SM groups are multiples of this (0: the driver does not say) */
    char reason[160];        /* why there is no driver or no green-context support; "" otherwise */
} smctl_caps;

typedef struct smctl_entry {
    int decode_sms;          /* SMs granted to the decode side (>= the count asked for, rounded up) */
    int prefill_sms;         /* the remaining SMs, granted to the prefill side */
    uintptr_t decode_stream;  /* CUstream bound to the decode SMs; 0 if this process did not make that side */
    uintptr_t prefill_stream; /* CUstream bound to the prefill SMs; 0 if not made (or no SMs remain) */
} smctl_entry;

typedef struct smctl_ladder smctl_ladder; /* opaque */

/* SMCTL_VERSION of the loaded library. */
int smctl_version(void);

/* Fill *out for CUDA device `device` (an ordinal). Returns SMCTL_ENODRIVER without a usable driver
 * (out->reason says why), SMCTL_EINVAL for a NULL out or a device out of range, SMCTL_ECUDA if a query
 * fails, SMCTL_OK otherwise (green_ctx_supported may still be 0: out->reason says why). */
int smctl_capabilities(int device, smctl_caps* out);

/* Make one complementary split per entry of decode_sm_counts[0..n): decode gets a group of at least
 * that many SMs (the driver rounds up to its granularity), prefill the rest of the device.
 * side_mask (SMCTL_SIDE_*) chooses which sides get a green context and a stream in this process: the
 * prefill and decode workers are separate processes (MPS clients) that make the same splits and take
 * opposite sides; both sides are for a single-process user. The split is deterministic, so two
 * processes asking the same counts get the same SMs. Stream priorities are CUDA's (lower = higher).
 * Needs a current context on the calling thread or retains the device's primary context (torch's).
 * Returns SMCTL_EINVAL (NULL pointers, n < 1, side_mask not 1..3, a count outside [1, sm_count - 1]),
 * SMCTL_ENODRIVER, SMCTL_ENOTSUP, SMCTL_ECUDA, SMCTL_ENOMEM, or SMCTL_OK with *out set (free it with
 * smctl_ladder_destroy). On failure nothing is left allocated and *out is NULL. */
int smctl_ladder_create(int device, const int* decode_sm_counts, int n, int side_mask, int decode_priority,
                        int prefill_priority, smctl_ladder** out);

/* Number of entries (0 for NULL). */
int smctl_ladder_size(const smctl_ladder* ladder);

/* Copy entry `index` into *out; SMCTL_EINVAL for NULL pointers or an index out of range. */
int smctl_ladder_entry(const smctl_ladder* ladder, int index, smctl_entry* out);

/* Destroy the ladder's streams and green contexts (work queued on them should be finished first);
 * NULL is a no-op. */
void smctl_ladder_destroy(smctl_ladder* ladder);

/* The CUresult of the last failed driver call in this thread (0 if none). */
int smctl_last_cuda_error(void);

/* The driver's name for a CUresult, e.g. "CUDA_ERROR_INVALID_VALUE" (a constant; "?" if unknown). */
const char* smctl_cuda_error_name(int cuda_result);

/* A message about the last error in this thread ("" if none). */
const char* smctl_last_error(void);

/* A constant string naming an SMCTL_* code. */
const char* smctl_strerror(int code);

#ifdef __cplusplus
}
#endif
#endif /* SMCTL_H */
