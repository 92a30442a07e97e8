/* Version, status names and build identity. */
#include "spice.h"

/* patches/series as the build applied it (CMakeLists.txt) */
#ifndef SPICE_PATCH_SERIES
#define SPICE_PATCH_SERIES ""
#endif

const char * spice_version_string(void) {
    return "0.1.0";
}

const char * spice_status_string(int status) {
    switch (status) {
        case SPICE_OK:               return "ok";
        case SPICE_ERR_INVALID_ARG:  return "invalid argument";
        case SPICE_ERR_UNSUPPORTED:  return "unsupported";
        case SPICE_ERR_NO_MEMORY:    return "out of memory";
        case SPICE_ERR_INCOMPATIBLE: return "incompatible model settings";
        case SPICE_ERR_INVALID_PLAN: return "invalid plan";
        case SPICE_ERR_BUDGET:       return "over the device budget";
        case SPICE_ERR_STATE:        return "invalid state";
        case SPICE_ERR_INTERNAL:     return "internal error";
        default:                     return "unknown status";
    }
}

const char * spice_build_patch_series(void) {
    return SPICE_PATCH_SERIES;
}
