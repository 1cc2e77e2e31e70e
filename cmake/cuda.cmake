# CUDA copy kernels and the NCCL transport, where nvcc is found.
#   reshard::cuda   INTERFACE: reshard + CUDA::cudart; CUDA sources are compiled with -std=c++20
#   reshard::nccl   INTERFACE: reshard::cuda + libnccl (found next to the toolkit: NCCL
#                   ships no CMake package)
# CMake 3.25 has no C++20 flag for nvcc: it is given below (CUDA_STANDARD 20 then works).
# Architectures: 90 (H100/H200) unless CMAKE_CUDA_ARCHITECTURES is given.
# On by default only in reshard's own build: a parent project that adds
# reshard by add_subdirectory does not get the CUDA language enabled for it.
option(RESHARD_WITH_CUDA "Build the CUDA kernels, the NCCL transport and their tests where nvcc is found" ${PROJECT_IS_TOP_LEVEL})
if(NOT RESHARD_WITH_CUDA)
  message(STATUS "reshard: RESHARD_WITH_CUDA=OFF: CUDA kernels, NCCL transport and GPU tests are skipped")
  return()
endif()
include(CheckLanguage)
check_language(CUDA)
if(NOT CMAKE_CUDA_COMPILER)
  message(STATUS "reshard: nvcc not found: CUDA kernels, NCCL transport and GPU tests are skipped")
  return()
endif()
if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
  set(CMAKE_CUDA_ARCHITECTURES 90 CACHE STRING "CUDA architectures for reshard's kernels (90 = H100/H200)")
endif()
enable_language(CUDA)
find_package(CUDAToolkit REQUIRED)
# reshard::reshard requires cxx_std_20, which CMake also asks of CUDA sources;
# 3.25 knows no C++20 flag for nvcc, so teach it the one nvcc >= 12 takes.
if(NOT CMAKE_CUDA20_STANDARD_COMPILE_OPTION)
  set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
  set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
endif()
if(NOT "cuda_std_20" IN_LIST CMAKE_CUDA_COMPILE_FEATURES)
  list(APPEND CMAKE_CUDA_COMPILE_FEATURES cuda_std_20)
endif()

if(NOT TARGET reshard_cuda)
  add_library(reshard_cuda INTERFACE)
  add_library(reshard::cuda ALIAS reshard_cuda)
  target_link_libraries(reshard_cuda INTERFACE reshard::reshard CUDA::cudart)
  target_compile_definitions(reshard_cuda INTERFACE RESHARD_WITH_CUDA=1)
  # fmt 9 turns constexpr off under nvcc but keeps its consteval format
  # checks, which then call non-constexpr functions: both nvcc and g++ reject
  # that. nvcc 12+ handles fmt's constexpr code, so turn it back on.
  target_compile_options(reshard_cuda INTERFACE
    $<$<COMPILE_LANGUAGE:CUDA>:--expt-relaxed-constexpr -Xcompiler=-Wall,-Wextra -DFMT_USE_CONSTEXPR=1>)
endif()

# NCCL inside the toolkit (or NCCL_ROOT / the system).
get_filename_component(_reshard_cuda_root "${CUDAToolkit_LIBRARY_DIR}" DIRECTORY)
find_path(RESHARD_NCCL_INCLUDE_DIR nccl.h
  HINTS $ENV{NCCL_ROOT} ${NCCL_ROOT} ${CUDAToolkit_INCLUDE_DIRS} ${_reshard_cuda_root}
  PATH_SUFFIXES include)
find_library(RESHARD_NCCL_LIBRARY NAMES nccl
  HINTS $ENV{NCCL_ROOT} ${NCCL_ROOT} ${CUDAToolkit_LIBRARY_DIR} ${_reshard_cuda_root}
  PATH_SUFFIXES lib lib64)
if(RESHARD_NCCL_INCLUDE_DIR AND RESHARD_NCCL_LIBRARY)
  file(STRINGS "${RESHARD_NCCL_INCLUDE_DIR}/nccl.h" _reshard_nccl_version REGEX "^#define NCCL_(MAJOR|MINOR|PATCH) ")
  string(REGEX REPLACE ".*NCCL_MAJOR ([0-9]+).*NCCL_MINOR ([0-9]+).*NCCL_PATCH ([0-9]+).*" "\\1.\\2.\\3"
         RESHARD_NCCL_VERSION "${_reshard_nccl_version}")
  message(STATUS "reshard: NCCL ${RESHARD_NCCL_VERSION}: ${RESHARD_NCCL_LIBRARY}")
  if(NOT TARGET reshard_nccl)
    add_library(reshard_nccl INTERFACE)
    add_library(reshard::nccl ALIAS reshard_nccl)
    target_include_directories(reshard_nccl INTERFACE ${RESHARD_NCCL_INCLUDE_DIR})
    target_link_libraries(reshard_nccl INTERFACE reshard::cuda ${RESHARD_NCCL_LIBRARY})
    target_compile_definitions(reshard_nccl INTERFACE RESHARD_WITH_NCCL=1)
  endif()
else()
  message(STATUS "reshard: NCCL not found next to the CUDA toolkit (set NCCL_ROOT): the NCCL transport is skipped")
endif()
message(STATUS "reshard: CUDA ${CUDAToolkit_VERSION} (nvcc ${CMAKE_CUDA_COMPILER}), architectures ${CMAKE_CUDA_ARCHITECTURES}")

# The device check's bandwidth program (bench/gpu_check.sh builds and runs it).
if(PROJECT_IS_TOP_LEVEL AND NOT SKBUILD AND NOT TARGET gpu-bandwidth)
  add_executable(gpu-bandwidth ${CMAKE_CURRENT_LIST_DIR}/../bench/gpu_bandwidth.cu)
  target_link_libraries(gpu-bandwidth PRIVATE reshard_cuda)
endif()

# reshard-refit --transport nccl: the same tool built with NCCL, MPI and the
# CUDA copy kernels (tools/cuda_copy_engine.cu), as an executable of its own,
# so that the main job's reshard-refit needs no nvcc; reshard-refit runs it
# for --transport nccl.
if(PROJECT_IS_TOP_LEVEL AND RESHARD_BUILD_TOOLS AND TARGET reshard_nccl AND MPI_CXX_FOUND AND NOT TARGET reshard-refit-nccl)
  add_executable(reshard-refit-nccl ${CMAKE_CURRENT_LIST_DIR}/../tools/reshard_refit.cpp ${CMAKE_CURRENT_LIST_DIR}/../tools/cuda_copy_engine.cu)
  target_link_libraries(reshard-refit-nccl PRIVATE reshard_support reshard_nccl CLI11::CLI11 MPI::MPI_CXX)
  target_compile_options(reshard-refit-nccl PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wpedantic>)
  target_compile_definitions(reshard-refit-nccl PRIVATE RESHARD_HAVE_NCCL)
  if(TARGET reshard_ucx)
    target_link_libraries(reshard-refit-nccl PRIVATE reshard::ucx)
    target_compile_definitions(reshard-refit-nccl PRIVATE RESHARD_HAVE_UCX)
  endif()
endif()
