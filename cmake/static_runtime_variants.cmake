# Test doubles for tests/test_runtime_symbols.py: the shipped objects linked with a static
# libstdc++, so the test sees what a compiler that finds libstdc++.a first would ship. Only
# links (the objects are the wheel's own), into FXM_TEST_DOUBLES_DIR/static-runtime/:
#   private/   _core and libflagcx_mesh.so as shipped (archives' symbols local, export maps)
#   exported/  _core as v0.2 linked it (no --exclude-libs, no export map): shows the defect
foreach(variant private exported)
  set(dir "${FXM_TEST_DOUBLES_DIR}/static-runtime/${variant}")
  set(how STATIC)
  if(variant STREQUAL "private")
    set(how STATIC PRIVATE)
  endif()
  pybind11_add_module(_core_static_${variant} MODULE $<TARGET_OBJECTS:fxm_python_objects>)
  target_link_libraries(_core_static_${variant} PRIVATE fxm_testing fxm_adaptor fxm_agent)
  fxm_link_runtime(_core_static_${variant} ${how} EXPORTS csrc/python/exports.map)
  set_target_properties(_core_static_${variant} PROPERTIES OUTPUT_NAME _core LIBRARY_OUTPUT_DIRECTORY "${dir}")
endforeach()
add_library(flagcx_mesh_static_private SHARED $<TARGET_OBJECTS:fxm_capi_objects>)
target_link_libraries(flagcx_mesh_static_private PRIVATE fxm_adaptor fxm_agent)
fxm_add_exports(flagcx_mesh_static_private csrc/capi/exports.map)
fxm_link_runtime(flagcx_mesh_static_private STATIC PRIVATE)
set_target_properties(flagcx_mesh_static_private PROPERTIES OUTPUT_NAME flagcx_mesh
                      LIBRARY_OUTPUT_DIRECTORY "${FXM_TEST_DOUBLES_DIR}/static-runtime/private")
