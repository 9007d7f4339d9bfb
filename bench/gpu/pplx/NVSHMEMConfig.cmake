# Stand-in CMake package for the pip wheel nvidia-nvshmem-cu13, which ships include/ and lib/
# (libnvshmem_host.so.3, libnvshmem_device.a) but no CMake package files.
# Use: cmake ... -DNVSHMEM_DIR=<this folder> -DNVSHMEM_HOME=<site-packages>/nvidia/nvshmem
if(NOT NVSHMEM_HOME)
  set(NVSHMEM_HOME "$ENV{NVSHMEM_HOME}")
endif()
if(NOT EXISTS "${NVSHMEM_HOME}/include/nvshmem.h" OR NOT EXISTS "${NVSHMEM_HOME}/lib/libnvshmem_host.so.3"
   OR NOT EXISTS "${NVSHMEM_HOME}/lib/libnvshmem_device.a")
  set(NVSHMEM_FOUND FALSE)
  message(FATAL_ERROR "NVSHMEM_HOME='${NVSHMEM_HOME}' lacks include/nvshmem.h, lib/libnvshmem_host.so.3 or lib/libnvshmem_device.a")
endif()
set(NVSHMEM_INCLUDE_DIR "${NVSHMEM_HOME}/include")
if(NOT TARGET nvshmem::nvshmem_host)
  add_library(nvshmem::nvshmem_host SHARED IMPORTED)
  set_target_properties(nvshmem::nvshmem_host PROPERTIES
    IMPORTED_LOCATION "${NVSHMEM_HOME}/lib/libnvshmem_host.so.3"
    IMPORTED_SONAME "libnvshmem_host.so.3"
    INTERFACE_INCLUDE_DIRECTORIES "${NVSHMEM_INCLUDE_DIR}")
endif()
if(NOT TARGET nvshmem::nvshmem_device)
  add_library(nvshmem::nvshmem_device STATIC IMPORTED)
  set_target_properties(nvshmem::nvshmem_device PROPERTIES
    IMPORTED_LOCATION "${NVSHMEM_HOME}/lib/libnvshmem_device.a"
    INTERFACE_INCLUDE_DIRECTORIES "${NVSHMEM_INCLUDE_DIR}")
endif()
set(NVSHMEM_FOUND TRUE)
