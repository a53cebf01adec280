# The shared libraries and the Python module never export (and so never share)
# a C++ runtime of their own. Where libstdc++ is linked statically (a compiler
# that finds libstdc++.a first, or FXM_STATIC_LIBSTDCXX=ON), its ~100 GNU-unique
# symbols (std::num_put<char>::id and the other locale facet ids) would be
# exported and bound process-wide to whichever copy loaded first; a shared
# libstdc++ loaded later (by torch) then numbers its facets into the same ids
# and finds the wrong facet: integers print as nothing, or a crash. So every
# linked archive's symbols stay local (-Wl,--exclude-libs,ALL), _core exports
# only PyInit__core (csrc/python/exports.map) and libflagcx_mesh.so only the C
# ABI (its own map); hidden visibility is the default for the rest.
# tests/test_runtime_symbols.py checks the installed libraries and builds a
# static one both ways.

option(FXM_STATIC_LIBSTDCXX "link libstdc++ and libgcc statically (to show that the copy stays private)" OFF)
option(FXM_PRIVATE_RUNTIME
       "keep linked archives' symbols local and export only PyInit__core from _core (OFF only to show the defect)" ON)

# fxm_private_runtime(target [EXPORTS map] [KEEP_ARCHIVES]): applies the two
# options to a shared library. EXPORTS: a version script (a Python module's,
# which cannot link with --no-undefined). KEEP_ARCHIVES: the library exports
# an API taken from an archive (libflagcx_mesh_testing.so), so only the C++
# runtime's archives are named; its version script hides the rest.
function(fxm_private_runtime target)
  cmake_parse_arguments(arg "KEEP_ARCHIVES" "EXPORTS" "" ${ARGN})
  set(how "")
  if(FXM_STATIC_LIBSTDCXX)
    list(APPEND how STATIC)
  endif()
  if(FXM_PRIVATE_RUNTIME)
    list(APPEND how PRIVATE)
  endif()
  if(arg_KEEP_ARCHIVES)
    list(APPEND how KEEP_ARCHIVES)
  endif()
  if(arg_EXPORTS)
    list(APPEND how EXPORTS ${arg_EXPORTS})
  endif()
  fxm_link_runtime(${target} ${how})
endfunction()

# fxm_link_runtime(target [STATIC] [PRIVATE] [EXPORTS map] [KEEP_ARCHIVES]): the same, with
# the two choices given instead of read from the options (the test doubles link _core both
# ways from the same objects: see FXM_TEST_DOUBLES in CMakeLists.txt).
function(fxm_link_runtime target)
  cmake_parse_arguments(arg "STATIC;PRIVATE;KEEP_ARCHIVES" "EXPORTS" "" ${ARGN})
  if(arg_STATIC)
    target_link_options(${target} PRIVATE -static-libstdc++ -static-libgcc)
  endif()
  if(NOT arg_PRIVATE)
    return()
  endif()
  if(arg_KEEP_ARCHIVES)
    target_link_options(${target} PRIVATE -Wl,--exclude-libs,libstdc++.a:libsupc++.a:libgcc.a:libgcc_eh.a)
  else()
    target_link_options(${target} PRIVATE -Wl,--exclude-libs,ALL)
  endif()
  if(arg_EXPORTS)
    set(path ${CMAKE_CURRENT_SOURCE_DIR}/${arg_EXPORTS})
    target_link_options(${target} PRIVATE -Wl,--version-script=${path})
    set_target_properties(${target} PROPERTIES LINK_DEPENDS ${path})
  endif()
endfunction()
