/*
 * stdint.h for NVRTC only (compile_flags("nvrtc") puts this folder on the include path).
 * NVRTC ships no C library headers, and mscclpp.h includes <stdint.h>. NVRTC compiles for the
 * host's data model; on the 64-bit Linux hosts the package is built for, long is 64 bits, as
 * in glibc's own typedefs.
 */
#ifndef MSCCLPP_RS_NVRTC_STDINT_H_
#define MSCCLPP_RS_NVRTC_STDINT_H_
#if !defined(__CUDACC_RTC__)
#error "mscclpp_rs/nvrtc/stdint.h is for NVRTC: use the system's <stdint.h> elsewhere"
#endif
typedef signed char int8_t;
typedef short int16_t;
typedef int int32_t;
typedef long int64_t;
typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
typedef unsigned long uint64_t;
typedef long intptr_t;
typedef unsigned long uintptr_t;
static_assert(sizeof(uint64_t) == 8 && sizeof(uintptr_t) == sizeof(void*), "LP64 data model expected");
#endif
