# Puts the library files in their installed shape in a staging folder (run with cmake -P):
#   libmscclpp.so.<VERSION>, libmscclpp.so.<SOVERSION> -> libmscclpp.so.<VERSION>,
#   libmscclpp.so -> libmscclpp.so.<SOVERSION>, libmscclpp.a
# Inputs: SRC_SO, SRC_A (the built or prebuilt files), DST, VERSION, SOVERSION.
foreach(v SRC_SO SRC_A DST VERSION SOVERSION)
  if(NOT DEFINED ${v})
    message(FATAL_ERROR "mscclppStage.cmake: ${v} is not set")
  endif()
endforeach()
foreach(f "${SRC_SO}" "${SRC_A}")
  if(NOT EXISTS "${f}")
    message(FATAL_ERROR "mscclpp: ${f} does not exist (did the library build fail?)")
  endif()
endforeach()

file(MAKE_DIRECTORY "${DST}")
set(real "libmscclpp.so.${VERSION}")
# Resolve symlinks in the input: a prebuilt folder may hold the installed symlink chain.
get_filename_component(so "${SRC_SO}" REALPATH)
file(COPY_FILE "${so}" "${DST}/${real}" ONLY_IF_DIFFERENT)
file(COPY_FILE "${SRC_A}" "${DST}/libmscclpp.a" ONLY_IF_DIFFERENT)
file(CREATE_LINK "${real}" "${DST}/libmscclpp.so.${SOVERSION}" SYMBOLIC)
file(CREATE_LINK "libmscclpp.so.${SOVERSION}" "${DST}/libmscclpp.so" SYMBOLIC)
