# test_quant refits preset layouts of examples/models (tiny-moe) into FP8.
if(TARGET test_quant)
  target_compile_definitions(test_quant PRIVATE RESHARD_TEST_MODELS="${PROJECT_SOURCE_DIR}/examples/models")
endif()
# reshard-plan --model with FP8 inference specs: bad quant values and quant on
# the training side are one clear error each; a tp cut that splits 128-row
# tiles (vLLM refuses it too) names the tensor.
if(TARGET reshard-plan)
  set(_fp8_model --model|${PROJECT_SOURCE_DIR}/examples/models/tiny-moe.json)
  reshard_cli_usage_tests(fp8.cli $<TARGET_FILE:reshard-plan> cli
      "quant_unknown|1|quant='int4' is not one of fp8, mxfp8, none|${_fp8_model}|--train|tp=2|--infer|tp=2,quant=int4|--stats"
      "quant_on_train|1|quant is an inference key|${_fp8_model}|--train|tp=2,quant=fp8|--infer|tp=2|--stats"
      "quant_cuts_tiles|1|cuts tiles of 128 along dim 0|${_fp8_model}|--train|tp=2|--infer|tp=2,quant=fp8|--stats"
      "fp8_wire_on_fp8_plan|1|--fp8-wire: the destination already has quantized (FP8) tensors|${_fp8_model}|--train|tp=2,dp=1,ep=2|--infer|tp=1,dp=2,ep=2,quant=fp8|--topology|gb200-nvl72|--simulate|--fp8-wire")
  # The simulator on a real FP8 plan: its network bytes are the plan's wire
  # bytes (10,581,568 B for this pair, as reshard-refit moves them).
  add_test(NAME fp8.cli.simulate
           COMMAND $<TARGET_FILE:reshard-plan> --model ${PROJECT_SOURCE_DIR}/examples/models/tiny-moe.json --train tp=2,dp=1,ep=2
                   --infer tp=1,dp=2,ep=2,quant=fp8 --topology gb200-nvl72 --placement separate --simulate)
  set_tests_properties(fp8.cli.simulate PROPERTIES LABELS cli
                       PASS_REGULAR_EXPRESSION "FP8 destinations: the plan's wire bytes.*lower bound .*stage 0 .*network 10.09 MiB \\(10581568 B\\)")
endif()
