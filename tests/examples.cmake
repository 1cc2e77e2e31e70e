# The examples a newcomer copies, built and run as they are written:
#   example.minimal_refit   examples/minimal_refit.cpp in this build: a refit, every element checked
#   example.find_package    reshard installed into the build folder, then examples/find-package
#                           (an out-of-tree project: find_package(reshard)) configured, built and run
#   example.static_layout   (tests/static_fail.cmake) examples/static_layout.cpp
add_executable(example_minimal_refit ${PROJECT_SOURCE_DIR}/examples/minimal_refit.cpp)
target_link_libraries(example_minimal_refit PRIVATE reshard::reshard reshard_warnings)
add_test(NAME example.minimal_refit COMMAND example_minimal_refit)
set_tests_properties(example.minimal_refit PROPERTIES TIMEOUT 120 PASS_REGULAR_EXPRESSION "^rank 4 received [0-9]+ bytes.*\nok: 0 wrong elements")

set(_consumer ${CMAKE_BINARY_DIR}/find-package-example)
add_test(NAME example.find_package
         COMMAND ${CMAKE_COMMAND} -DBUILD_DIR=${CMAKE_BINARY_DIR} -DSOURCE_DIR=${PROJECT_SOURCE_DIR}/examples/find-package
                 -DWORK_DIR=${_consumer} -DGENERATOR=${CMAKE_GENERATOR} -P ${CMAKE_CURRENT_SOURCE_DIR}/cli/find_package_example.cmake)
set_tests_properties(example.find_package PROPERTIES TIMEOUT 600 LABELS example)

# examples/layout_in_code.cpp: layouts written in code with reshard::LayoutBuilder (as the JSON reads), a tp=3 -> tp=2 refit
# into a fused buffer, every element checked against a formula written out by hand.
add_executable(example_layout_in_code ${PROJECT_SOURCE_DIR}/examples/layout_in_code.cpp)
target_link_libraries(example_layout_in_code PRIVATE reshard::reshard reshard_warnings)
add_test(NAME example.layout_in_code COMMAND example_layout_in_code)
set_tests_properties(example.layout_in_code PROPERTIES TIMEOUT 120 PASS_REGULAR_EXPRESSION "^ok: 0 wrong elements")
