# One compile-fail check (cmake -P).
#   MODE=fail (default): SOURCE must FAIL to compile with exactly one error:
#     the static_assert whose sentence its "// expect:" line names; its
#     "// context:" lines name text the diagnostic must also show (the axis,
#     dim or extent at fault).
#   MODE=pass: SOURCE must compile (the controls: every misuse swapped for its
#     correct form, so a failure above comes from the misuse, not the file).
foreach(v CXX SOURCE FLAGS_FILE)
  if(NOT DEFINED ${v})
    message(FATAL_ERROR "check.cmake needs -D${v}=...")
  endif()
endforeach()
include(${FLAGS_FILE})  # RESHARD_SF_INCLUDES, RESHARD_SF_DEFINES, RESHARD_SF_STD

set(args ${RESHARD_SF_STD} -fsyntax-only -Wall -Wextra)
foreach(dir ${RESHARD_SF_INCLUDES})
  list(APPEND args -I${dir})
endforeach()
foreach(def ${RESHARD_SF_DEFINES})
  list(APPEND args -D${def})
endforeach()

if(MODE STREQUAL "pass")
  execute_process(COMMAND ${CXX} ${args} ${SOURCE} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "the correct forms must compile, but they failed:\n${out}")
  endif()
  message(STATUS "ok: the correct forms compile")
  return()
endif()

# ';' and '[' ']' mean something in CMake lists: they travel as placeholders
# until the text is compared.
file(READ ${SOURCE} text)
string(REPLACE ";" "<semicolon>" text "${text}")
string(REPLACE "[" "<lbracket>" text "${text}")
string(REPLACE "]" "<rbracket>" text "${text}")
string(REGEX MATCHALL "// expect: [^\n]*" expect "${text}")
string(REGEX MATCHALL "// context: [^\n]*" contexts "${text}")
macro(restore var)
  string(REPLACE "<semicolon>" ";" ${var} "${${var}}")
  string(REPLACE "<lbracket>" "[" ${var} "${${var}}")
  string(REPLACE "<rbracket>" "]" ${var} "${${var}}")
endmacro()
list(LENGTH expect n)
if(NOT n EQUAL 1)
  message(FATAL_ERROR "${SOURCE}: needs exactly one '// expect: <sentence>' line")
endif()
string(REGEX REPLACE "^// expect: " "" expect "${expect}")
restore(expect)

execute_process(COMMAND ${CXX} ${args} ${SOURCE} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
if(rc EQUAL 0)
  message(FATAL_ERROR "the misuse compiled; expected: static assertion failed: ${expect}")
endif()
string(FIND "${out}" "static assertion failed: ${expect}" at)
if(at EQUAL -1)
  message(FATAL_ERROR "the misuse failed, but without the sentence '${expect}':\n${out}")
endif()
foreach(c ${contexts})
  string(REGEX REPLACE "^// context: " "" c "${c}")
  restore(c)
  string(FIND "${out}" "${c}" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "the diagnostic does not show '${c}':\n${out}")
  endif()
endforeach()
string(REGEX MATCHALL "error: " errors "${out}")
list(LENGTH errors n)
if(NOT n EQUAL 1)
  message(FATAL_ERROR "expected one error (the static_assert), got ${n}:\n${out}")
endif()
message(STATUS "ok: static assertion failed: ${expect}")
