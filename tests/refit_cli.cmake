# Command-line checks of reshard-refit (CONTRACT.md §3), run by CTest through
# tests/cli/check_cli.cmake (exit status, stderr and the JSON's own figures;
# never a text match that the baseline's output could satisfy):
#   refit.default            the embedded model validates (--json, one iteration)
#   refit.example.<pair>     every examples/<pair>/{train,infer}.json refits and validates
#   refit.hierarchical.*     a hierarchical (staged) plan runs and validates
#   refit.delta.*            --delta: Adam-evolved versions, delta and dense refits, validated
#   refit.usage.*            usage errors: an unknown transport, --hierarchical without --topology
if(TARGET reshard-refit)
  set(_reshard_check ${CMAKE_CURRENT_LIST_DIR}/cli/check_cli.cmake)
  set(_reshard_refit $<TARGET_FILE:reshard-refit>)
  # name, timeout, baseline (ON/OFF), then the arguments ('|'-separated).
  function(reshard_refit_test name timeout baseline args)
    set(delta OFF)
    if(args MATCHES "--delta")
      set(delta ON)
    endif()
    add_test(NAME ${name}
             COMMAND ${CMAKE_COMMAND} -DEXE=${_reshard_refit} -DMODE=refit "-DARGS=${args}" -DBASELINE=${baseline}
                     -DDELTA=${delta} -DTIMEOUT=${timeout} -P ${_reshard_check})
    set_tests_properties(${name} PROPERTIES TIMEOUT ${timeout} LABELS refit)
  endfunction()
  reshard_refit_test(refit.default 600 ON "--iterations|1|--json")
  reshard_example_pairs(_reshard_refit_examples)
  foreach(dir ${_reshard_refit_examples})
    get_filename_component(pair ${dir} NAME)
    reshard_refit_test(refit.example.${pair} 120 ON
                       "--src|${dir}/train.json|--dst|${dir}/infer.json|--iterations|2|--json|--staging-budget|4096")
  endforeach()
  # The hierarchical (staged) plan run stage by stage (fan-out copies
  # inside the destination's NVLink domain).
  set(_moe ${PROJECT_SOURCE_DIR}/examples/moe-experts)
  reshard_refit_test(refit.hierarchical.moe-experts 120 ON
                     "--src|${_moe}/train.json|--dst|${_moe}/infer.json|--topology|h100-8x400g|--placement|separate|--hierarchical|--pipeline|2|--iterations|2|--json|--staging-budget|4096")
  # Delta refits: tiny-llama Megatron tp=2 -> vLLM tp=4, Adam at lr 1e-6 and
  # at lr 1e-3 (most elements change: the dense fallback).
  set(_tiny ${PROJECT_SOURCE_DIR}/examples/models/tiny-llama.json)
  # The traditional refit is the baseline with --delta too (CONTRACT.md §3); --no-baseline drops it.
  reshard_refit_test(refit.delta.tiny-llama 120 ON "--model|${_tiny}|--train|tp=2|--infer|tp=4|--delta|--versions|4|--iterations|2|--json")
  reshard_refit_test(refit.delta.dense-fallback 120 OFF "--model|${_tiny}|--train|tp=2|--infer|tp=4|--delta|--versions|3|--lr|1e-3|--dense-above|0.2|--no-baseline|--json")
  # An f32 master cast in flight to bf16 (--master-f32): the delta refit diffs the bf16 values.
  reshard_refit_test(refit.delta.master-f32 120 OFF "--model|${_tiny}|--train|tp=2|--infer|tp=4|--delta|--master-f32|--versions|4|--json")
  reshard_cli_usage_tests(refit.usage ${_reshard_refit} refit
      "delta-versions|2|only go with --delta|--versions|3"
      "master-f32|2|only go with --delta|--master-f32"
      "hierarchical|2|--hierarchical needs --topology|--hierarchical"
      "transport|2|unknown transport 'carrier-pigeon'|--transport|carrier-pigeon"
      "nccl-delta|2|--transport nccl does not run --delta yet|--transport|nccl|--delta")
  # --transport nccl under mpirun (reshard-refit runs reshard-refit-nccl):
  # where each rank has a GPU, a validated refit; where not (CI has none;
  # NCCL cannot put two ranks of one communicator on one GPU), every rank
  # names the rule and the job fails.
  if(TARGET reshard-refit-nccl AND RESHARD_MPIRUN)
    list(SUBLIST RESHARD_MPIRUN 1 -1 _mpirun_args)
    string(JOIN "|" _mpirun_args ${_mpirun_args})
    add_test(NAME refit.nccl.gpu_per_rank
             COMMAND ${CMAKE_COMMAND} -DEXE=${MPIEXEC_EXECUTABLE} -DMODE=nccl
                     "-DARGS=${_mpirun_args}|${MPIEXEC_NUMPROC_FLAG}|2|${_reshard_refit}|--transport|nccl|--model|${_tiny}|--train|tp=1|--infer|tp=1|--no-baseline|--iterations|2|--json"
                     -DTIMEOUT=170 -P ${_reshard_check})
    set_tests_properties(refit.nccl.gpu_per_rank PROPERTIES TIMEOUT 180 LABELS "refit;mpi" ENVIRONMENT "${RESHARD_MPI_ENV}")
  endif()
endif()
