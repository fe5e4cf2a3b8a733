/*
 * celer_standin_work.h: device work that another stand-in library queues on the stand-in
 * CUDA driver. The stand-in TensorRT (tests/tensorrt_standin) runs an engine's network
 * on the host, over device memory; queued here, it runs as a kernel would: in its
 * stream's order (when the stream is synchronised, never at the call), in its context,
 * against ranges of device memory checked when it is queued and again when it runs; and a
 * fault that library's own launches meet makes the context's error sticky, as a kernel's
 * does. Not part of the CUDA API: only the stand-in driver exports these.
 */
#ifndef CELER_STANDIN_WORK_H
#define CELER_STANDIN_WORK_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct celer_standin_range {
    unsigned long long address; /* a device pointer (CUdeviceptr) */
    size_t bytes;
    int writes;       /* 0: only read, 1: written */
    const char* what; /* for messages, e.g. "input `input.1`" (copied when queued) */
} celer_standin_range;

/*
 * Queues `run` on `stream` (a stream of the context current on the calling thread; 0, 1
 * and 2 name its null stream) and returns a CUresult.
 *
 * When queued, every range of more than 0 bytes must lie inside one live device
 * allocation of that context with no cuMemFreeAsync of it queued, as a kernel's pointer
 * must (else CUDA_ERROR_INVALID_VALUE naming `label` and the range's `what`, and nothing
 * is queued); an empty range is not checked (an empty tensor's address may be null).
 * When it runs: in a context whose error is sticky it is skipped; each range is checked
 * again (memory freed since makes the context's error sticky, CUDA_ERROR_ILLEGAL_ADDRESS,
 * naming the label, the range and its address, as a kernel's access to it would, and
 * `run` is not called); then run(user, why, why_len) is called on the synchronising
 * thread, and a nonzero return makes the context's error sticky (CUDA_ERROR_LAUNCH_FAILED,
 * "label: why"). After it, a range with writes = 0 whose bytes changed (and that no
 * written range overlaps) is a sticky CUDA_ERROR_LAUNCH_FAILED, and a write past an
 * allocation's end into its alignment padding a sticky CUDA_ERROR_ILLEGAL_ADDRESS.
 * `run` is host code, not a kernel: a fault in it ends the process (after a message
 * naming the work when the address is device memory).
 *
 * done(user) is called exactly once on every path: after run, when the work is skipped or
 * dropped (its stream or context destroyed), or at once when queuing is refused; so the
 * caller frees `user` there. It must not call the driver.
 */
int celer_standin_enqueue_work(void* stream, const char* label, const celer_standin_range* ranges, size_t nranges,
                               int (*run)(void* user, char* why, size_t why_len), void (*done)(void* user), void* user);

/*
 * Makes `context`'s error sticky with `code` (CUDA_ERROR_ILLEGAL_ADDRESS, _LAUNCH_FAILED,
 * _ILLEGAL_INSTRUCTION, _MISALIGNED_ADDRESS or _HARDWARE_STACK_ERROR; anything else is
 * CUDA_ERROR_INVALID_VALUE), as a fault of a kernel the calling library launched there
 * would: every later call in the context returns it until the context is destroyed or
 * reset. `message` says what faulted (the driver's last error and stderr). A context
 * already sticky keeps its first error. Returns a CUresult (CUDA_ERROR_INVALID_CONTEXT for
 * a context that is not live).
 */
int celer_standin_make_sticky(void* context, int code, const char* message);

#ifdef __cplusplus
}
#endif

#endif /* CELER_STANDIN_WORK_H */
