# cmake -DBIN=... -DOUT=... -DLABEL=... -DRUNNER=... -DALONE=a,b -DWORKDIR=... -P gtest_suites.cmake
# After each build of a gtest program (uckpt_gtest_suites, tests/CMakeLists.txt): writes OUT, the
# CTest file with one test per suite of BIN (run by RUNNER, tests/gtest_suite.sh), and one per case
# for the suites named in ALONE (those with cases that may skip).
cmake_minimum_required(VERSION 3.16)
execute_process(COMMAND "${BIN}" --gtest_list_tests OUTPUT_VARIABLE listing RESULT_VARIABLE rc TIMEOUT 120)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "${BIN} --gtest_list_tests failed (${rc}): ${listing}")
endif()
string(REPLACE "," ";" alone "${ALONE}")
string(REPLACE ";" "\\;" listing "${listing}")
string(REPLACE "\n" ";" lines "${listing}")
set(script "")
set(suite "")
macro(add_one name filter)
  string(APPEND script "add_test([==[${name}]==] \"${RUNNER}\" \"${BIN}\" [==[${filter}]==])\n"
                       "set_tests_properties([==[${name}]==] PROPERTIES LABELS ${LABEL} SKIP_RETURN_CODE 77 "
                       "WORKING_DIRECTORY \"${WORKDIR}\")\n")
endmacro()
foreach(line IN LISTS lines)
  string(REGEX REPLACE " *#.*" "" line "${line}")   # "  # GetParam() = ..." comments
  if(line STREQUAL "" OR line MATCHES "^Running main")
    continue()
  endif()
  if(NOT line MATCHES "^ ")                          # "Prefix/Suite." starts a suite
    string(REGEX REPLACE "\\.$" "" suite "${line}")
    string(REGEX REPLACE "^.*/" "" bare "${suite}")
    if(NOT suite IN_LIST alone AND NOT bare IN_LIST alone)
      add_one("${suite}" "${suite}.*")
    endif()
  elseif(suite IN_LIST alone OR bare IN_LIST alone)
    string(STRIP "${line}" case)
    add_one("${suite}.${case}" "${suite}.${case}")
  endif()
endforeach()
file(WRITE "${OUT}" "${script}")
