# The engine's clients (python/src, src/cli, src/models, examples) use the
# public API (include/uckpt) only: not src/engine's state (engine/engine_impl.h,
# EngineAccess::State), which is the engine's and its tests' own.
# cmake -DSOURCE_DIR=<repo> -P clients_public_api.cmake; fails naming each use.
set(found "")
foreach(dir python/src src/cli src/models examples)
  file(GLOB_RECURSE files "${SOURCE_DIR}/${dir}/*.cc" "${SOURCE_DIR}/${dir}/*.h" "${SOURCE_DIR}/${dir}/*.cpp")
  foreach(f ${files})
    file(STRINGS "${f}" lines REGEX "impl\\(\\)|engine_impl\\.h|Engine::Impl|EngineAccess::State")
    foreach(line ${lines})
      file(RELATIVE_PATH rel "${SOURCE_DIR}" "${f}")
      string(STRIP "${line}" line)
      string(APPEND found "\n  ${rel}: ${line}")
    endforeach()
  endforeach()
endforeach()
# The installed header itself offers no way in: no impl(), no constructor
# taking the internal TrainConfig (engine/engine_access.h is uckpt's own).
file(STRINGS "${SOURCE_DIR}/include/uckpt/engine.h" lines REGEX "impl\\(\\)|TrainConfig")
foreach(line ${lines})
  string(STRIP "${line}" line)
  string(APPEND found "\n  include/uckpt/engine.h: ${line}")
endforeach()
if(found)
  message(FATAL_ERROR "clients reach into the engine's state (use a public Engine call instead):${found}")
endif()
message(STATUS "ok: python/src, src/cli, src/models and examples use the public engine API only")
