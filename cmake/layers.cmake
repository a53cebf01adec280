# Layered static libraries. Each layer L gets an include root of its own,
# ${CMAKE_BINARY_DIR}/layers/L, holding links to csrc/L and to the layers it
# may use; sources include "layer/file.h" through that root only, so an
# include of a layer above (or beside) L is "file not found".

set(FXM_SRC ${CMAKE_CURRENT_SOURCE_DIR}/csrc)

# fxm_layer_includes(target self lower...): the include root of `self`.
function(fxm_layer_includes target self)
  set(root ${CMAKE_BINARY_DIR}/layers/${self})
  file(MAKE_DIRECTORY ${root})
  foreach(layer ${self} ${ARGN})
    if(NOT EXISTS ${root}/${layer})
      file(CREATE_LINK ${FXM_SRC}/${layer} ${root}/${layer} SYMBOLIC)
    endif()
  endforeach()
  target_include_directories(${target} PRIVATE ${root} ${FXM_SRC}/include)
endfunction()

# fxm_add_layer(name lower...): static library fxm_<name> of csrc/<name>/**.cc,
# linked to the layer archives below it (headers only of capi).
function(fxm_add_layer name)
  file(GLOB_RECURSE sources CONFIGURE_DEPENDS ${FXM_SRC}/${name}/*.cc)
  add_library(fxm_${name} STATIC ${sources})
  fxm_layer_includes(fxm_${name} ${name} ${ARGN})
  target_compile_options(fxm_${name} PRIVATE -Wall -Wextra)
  foreach(lower ${ARGN})
    if(TARGET fxm_${lower})  # capi is a shared library of its own, not a layer archive
      target_link_libraries(fxm_${name} PUBLIC fxm_${lower})
    endif()
  endforeach()
endfunction()

# fxm_add_exports(target map): a shared library exporting only what `map` lists.
function(fxm_add_exports target map)
  set(path ${CMAKE_CURRENT_SOURCE_DIR}/${map})
  target_link_options(${target} PRIVATE -Wl,--version-script=${path} -Wl,--no-undefined)
  set_target_properties(${target} PROPERTIES LINK_DEPENDS ${path})
endfunction()
