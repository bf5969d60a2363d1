# moecache_install_with_paths(FILES file... DESTINATION dir [RENAME name])
#
# Installs text files that name other installed files (a unit's ExecStart=, a drop-in's
# LD_PRELOAD=, a pkg-config file), with those names made right for the prefix of the install
# under way: `cmake --install --prefix /opt/moecache` and CPack (prefix /usr, whatever prefix the
# build was configured with) each get their own. Rewritten at install time, so the sources stay
# usable as they are (systemd-analyze verify reads the units straight from systemd/):
#   /usr/sbin/moecached      -> <prefix>/<sbindir>/moecached
#   /usr/lib/libmoecache-    -> <prefix>/<libdir>/libmoecache-
#   /usr/share/doc/moecache  -> <prefix>/<docdir>
#   @MOECACHE_PREFIX@, @MOECACHE_LIBDIR@, @MOECACHE_INCLUDEDIR@, @MOECACHE_VERSION@ (for .pc files)
# DESTINATION is relative to the prefix, or absolute (/etc/..., /usr/lib/systemd/...); RENAME
# names the installed file (one file only).
function(moecache_install_with_paths)
  cmake_parse_arguments(arg "" "DESTINATION;RENAME" "FILES" ${ARGN})
  if(IS_ABSOLUTE "${arg_DESTINATION}")
    set(dest "${arg_DESTINATION}")
  else()
    set(dest "\${CMAKE_INSTALL_PREFIX}/${arg_DESTINATION}")
  endif()
  foreach(file IN LISTS arg_FILES)
    get_filename_component(src "${file}" ABSOLUTE)
    get_filename_component(name "${file}" NAME)
    if(arg_RENAME)
      set(name "${arg_RENAME}")
    endif()
    string(MAKE_C_IDENTIFIER "${arg_DESTINATION}/${name}" id)
    set(staged "${CMAKE_CURRENT_BINARY_DIR}/install-with-paths/${id}/${name}")
    install(CODE "
      file(READ \"${src}\" text)
      string(REPLACE \"/usr/sbin/moecached\" \"\${CMAKE_INSTALL_PREFIX}/${CMAKE_INSTALL_SBINDIR}/moecached\" text \"\${text}\")
      string(REPLACE \"/usr/lib/libmoecache-\" \"\${CMAKE_INSTALL_PREFIX}/${CMAKE_INSTALL_LIBDIR}/libmoecache-\" text \"\${text}\")
      string(REPLACE \"/usr/share/doc/moecache\" \"\${CMAKE_INSTALL_PREFIX}/${CMAKE_INSTALL_DOCDIR}\" text \"\${text}\")
      string(REPLACE \"@MOECACHE_PREFIX@\" \"\${CMAKE_INSTALL_PREFIX}\" text \"\${text}\")
      string(REPLACE \"@MOECACHE_LIBDIR@\" \"${CMAKE_INSTALL_LIBDIR}\" text \"\${text}\")
      string(REPLACE \"@MOECACHE_INCLUDEDIR@\" \"${CMAKE_INSTALL_INCLUDEDIR}\" text \"\${text}\")
      string(REPLACE \"@MOECACHE_VERSION@\" \"${PROJECT_VERSION}\" text \"\${text}\")
      file(WRITE \"${staged}\" \"\${text}\")
      file(INSTALL DESTINATION \"${dest}\" TYPE FILE PERMISSIONS OWNER_READ OWNER_WRITE GROUP_READ WORLD_READ
           FILES \"${staged}\")
    ")
  endforeach()
endfunction()
