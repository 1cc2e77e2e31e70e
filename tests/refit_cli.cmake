# Command-line checks of reshard-refit (CONTRACT.md §3), run by CTest:
#   refit.default            the embedded model validates (--json, one iteration)
#   refit.example.<pair>     every examples/<pair>/{train,infer}.json refits and validates
#   refit.hierarchical.*     a hierarchical (staged) plan runs and validates
#   refit.usage.*            usage errors: an unknown transport, --hierarchical without --topology
if(TARGET reshard-refit)
  add_test(NAME refit.default COMMAND reshard-refit --iterations 1 --json)
  set_tests_properties(refit.default PROPERTIES TIMEOUT 600 LABELS refit
                       PASS_REGULAR_EXPRESSION "\"validated\":true")
  file(GLOB _reshard_refit_examples CONFIGURE_DEPENDS LIST_DIRECTORIES true ${PROJECT_SOURCE_DIR}/examples/*)
  foreach(dir ${_reshard_refit_examples})
    if(NOT EXISTS ${dir}/train.json OR NOT EXISTS ${dir}/infer.json)
      continue()
    endif()
    get_filename_component(pair ${dir} NAME)
    add_test(NAME refit.example.${pair}
             COMMAND reshard-refit --src ${dir}/train.json --dst ${dir}/infer.json --iterations 2 --json --staging-budget 4096)
    set_tests_properties(refit.example.${pair} PROPERTIES TIMEOUT 120 LABELS refit
                         PASS_REGULAR_EXPRESSION "\"validated\":true")
  endforeach()
  # The hierarchical (staged) plan run stage by stage (fan-out copies
  # inside the destination's NVLink domain).
  add_test(NAME refit.hierarchical.moe-experts
           COMMAND reshard-refit --src ${PROJECT_SOURCE_DIR}/examples/moe-experts/train.json
                   --dst ${PROJECT_SOURCE_DIR}/examples/moe-experts/infer.json --topology h100-8x400g --placement separate
                   --hierarchical --pipeline 2 --iterations 2 --json --staging-budget 4096)
  set_tests_properties(refit.hierarchical.moe-experts PROPERTIES TIMEOUT 120 LABELS refit
                       PASS_REGULAR_EXPRESSION "\"validated\":true")
  add_test(NAME refit.usage.hierarchical COMMAND reshard-refit --hierarchical)
  set_tests_properties(refit.usage.hierarchical PROPERTIES TIMEOUT 60 LABELS refit
                       PASS_REGULAR_EXPRESSION "--hierarchical needs --topology")
  add_test(NAME refit.usage.transport COMMAND reshard-refit --transport carrier-pigeon)
  set_tests_properties(refit.usage.transport PROPERTIES TIMEOUT 60 LABELS refit
                       PASS_REGULAR_EXPRESSION "unknown transport 'carrier-pigeon'")
endif()
