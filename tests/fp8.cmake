# test_quant refits preset layouts of tests/models (tiny-moe) into FP8.
if(TARGET test_quant)
  target_compile_definitions(test_quant PRIVATE RESHARD_TEST_MODELS="${CMAKE_CURRENT_SOURCE_DIR}/models")
endif()
