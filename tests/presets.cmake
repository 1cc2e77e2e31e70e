# test_presets reads model configs from examples/models (copies of ../shared/models
# plus tiny Qwen3 / Qwen3-MoE / MLA+MTP configs), so it runs from any build dir.
if(TARGET test_presets)
  target_compile_definitions(test_presets PRIVATE RESHARD_TEST_MODELS="${PROJECT_SOURCE_DIR}/examples/models")
endif()
if(TARGET test_verify)
  target_compile_definitions(test_verify PRIVATE RESHARD_TEST_MODELS="${PROJECT_SOURCE_DIR}/examples/models")
endif()
if(TARGET test_delta)
  target_compile_definitions(test_delta PRIVATE RESHARD_TEST_MODELS="${PROJECT_SOURCE_DIR}/examples/models")
endif()
