// The CUDA version one build of the stand-in reports. build.rs compiles this file once per
// driver version it links (CELER_STANDIN_CUDA_VERSION, cuDriverGetVersion's encoding), and
// each library's export map leaves out the entry points that version lacks, so that a
// library says "CUDA 12.2" and behaves like one: a lookup of a newer symbol fails.
#include "standin.h"

#ifndef CELER_STANDIN_CUDA_VERSION
#error "build.rs defines CELER_STANDIN_CUDA_VERSION"
#endif

namespace standin {

int driver_version() { return CELER_STANDIN_CUDA_VERSION; }

}  // namespace standin
