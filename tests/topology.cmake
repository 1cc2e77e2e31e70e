# Command-line checks of reshard-plan --topology / --hierarchical / --simulate
# (topology.hpp, hierarchical.hpp, simulate.hpp), on tests/topology/*.json:
# a 2-rank source and a dp=2 x tp=2 destination on 4-GPU NVLink domains.
if(TARGET reshard-plan)
  set(_t ${CMAKE_CURRENT_LIST_DIR}/topology)
  set(_p $<TARGET_FILE:reshard-plan> --src ${_t}/src.json --dst ${_t}/dst.json)
  add_test(NAME topology.cli.hierarchical_json
           COMMAND ${_p} --topology ${_t}/four-gpu-domains.json --hierarchical --json)
  set_tests_properties(topology.cli.hierarchical_json PROPERTIES LABELS cli
                       PASS_REGULAR_EXPRESSION "\"stage\":[1-9][0-9]*,\"src_layout\":\"dst\"")
  add_test(NAME topology.cli.simulate_stats
           COMMAND ${_p} --topology ${_t}/four-gpu-domains.json --hierarchical --simulate --stats)
  set_tests_properties(topology.cli.simulate_stats PROPERTIES LABELS cli
                       PASS_REGULAR_EXPRESSION "\"predicted_seconds\":[0-9.e-]+.*\"stages\":[2-9]")
  add_test(NAME topology.cli.simulate_summary COMMAND ${_p} --topology gb200-nvl72 --simulate --fp8-wire)
  set_tests_properties(topology.cli.simulate_summary PROPERTIES LABELS cli
                       PASS_REGULAR_EXPRESSION "lower bound .*stage 0 ")
  # A delta refit predicted at 2.57% changed (docs/delta.md): 333 of the 8704 network bytes on the wire, the
  # figure this change prints (a regression check; the per-byte fraction is checked by hand in test_delta).
  add_test(NAME topology.cli.simulate_delta COMMAND ${_p} --topology gb200-nvl72 --simulate --delta-density 0.0257)
  set_tests_properties(topology.cli.simulate_delta PROPERTIES LABELS cli
                       PASS_REGULAR_EXPRESSION "delta refit  at changed fraction 0.0257 [^\n]* 333 B on the wire .0.0382 of dense.. diff .* slices")
  # Errors: the exit status, nothing on stdout, one stderr line naming the fault
  # (the same checker as reshard-plan's bad inputs, tests/cli/check_cli.cmake).
  set(_src --src|${_t}/src.json|--dst|${_t}/dst.json)
  reshard_cli_usage_tests(topology.cli $<TARGET_FILE:reshard-plan> cli
      "bad_field|1|bad-field.json: nic_gbps: -5 must be a positive number|${_src}|--topology|${_t}/bad-field.json"
      "unknown|1|topology 'no-such-cluster': neither a preset|${_src}|--topology|no-such-cluster"
      "needs_topology|2|--hierarchical requires --topology|${_src}|--hierarchical"
      "no_rank|2|--rank excludes --topology|${_src}|--topology|h100-8x400g|--rank|2"
      "delta_fp8|2|--fp8-wire excludes --delta-density|${_src}|--topology|gb200-nvl72|--simulate|--fp8-wire|--delta-density|0.1"
      "delta_range|2|--delta-density: Value 1.5 not in range|${_src}|--topology|gb200-nvl72|--simulate|--delta-density|1.5")
endif()
