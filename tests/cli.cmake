# Command-line checks of reshard-plan (CONTRACT.md §3), run by CTest:
#   cli.bad.<case>        every tests/bad_inputs/<case>.expect: the input is
#                         rejected with exit 1, one stderr line naming the file
#                         and the tensor/field, nothing on stdout
#   cli.example.<pair>.{json,stats,rank,summary}
#                         every examples/<pair>/{train,infer}.json: the output
#                         parses and matches the contract
#   cli.usage.*           usage errors exit 2, --help exits 0
# The checks live in tests/cli/check_cli.cmake (run with cmake -P).
if(TARGET reshard-plan)
  set(_reshard_cli_check ${CMAKE_CURRENT_LIST_DIR}/cli/check_cli.cmake)
  set(_reshard_plan $<TARGET_FILE:reshard-plan>)

  file(GLOB _reshard_bad_cases CONFIGURE_DEPENDS ${CMAKE_CURRENT_LIST_DIR}/bad_inputs/*.expect)
  foreach(expect ${_reshard_bad_cases})
    get_filename_component(name ${expect} NAME_WE)
    add_test(NAME cli.bad.${name}
             COMMAND ${CMAKE_COMMAND} -DEXE=${_reshard_plan} -DMODE=bad -DCASE=${expect} -P ${_reshard_cli_check})
    set_tests_properties(cli.bad.${name} PROPERTIES TIMEOUT 120 LABELS cli)
  endforeach()

  reshard_example_pairs(_reshard_example_dirs)
  foreach(dir ${_reshard_example_dirs})
    get_filename_component(pair ${dir} NAME)
    foreach(mode json stats rank summary)
      add_test(NAME cli.example.${pair}.${mode}
               COMMAND ${CMAKE_COMMAND} -DEXE=${_reshard_plan} -DMODE=${mode} -DSRC=${dir}/train.json
                       -DDST=${dir}/infer.json -P ${_reshard_cli_check})
      set_tests_properties(cli.example.${pair}.${mode} PROPERTIES TIMEOUT 300 LABELS cli)
    endforeach()
  endforeach()

  set(_reshard_ex ${PROJECT_SOURCE_DIR}/examples/llama-block)
  set(_pair --src|${_reshard_ex}/train.json|--dst|${_reshard_ex}/infer.json)
  reshard_cli_usage_tests(cli.usage ${_reshard_plan} cli
      "no_args|2|give --src and --dst, or --model with --train and --infer|"
      "missing_dst|2|--src requires --dst|--src|${_reshard_ex}/train.json"
      "json_and_stats|2|--json excludes --stats|${_pair}|--json|--stats"
      "negative_rank|2|--rank: Value -1 not in range|${_pair}|--rank|-1"
      "rank_not_a_number|2|--rank: Value abc not in range|${_pair}|--rank|abc"
      "unknown_option|2|The following argument was not expected: --bogus|${_pair}|--bogus"
      "help|0||--help")
endif()
