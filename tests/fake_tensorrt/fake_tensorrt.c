/*
 * A stand-in for libnvinfer / libnvonnxparser, built by tests/tensorrt_loader.rs with
 * the system C compiler. It exports only the entry points celer's shim looks up; its
 * factories return null, as the real ones do when they cannot create an object.
 *
 *   -DFAKE_NVINFER        the libnvinfer entry points
 *   -DFAKE_NVONNXPARSER   the libnvonnxparser entry points
 *   -DFAKE_VERSION=N      what getInferLibVersion / getNvOnnxParserVersion return
 *   -DFAKE_OMIT_VERSION   leave out getInferLibVersion (not a TensorRT library)
 *   -DFAKE_OMIT_RUNTIME   leave out createInferRuntime_INTERNAL (an incomplete one)
 */
#include <stddef.h>
#include <stdint.h>

#ifdef FAKE_NVINFER
#ifndef FAKE_OMIT_VERSION
int32_t getInferLibVersion(void)
{
    return FAKE_VERSION;
}
#endif

#ifndef FAKE_OMIT_RUNTIME
void* createInferRuntime_INTERNAL(void* logger, int32_t version)
{
    (void) logger;
    (void) version;
    return NULL;
}
#endif

void* createInferBuilder_INTERNAL(void* logger, int32_t version)
{
    (void) logger;
    (void) version;
    return NULL;
}
#endif

#ifdef FAKE_NVONNXPARSER
int getNvOnnxParserVersion(void)
{
    return FAKE_VERSION;
}

void* createNvOnnxParser_INTERNAL(void* network, void* logger, int version)
{
    (void) network;
    (void) logger;
    (void) version;
    return NULL;
}
#endif
