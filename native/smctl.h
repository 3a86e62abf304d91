/* smctl: split a GPU's SMs into complementary partitions (green contexts) for prefill and decode.
 *
 * The library dlopens the CUDA driver (libcuda.so.1) at run time: it builds with gcc alone, loads on
 * machines without CUDA, and reports SMCTL_ENODRIVER there. Handles are opaque; streams are returned as
 * uintptr_t values of CUstream, usable by torch.cuda.ExternalStream.
 *
 * Every function returns 0 (SMCTL_OK) or a negative SMCTL_E* code; none exits or aborts. After
 * SMCTL_ECUDA, smctl_last_cuda_error() gives the CUresult and smctl_last_error() a message.
 * Tested on: driver 580 / CUDA 13.0 (H100); green contexts need driver >= 12.4 (550).
 */
#ifndef SMCTL_H
#define SMCTL_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define SMCTL_OK 0
#define SMCTL_ENODRIVER (-1) /* libcuda.so.1 not found, or cuInit failed (no GPU) */
#define SMCTL_ENOTSUP (-2)   /* the driver lacks green contexts (needs CUDA 12.4+) */
#define SMCTL_EINVAL (-3)    /* a bad argument: see smctl_last_error() */
#define SMCTL_ECUDA (-4)     /* a driver call failed: see smctl_last_cuda_error() */
#define SMCTL_ENOMEM (-5)    /* host allocation failed */

#define SMCTL_SIDE_DECODE 1
#define SMCTL_SIDE_PREFILL 2

typedef struct smctl_caps {
    int driver_version;       /* e.g. 13000 for CUDA 13.0 */
    int sm_count;             /* SMs of the device */
    int green_ctx_supported;  /* 1 if green contexts can be created */
    int min_partition_sms;    /* smallest SM group the driver grants */
    int partition_alignment;  /* SM groups are multiples of this */
    char reason[160];         /* why something is unsupported; empty otherwise */
} smctl_caps;

typedef struct smctl_entry {
    int decode_sms;           /* SMs granted to the decode side (>= the count asked for) */
    int prefill_sms;          /* the remaining SMs, granted to the prefill side */
    uintptr_t decode_stream;  /* CUstream on the decode side's green context; 0 if that side was not made */
    uintptr_t prefill_stream; /* CUstream on the prefill side's green context; 0 if that side was not made */
} smctl_entry;

typedef struct smctl_ladder smctl_ladder;

/* Library version, e.g. 100 for 0.1.0. */
int smctl_version(void);

/* Fill *out for CUDA device `device`. Returns SMCTL_ENODRIVER without a driver (out->reason says why),
 * SMCTL_EINVAL for a bad device or NULL out, SMCTL_OK otherwise (green_ctx_supported may be 0). */
int smctl_capabilities(int device, smctl_caps* out);

/* Make one complementary split per entry of decode_sm_counts: decode gets a group of at least that many
 * SMs, prefill the rest. side_mask (SMCTL_SIDE_*) chooses which sides get a green context and stream in
 * this process (the prefill and decode workers each make the same splits and take opposite sides).
 * Priorities are CUDA stream priorities (lower = higher priority). Counts must be in [1, sm_count - 1].
 * Returns SMCTL_EINVAL, SMCTL_ENODRIVER, SMCTL_ENOTSUP, SMCTL_ECUDA or SMCTL_OK (*out set). */
int smctl_ladder_create(int device, const int* decode_sm_counts, int n, int side_mask, int decode_priority,
                        int prefill_priority, smctl_ladder** out);

/* Number of entries. */
int smctl_ladder_size(const smctl_ladder* ladder);

/* Entry `index` of the ladder; SMCTL_EINVAL if out of range. */
int smctl_ladder_entry(const smctl_ladder* ladder, int index, smctl_entry* out);

/* Destroy the streams and green contexts; NULL is a no-op. */
void smctl_ladder_destroy(smctl_ladder* ladder);

/* The CUresult of the last failed driver call in this thread (0 if none). */
int smctl_last_cuda_error(void);

/* A message about the last error in this thread ("" if none). */
const char* smctl_last_error(void);

/* A constant string naming an SMCTL_* code. */
const char* smctl_strerror(int code);

#ifdef __cplusplus
}
#endif
#endif /* SMCTL_H */
