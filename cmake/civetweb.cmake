# civetweb (Debian libcivetweb-dev) for the metrics endpoint. Its CMake package config insists on
# the separate civetweb executable, so the libraries are found directly.
find_path(CIVETWEB_INCLUDE_DIR CivetServer.h REQUIRED)
find_library(CIVETWEB_LIBRARY civetweb REQUIRED)
find_library(CIVETWEB_CPP_LIBRARY civetweb-cpp REQUIRED)
add_library(civetweb_cpp INTERFACE)
target_include_directories(civetweb_cpp INTERFACE ${CIVETWEB_INCLUDE_DIR})
target_link_libraries(civetweb_cpp INTERFACE ${CIVETWEB_CPP_LIBRARY} ${CIVETWEB_LIBRARY} dl)
