# Apply a patch series, in order, to a source tree; stop at the first patch that does not apply and
# name it. CMakeLists.txt includes this file; it also runs on its own:
#   cmake -DSOURCE_DIR=<tree> -DPATCH_DIR=<dir of *.patch> -P cmake/apply_patches.cmake

function(nbl_apply_patches source_dir)
    # a repository of its own, so that git apply does not resolve paths against an enclosing one
    if(NOT EXISTS "${source_dir}/.git")
        execute_process(COMMAND git init --quiet WORKING_DIRECTORY "${source_dir}" COMMAND_ERROR_IS_FATAL ANY)
    endif()
    foreach(patch IN LISTS ARGN)
        execute_process(
            COMMAND git apply --check "${patch}"
            WORKING_DIRECTORY "${source_dir}"
            RESULT_VARIABLE check_result
            ERROR_VARIABLE check_error)
        if(NOT check_result EQUAL 0)
            message(FATAL_ERROR "nbl: patch does not apply to ${source_dir}: ${patch}\n${check_error}")
        endif()
        execute_process(COMMAND git apply "${patch}" WORKING_DIRECTORY "${source_dir}" COMMAND_ERROR_IS_FATAL ANY)
        message(STATUS "nbl: applied ${patch}")
    endforeach()
endfunction()

if(CMAKE_SCRIPT_MODE_FILE STREQUAL CMAKE_CURRENT_LIST_FILE)
    file(GLOB patches "${PATCH_DIR}/*.patch")
    list(SORT patches)
    if(NOT patches)
        message(FATAL_ERROR "nbl: no *.patch in ${PATCH_DIR}")
    endif()
    nbl_apply_patches("${SOURCE_DIR}" ${patches})
endif()
